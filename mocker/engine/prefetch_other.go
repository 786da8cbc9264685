//go:build !amd64

package engine

import "unsafe"

// prefetch does nothing where the engine has no prefetch instruction.
func prefetch(p unsafe.Pointer) {}
