// Package buffers keeps a few freed buffers for reuse by size: the
// longest ones let go, handed out shortest-that-fits, so that a long
// request finds the room a long one left and a short one does not take
// it. Not safe for concurrent use: each owner keeps its own.
package buffers

// Longest are kept empty buffers of T.
type Longest[T any] [][]T

// Take is the shortest kept buffer with room for n, taken out of l, or
// nil when none has the room.
func (l *Longest[T]) Take(n int) []T {
	kept := *l
	best := -1
	for i, x := range kept {
		if cap(x) >= n && (best < 0 || cap(x) < cap(kept[best])) {
			best = i
		}
	}
	if best < 0 {
		return nil
	}
	x := kept[best]
	last := len(kept) - 1
	kept[best] = kept[last]
	kept[last] = nil
	*l = kept[:last]
	return x
}

// Keep keeps x, emptied, while fewer than most are kept; then in place
// of the shortest kept one if x is longer, so that what is kept serves
// the longest requests. A buffer is never dropped for being short while
// there is room: more than most would only hold a finished burst's
// buffers for good.
func (l *Longest[T]) Keep(x []T, most int) {
	kept := *l
	if cap(x) == 0 {
		return
	}
	if len(kept) < most {
		*l = append(kept, x[:0])
		return
	}
	short := 0
	for i, y := range kept {
		if cap(y) < cap(kept[short]) {
			short = i
		}
	}
	if cap(x) > cap(kept[short]) {
		kept[short] = x[:0]
	}
}
