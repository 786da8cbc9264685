package engine

import (
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
type blockMap struct {
	slots []mapSlot
	mask  uint64
	n     int
}

type mapSlot struct {
	key uint64
	val int32 // noBlock when empty
}

const minMapSlots = 16

func newBlockMap() blockMap {
	m := blockMap{slots: make([]mapSlot, minMapSlots), mask: minMapSlots - 1}
	m.clear()
	return m
}

// grow doubles the table and reinserts every entry.
func (m *blockMap) grow() {
	old := m.slots
	m.slots = hugepage.Make[mapSlot](2 * len(old))
	m.mask = uint64(len(m.slots) - 1)
	m.clear()
	for _, s := range old {
		if s.val != noBlock {
			m.put(s.key, s.val)
		}
	}
}

func (m *blockMap) len() int { return m.n }

func (m *blockMap) clear() {
	for i := range m.slots {
		m.slots[i] = mapSlot{val: noBlock}
	}
	m.n = 0
}

func (m *blockMap) get(key uint64) (int32, bool) {
	for i := key & m.mask; ; i = (i + 1) & m.mask {
		s := &m.slots[i]
		if s.val == noBlock {
			return noBlock, false
		}
		if s.key == key {
			return s.val, true
		}
	}
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
	prefetch.Line(unsafe.Pointer(&m.slots[(key+2)&m.mask]))
}

// put inserts or replaces key.
func (m *blockMap) put(key uint64, val int32) {
	for i := key & m.mask; ; i = (i + 1) & m.mask {
		s := &m.slots[i]
		if s.val == noBlock {
			if 2*(m.n+1) > len(m.slots) {
				m.grow()
				m.put(key, val)
				return
			}
			*s = mapSlot{key: key, val: val}
			m.n++
			return
		}
		if s.key == key {
			s.val = val
			return
		}
	}
}

func (m *blockMap) delete(key uint64) {
	i := key & m.mask
	for {
		s := &m.slots[i]
		if s.val == noBlock {
			return
		}
		if s.key == key {
			break
		}
		i = (i + 1) & m.mask
	}
	m.n--
	// Backward shift: move later entries of the probe run into the hole
	// unless their home slot lies cyclically after the hole.
	j := i
	for {
		j = (j + 1) & m.mask
		s := m.slots[j]
		if s.val == noBlock {
			break
		}
		home := s.key & m.mask
		if (j-home)&m.mask >= (j-i)&m.mask {
			m.slots[i] = s
			i = j
		}
	}
	m.slots[i] = mapSlot{val: noBlock}
}

// each calls f for every entry, in table order.
func (m *blockMap) each(f func(key uint64, val int32)) {
	for _, s := range m.slots {
		if s.val != noBlock {
			f(s.key, s.val)
		}
	}
}
