package bench

import "math/bits"

// histogram records durations in nanoseconds in log-linear buckets, as an
// HDR histogram does: values below 128 are exact, larger ones keep 7
// significant bits (relative error under 1/64). Recording is a few
// instructions and never allocates; histograms of several goroutines merge
// by adding buckets.
type histogram struct {
	counts [59 * 64]uint64
	n      uint64
	max    uint64
}

// bucketOf maps v to e·64 + v>>e, with e the shift that leaves v>>e in
// [64, 128) (0 for v < 128).
func bucketOf(v uint64) int {
	e := max(bits.Len64(v)-7, 0)
	return e<<6 + int(v>>e)
}

// bucketMid is the middle of bucket b's value range.
func bucketMid(b int) uint64 {
	if b < 128 {
		return uint64(b)
	}
	e := b/64 - 1
	m := uint64(b - e*64)
	return m<<e + (uint64(1)<<e)/2
}

func (h *histogram) record(v uint64) {
	h.counts[bucketOf(v)]++
	h.n++
	if v > h.max {
		h.max = v
	}
}

func (h *histogram) merge(o *histogram) {
	for i, c := range o.counts {
		h.counts[i] += c
	}
	h.n += o.n
	h.max = max(h.max, o.max)
}

// quantile returns the value at quantile q in [0, 1] (0 if empty).
func (h *histogram) quantile(q float64) uint64 {
	if h.n == 0 {
		return 0
	}
	rank := uint64(q*float64(h.n) + 0.5)
	rank = min(max(rank, 1), h.n)
	var seen uint64
	for b, c := range h.counts {
		seen += c
		if seen >= rank {
			return min(bucketMid(b), h.max)
		}
	}
	return h.max
}
