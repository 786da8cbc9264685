package engine

import "unsafe"

// prefetch asks the CPU for the cache line at p and returns at once
// (PREFETCHT0): the block maps of a simulated fleet are tens of megabytes,
// and a lookup that waits for its slot before asking for the next one
// pays a memory round trip per block.
//
//go:noescape
func prefetch(p unsafe.Pointer)
