// Package prefetch asks the CPU for cache lines ahead of their use. The
// index and the mocker's block maps walk hash tables of millions of slots
// where each probe is a cache miss; asking for the next slots while the
// current one is worked on overlaps those misses. Go has no prefetch of
// its own outside the runtime, and a plain load would stall on the miss.
package prefetch

import "unsafe"

// Line asks the CPU to bring the cache line at p into its caches and
// returns at once (PREFETCHT0). It reads nothing the program sees, so p
// may be any address the caller owns.
//
//go:noescape
func Line(p unsafe.Pointer)
