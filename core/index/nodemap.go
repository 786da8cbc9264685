package index

import (
	"math"
	"unsafe"

	"github.com/kvrouter/kvrouter/core/prefetch"
)

// nodeMap finds a tree node by the sequence hash of its path. A slot is one
// uint64: the hash's upper 32 bits (its tag) above the node's id, so an
// entry costs 8 bytes instead of the 12 a (hash, id) pair would, and the
// hash itself lives only in the node. A lookup confirms a tag match against
// the node, which every caller reads next anyway; two hashes of a part
// share a tag about once in four billion probes. Slots are placed by the
// tag alone, so growing a table never reads a node.
//
// The map is split into parts by hash so that a resize rehashes a 1024th
// of it: the pause a writer imposes on readers stays short (a table of
// fifteen million entries resized whole would stall them for a second).
// Hashes must be well mixed (sequence hashes are XXH3 outputs).
//
// Not safe for concurrent writers; concurrent readers are fine.
type nodeMap struct {
	parts [1 << partBits]nodeTable
	// floor is the fewest slots a part keeps (see reserve).
	floor int
}

const (
	partBits  = 10
	partShift = 64 - partBits
)

// nodeTable is one part: linear probing, no tombstones (deletion shifts the
// following run back). Node ids are never 0 (node 0 is the root sentinel),
// so 0 marks an empty slot. Sizes are not powers of two: a slot is chosen
// by multiply-shift range reduction, so the table grows by half and its
// load stays between 0.53 and 0.8.
type nodeTable struct {
	slots []uint64
	n     int
}

func tagOf(seq uint64) uint32 { return uint32(seq >> 32) }

// partOf uses a multiplier, so that a part's hashes still spread over the
// whole range of tags.
func (m *nodeMap) partOf(seq uint64) *nodeTable {
	return &m.parts[(seq*0xd6e8feb86659fd93)>>partShift]
}

func (t *nodeTable) home(tag uint32) int { return int(uint64(tag) * uint64(len(t.slots)) >> 32) }

func (t *nodeTable) next(i int) int {
	if i++; i == len(t.slots) {
		return 0
	}
	return i
}

// get returns the node whose sequence hash is seq.
func (m *nodeMap) get(seq uint64, nodes *paged[node]) (uint32, bool) {
	t := m.partOf(seq)
	if t.n == 0 {
		return 0, false
	}
	tag := tagOf(seq)
	for i := t.home(tag); ; i = t.next(i) {
		s := t.slots[i]
		if s == 0 {
			return 0, false
		}
		if uint32(s>>32) == tag {
			if id := uint32(s); nodes.at(id).seq() == seq {
				return id, true
			}
		}
	}
}

// prefetchHome asks for the slot a lookup of seq starts at, without
// waiting.
func (m *nodeMap) prefetchHome(seq uint64) {
	if t := m.partOf(seq); len(t.slots) > 0 {
		prefetch.Line(unsafe.Pointer(&t.slots[t.home(tagOf(seq))]))
	}
}

// prefetchRun asks for what removing seq reads: its home slot and the
// line after it, where the run that removal shifts back goes on.
func (m *nodeMap) prefetchRun(seq uint64) {
	if t := m.partOf(seq); len(t.slots) > 0 {
		i := t.home(tagOf(seq))
		prefetch.Line(unsafe.Pointer(&t.slots[i]))
		prefetch.Line(unsafe.Pointer(&t.slots[min(i+8, len(t.slots)-1)]))
	}
}

// getOrPut returns the node whose sequence hash is seq and true, or puts
// id under seq and returns it and false: a get and a put for one probe.
func (m *nodeMap) getOrPut(seq uint64, nodes *paged[node], id uint32) (uint32, bool) {
	t := m.roomFor(seq)
	tag := tagOf(seq)
	j := t.home(tag)
	for ; t.slots[j] != 0; j = t.next(j) {
		if s := t.slots[j]; uint32(s>>32) == tag {
			if n := uint32(s); nodes.at(n).seq() == seq {
				return n, true
			}
		}
	}
	t.slots[j] = uint64(tag)<<32 | uint64(id)
	t.n++
	return id, false
}

// roomFor returns seq's part, grown first if one more entry would
// overfill it. A part's first table is sized between 16 and 24 slots
// according to its index: parts receive hashes at the same rate, so with
// equal first sizes they would all grow at once, bunching their resize
// pauses.
func (m *nodeMap) roomFor(seq uint64) *nodeTable {
	i := (seq * 0xd6e8feb86659fd93) >> partShift
	t := &m.parts[i]
	switch {
	case t.slots == nil:
		t.resize(max(m.floor, int(16*math.Pow(1.5, float64(i)/float64(len(m.parts))))))
	case (t.n+1)*5 > len(t.slots)*4:
		t.resize(max(m.floor, len(t.slots)*3/2))
	}
	return t
}

// remove deletes node id, whose sequence hash is seq.
func (m *nodeMap) remove(seq uint64, id uint32) {
	t := m.partOf(seq)
	if t.n == 0 {
		return
	}
	want := uint64(tagOf(seq))<<32 | uint64(id)
	i := t.home(tagOf(seq))
	for t.slots[i] != want {
		if t.slots[i] == 0 {
			return
		}
		i = t.next(i)
	}
	// Shift back every later entry of the run that may move into the hole.
	for j := t.next(i); ; j = t.next(j) {
		s := t.slots[j]
		if s == 0 {
			break
		}
		h := t.home(uint32(s >> 32))
		// s may fill hole i unless its home lies cyclically in (i, j].
		if (j > i && (h <= i || h > j)) || (j < i && h <= i && h > j) {
			t.slots[i] = s
			i = j
		}
	}
	t.slots[i] = 0
	t.n--
	if len(t.slots) > 64 && t.n*8 < len(t.slots) && len(t.slots)/3 >= m.floor {
		t.resize(len(t.slots) / 3)
	}
}

// reserve sizes the map for n nodes: the engines' announced capacity, an
// upper bound on the nodes they can make the index hold (nodes they share
// count once). Filling a fleet's caches otherwise grows every part about
// twenty times over, which measured a tenth of the CPU while ten thousand
// engines filled theirs. A part takes the reserved size the first time it
// grows (engines register one by one; resizing every part at each would
// cost more than the growth it saves) and keeps it while the reservation
// stands, half full when the caches are: at two thirds full, removing a
// node shifted back runs long enough to cost a fifth of a removed block's
// time (see u64map.reserve).
func (m *nodeMap) reserve(n int) { m.floor = n / len(m.parts) * 2 }

func (t *nodeTable) resize(size int) {
	old := t.slots
	t.slots = make([]uint64, size)
	// Entries are unique and the new table has room: each goes to the
	// first free slot from its home. Walking the old table in order visits
	// homes in nearly increasing order, so the writes are close to
	// sequential.
	for _, s := range old {
		if s == 0 {
			continue
		}
		j := t.home(uint32(s >> 32))
		for t.slots[j] != 0 {
			j = t.next(j)
		}
		t.slots[j] = s
	}
}

func (m *nodeMap) len() int {
	n := 0
	for i := range m.parts {
		n += m.parts[i].n
	}
	return n
}
