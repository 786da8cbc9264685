// Package hugepage allocates the large hash tables of the simulator's index
// and engines where the kernel may back them with 2 MiB pages. Those tables
// hold millions of slots read at random, so with 4 KiB pages nearly every
// probe also misses the TLB, and a prefetch of a slot waits for the page
// walk before it can fetch the line. Results do not depend on it: it only
// changes which pages back the memory.
package hugepage

import "unsafe"

// minBytes is the smallest table worth asking for.
const minBytes = 2 << 20

// pageBytes is the huge page size on x86-64 and arm64 Linux.
const pageBytes = 2 << 20

// Make returns a zeroed slice of n T (T must hold no pointers); a large
// one starts on a huge page boundary, and the kernel is asked to back it
// with huge pages where it can.
func Make[T any](n int) []T {
	var zero T
	size := unsafe.Sizeof(zero)
	if size == 0 || uintptr(n)*size < minBytes || !supported {
		return make([]T, n)
	}
	// Over-allocate by a huge page and start at the first boundary
	// inside: the heap aligns large blocks to 8 KiB only, and a table
	// of a few huge pages would otherwise straddle one more.
	extra := int((pageBytes + size - 1) / size)
	s := make([]T, n+extra)
	p := uintptr(unsafe.Pointer(unsafe.SliceData(s)))
	off := int((((p + pageBytes - 1) &^ (pageBytes - 1)) - p + size - 1) / size)
	s = s[off : off+n : off+n]
	advise(uintptr(unsafe.Pointer(unsafe.SliceData(s))), uintptr(n)*size)
	return s
}
