package index

import "unsafe"

// prefetch asks the CPU to bring the cache line at p into its caches and
// returns at once (PREFETCHT0). It reads nothing the program sees, so p
// may be any address of the index's memory. Go has no prefetch of its own
// outside the runtime; see the warm passes in tree.go for why a load is
// not enough.
//
//go:noescape
func prefetch(p unsafe.Pointer)
