package engine

import (
	"runtime"
	"sync/atomic"
	"unsafe"
)

// Room reserved up front for tables that grow by appending.
//
// An engine's block array and LRU queue grow as its cache fills: an engine
// of 131,072 blocks reaches 2 MB of blocks and up to 2 MB of queue, but one
// of a thousand in a simulated fleet sees a few requests and must not pay
// for its capacity. Grown by doubling, each array was copied a dozen times
// on its way, each copy onto fresh pages that the kernel first zeroes. Here the array's
// room for its whole capacity is address space only: the kernel backs a
// page with memory when it is first written, once, so an engine's memory
// is what it has touched, as before, and the array never moves.

// hugeBytes is the huge page size on x86-64 and arm64 Linux.
const hugeBytes = 2 << 20

// reserve returns an empty slice of room for n T (T must hold no pointers),
// its memory mapped outside the Go heap and released when owner is
// collected, so the slice must not be kept past owner; or nil when room of
// that size is not worth reserving (under a huge page) or cannot be (other
// systems). The room starts on a huge page boundary, and its pages
// after the first huge page are asked to be huge pages, as the tables of
// core/hugepage are: the array is read at random, and a small engine never
// reaches them. promote asks for the first one too.
func reserve[T, O any](owner *O, n int) []T {
	var zero T
	size := int(unsafe.Sizeof(zero)) * n
	if size < hugeBytes {
		return nil
	}
	if reservations.Add(1) > maxReservations {
		reservations.Add(-1)
		return nil
	}
	all := mapAnon(size + hugeBytes)
	if all == nil {
		reservations.Add(-1)
		return nil
	}
	runtime.AddCleanup(owner, release, all)
	p := uintptr(unsafe.Pointer(unsafe.SliceData(all)))
	off := int((p+hugeBytes-1)&^(hugeBytes-1) - p)
	room := all[off : off+size : off+size]
	if size > hugeBytes {
		adviseHuge(room[hugeBytes:])
	}
	return unsafe.Slice((*T)(unsafe.Pointer(unsafe.SliceData(room))), n)[:0]
}

// reservations counts the rooms mapped and not yet released. Each is a
// mapping of its own, of which the kernel allows a process some 65,000
// (vm.max_map_count) for everything, the Go heap's included: past
// maxReservations, arrays grow by doubling on the heap instead.
var reservations atomic.Int64

var maxReservations int64 = 8192

func release(all []byte) {
	unmap(all)
	reservations.Add(-1)
}

// promote asks for huge pages for the first huge page of s's room (from
// reserve), once the array has grown to half of it: its first pages are
// small pages (see reserve), and the kernel gathers them into a huge page
// where it can.
func promote[T any](s []T) {
	first := unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(s))), hugeBytes)
	adviseHuge(first)
	collapse(first)
}
