//go:build !amd64

package index

import "unsafe"

// prefetch does nothing where the index has no prefetch instruction: the
// warm passes then only cost their loops.
func prefetch(p unsafe.Pointer) {}
