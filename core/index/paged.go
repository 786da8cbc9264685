package index

import "math"

// paged is a growable array whose elements never move. Growth adds a page
// instead of copying: an index of millions of nodes would otherwise copy
// hundreds of megabytes while holding a shard's write lock (stalling every
// reader), and would carry up to twice its size in slack capacity.
type paged[T any] struct {
	pages []*[pageSize]T
	n     int
}

const (
	pageBits = 12
	pageSize = 1 << pageBits
)

func (p *paged[T]) at(i uint32) *T { return &p.pages[i>>pageBits][i&(pageSize-1)] }

func (p *paged[T]) len() int { return p.n }

// grow appends a zero element and returns its index.
func (p *paged[T]) grow() uint32 {
	if p.n == len(p.pages)*pageSize {
		p.pages = append(p.pages, new([pageSize]T))
	}
	p.n++
	return uint32(p.n - 1)
}

// partMap splits a large u64map by key so that each resize rehashes a
// 1024th of it: the pause a writer imposes on readers stays short (a
// 15-million-entry table resized whole would stall them for a second).
// Keys must be well mixed (sequence hashes are XXH3 outputs).
type partMap struct{ parts [1 << partBits]u64map }

const (
	partBits  = 10
	partShift = 64 - partBits
)

// part uses a multiplier other than u64map's own, so the keys of one part
// still spread over all of its slots.
func (m *partMap) part(k uint64) *u64map { return &m.parts[(k*0xd6e8feb86659fd93)>>partShift] }

func (m *partMap) Get(k uint64) (uint32, bool) { return m.part(k).Get(k) }

func (m *partMap) warm(k uint64) uint32 { return m.part(k).warm(k) }

// Put inserts or replaces. A part's first table is sized between 16 and
// 24 slots according to its index: parts receive keys at the same rate, so
// with equal first sizes they would all grow at once, bunching their resize
// pauses and synchronising their load (the whole index would sit at the
// low point of the growth cycle together). Staggered by one growth step
// they stay spread out.
func (m *partMap) Put(k uint64, v uint32) {
	i := (k * 0xd6e8feb86659fd93) >> partShift
	p := &m.parts[i]
	if p.slots == nil {
		p.resize(int(16 * math.Pow(1.5, float64(i)/float64(len(m.parts)))))
	}
	p.Put(k, v)
}
func (m *partMap) Delete(k uint64) { m.part(k).Delete(k) }

func (m *partMap) Len() int {
	n := 0
	for i := range m.parts {
		n += m.parts[i].Len()
	}
	return n
}
