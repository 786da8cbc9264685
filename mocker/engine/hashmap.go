package engine

import (
	"math/bits"
	"unsafe"

	"github.com/kvrouter/kvrouter/core/hugepage"
	"github.com/kvrouter/kvrouter/core/prefetch"
)

// blockMap maps engine block ids to slot indices: open addressing with
// linear probing and backward-shift deletion, so that the constant churn of
// a full cache (an eviction and an insertion per new block) leaves no
// tombstones. Ids are already well-mixed hashes: the low bits index the
// table directly. The load factor stays at most 1/2: the table starts
// small and doubles as blocks come, up to the size the engine's capacity
// needs, so that an engine whose cache stays small (one of a thousand in a
// simulated fleet, each seeing a few requests) never pays for its whole
// capacity.
//
// A slot is one word: the id's low bits (its tag, which holds the bits
// that pick its home slot) above the slot index plus one (0: empty). A
// lookup that meets its tag confirms the whole id in the block the index
// names, which the callers that find a block read next anyway; one whose
// id is absent, most of a full cache's lookups, reads the table alone.
// Eight slots to a cache line instead of four halve the table, and the
// lines that a lookup, an insertion or an eviction must wait for.
type blockMap struct {
	slots   []uint64
	mask    uint64
	n       int
	idxBits uint     // the low bits of a slot that hold the index plus one
	tagMask uint64   // the id bits a slot keeps
	blocks  *[]block // the blocks the indices name, whose hash is their id
	gen     uint64   // counts the puts, deletions and clears
}

const minMapSlots = 16

// newBlockMap is a map of ids to indices below capacity into *blocks.
func newBlockMap(capacity int, blocks *[]block) blockMap {
	// One bit more than the indices below capacity need, in case the
	// manager's block list outgrows its capacity.
	b := uint(bits.Len(uint(capacity))) + 1
	return blockMap{
		slots:   make([]uint64, minMapSlots),
		mask:    minMapSlots - 1,
		idxBits: b,
		tagMask: 1<<(64-b) - 1,
		blocks:  blocks,
	}
}

// mapSlots is the table that holds n entries at most half its slots.
func mapSlots(n int) int { return max(minMapSlots, 1<<bits.Len(uint(2*n-1))) }

// use makes the empty table slots, of a power of two slots, the map's,
// before the first put.
func (m *blockMap) use(slots []uint64) {
	m.slots = slots
	m.mask = uint64(len(slots) - 1)
}

func (m *blockMap) idxOf(s uint64) int32 { return int32(s&(1<<m.idxBits-1)) - 1 }

// home is the home position of the id whose slot is s.
func (m *blockMap) home(s uint64) uint64 { return (s >> m.idxBits) & m.mask }

// grow doubles the table and reinserts every entry.
func (m *blockMap) grow() {
	old := m.slots
	m.slots = hugepage.Make[uint64](2 * len(old))
	m.mask = uint64(len(m.slots) - 1)
	// Zeroed already, but not touched: the pass touches its pages in
	// order, which the reinsertion below would touch in probe order.
	clear(m.slots)
	for _, s := range old {
		if s != 0 {
			i := m.home(s)
			for m.slots[i] != 0 {
				i = (i + 1) & m.mask
			}
			m.slots[i] = s
		}
	}
}

func (m *blockMap) len() int { return m.n }

func (m *blockMap) clear() {
	clear(m.slots)
	m.n = 0
	m.gen++
}

// find is the position of key's slot, or -1.
func (m *blockMap) find(key uint64) int {
	tag := key & m.tagMask
	for i := key & m.mask; ; i = (i + 1) & m.mask {
		s := m.slots[i]
		if s == 0 {
			return -1
		}
		if s>>m.idxBits == tag && (*m.blocks)[m.idxOf(s)].hash == key {
			return int(i)
		}
	}
}

func (m *blockMap) get(key uint64) (int32, bool) {
	if i := m.find(key); i >= 0 {
		return m.idxOf(m.slots[i]), true
	}
	return noBlock, false
}

// warm asks for the slot a lookup of key starts at, without waiting for
// it: a lookup far behind in the table is a memory round trip, and a few
// asked for ahead overlap theirs.
func (m *blockMap) warm(key uint64) {
	prefetch.Line(unsafe.Pointer(&m.slots[key&m.mask]))
}

// warmRun is warm for a deletion, which reads on past key's slot to the
// end of its run, shifting the run back: it also asks for the line after
// key's when the slot lies in the second half of its line.
func (m *blockMap) warmRun(key uint64) {
	prefetch.Line(unsafe.Pointer(&m.slots[key&m.mask]))
	prefetch.Line(unsafe.Pointer(&m.slots[(key+4)&m.mask]))
}

// put inserts key, which the map does not hold, for block val, whose hash
// is key already.
func (m *blockMap) put(key uint64, val int32) {
	if 2*(m.n+1) > len(m.slots) {
		m.grow()
	}
	i := key & m.mask
	for m.slots[i] != 0 {
		i = (i + 1) & m.mask
	}
	m.slots[i] = (key&m.tagMask)<<m.idxBits | uint64(val+1)
	m.n++
	m.gen++
}

func (m *blockMap) delete(key uint64) {
	i := m.find(key)
	if i < 0 {
		return
	}
	m.n--
	m.gen++
	// Backward shift: move later entries of the probe run into the hole
	// unless their home slot lies cyclically after the hole.
	h := uint64(i)
	j := h
	for {
		j = (j + 1) & m.mask
		s := m.slots[j]
		if s == 0 {
			break
		}
		if (j-m.home(s))&m.mask >= (j-h)&m.mask {
			m.slots[h] = s
			h = j
		}
	}
	m.slots[h] = 0
}

// each calls f for every entry, in table order.
func (m *blockMap) each(f func(key uint64, val int32)) {
	for _, s := range m.slots {
		if s != 0 {
			idx := m.idxOf(s)
			f((*m.blocks)[idx].hash, idx)
		}
	}
}
