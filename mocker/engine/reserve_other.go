//go:build !linux

package engine

func mapAnon(size int) []byte { return nil }
func unmap(b []byte)          {}
func adviseHuge(b []byte)     {}
func collapse(b []byte)       {}
