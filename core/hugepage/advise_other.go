//go:build !linux

package hugepage

const supported = false

func advise(p, size uintptr) {}
