package index

import (
	"math/bits"
	"unsafe"

	"github.com/kvrouter/kvrouter/core/prefetch"
)

// u64map maps uint64 keys to uint32 values with linear probing in one
// array of packed 12-byte slots. It exists because the index holds such an
// entry per cached block and worker (the engine's id of the block) and Go's
// map spends about 26 bytes on each; this one spends about 17 and answers a
// lookup with a single cache-line probe in the common case. Deletion shifts
// the following run back, so there are no tombstones.
//
// Sizes are not powers of two: a slot is chosen by multiply-shift range
// reduction, so the table grows by half and its load stays between 0.53
// and 0.8. With doubling, a table just past a threshold (an engine caching
// exactly 16,384 blocks) would sit at 44% load.
//
// Not safe for concurrent writers; concurrent readers are fine.
type u64map struct {
	slots []slot
	n     int
	// Key 0 marks an empty slot, so the key 0 itself lives here.
	zeroSet bool
	// keep holds the table at its largest: a map emptied and refilled all
	// the time (the predictions of a router between bursts) otherwise
	// shrinks at one eighth full and grows again, and every resize clears
	// and refills a fresh table.
	keep    bool
	zeroVal uint32
}

type slot [3]uint32 // key low, key high, value

func (s *slot) key() uint64 { return uint64(s[0]) | uint64(s[1])<<32 }

const fib = 0x9e3779b97f4a7c15

func (m *u64map) Len() int {
	if m.zeroSet {
		return m.n + 1
	}
	return m.n
}

func (m *u64map) home(k uint64) int {
	hi, _ := bits.Mul64(k*fib, uint64(len(m.slots)))
	return int(hi)
}

func (m *u64map) Get(k uint64) (uint32, bool) {
	if k == 0 {
		return m.zeroVal, m.zeroSet
	}
	if m.n == 0 {
		return 0, false
	}
	lo, hi := uint32(k), uint32(k>>32)
	for i := m.home(k); ; i = m.next(i) {
		s := &m.slots[i]
		if s[0] == lo && s[1] == hi {
			return s[2], true
		}
		if s[0] == 0 && s[1] == 0 {
			return 0, false
		}
	}
}

// prefetchRun asks for the line of k's home slot and the line after it,
// without waiting: a miss scans on to the end of the run, an insertion
// fills its end and a deletion shifts it back, and at seven tenths full
// runs often cross into the next line.
func (m *u64map) prefetchRun(k uint64) {
	if len(m.slots) > 0 {
		i := m.home(k)
		prefetch.Line(unsafe.Pointer(&m.slots[i]))
		prefetch.Line(unsafe.Pointer(&m.slots[min(i+5, len(m.slots)-1)]))
	}
}

// prefetchHome asks for the slot a lookup of k starts at, without waiting.
func (m *u64map) prefetchHome(k uint64) {
	if len(m.slots) > 0 {
		prefetch.Line(unsafe.Pointer(&m.slots[m.home(k)]))
	}
}

func (m *u64map) next(i int) int {
	if i++; i == len(m.slots) {
		return 0
	}
	return i
}

func (m *u64map) Put(k uint64, v uint32) {
	if k == 0 {
		m.zeroSet, m.zeroVal = true, v
		return
	}
	if s, found := m.slotFor(k); found {
		s[2] = v
	} else {
		*s = slot{uint32(k), uint32(k >> 32), v}
		m.n++
	}
}

// Insert maps k to v unless k is mapped already, and returns the value k
// had and whether it had one: a Get and, for a new key, a Put for one
// probe.
func (m *u64map) Insert(k uint64, v uint32) (uint32, bool) {
	if k == 0 {
		old, had := m.zeroVal, m.zeroSet
		if !had {
			m.zeroSet, m.zeroVal = true, v
		}
		return old, had
	}
	s, found := m.slotFor(k)
	if found {
		return s[2], true
	}
	*s = slot{uint32(k), uint32(k >> 32), v}
	m.n++
	return 0, false
}

// slotFor returns the slot holding k (not 0), or the empty slot where k
// goes, with room made for one more entry first.
func (m *u64map) slotFor(k uint64) (*slot, bool) {
	if (m.n+1)*5 > len(m.slots)*4 {
		m.resize(max(16, len(m.slots)*3/2))
	}
	lo, hi := uint32(k), uint32(k>>32)
	for i := m.home(k); ; i = m.next(i) {
		s := &m.slots[i]
		if s[0] == lo && s[1] == hi {
			return s, true
		}
		if s[0] == 0 && s[1] == 0 {
			return s, false
		}
	}
}

func (m *u64map) Delete(k uint64) { m.Take(k) }

// Take deletes k and returns the value it had: a Get and a Delete for one
// probe.
func (m *u64map) Take(k uint64) (uint32, bool) {
	if k == 0 {
		v, ok := m.zeroVal, m.zeroSet
		m.zeroSet, m.zeroVal = false, 0
		return v, ok
	}
	if m.n == 0 {
		return 0, false
	}
	lo, hi := uint32(k), uint32(k>>32)
	i := m.home(k)
	for {
		s := &m.slots[i]
		if s[0] == 0 && s[1] == 0 {
			return 0, false
		}
		if s[0] == lo && s[1] == hi {
			break
		}
		i = m.next(i)
	}
	v := m.slots[i][2]
	// Shift back every later entry of the run that may move into the hole.
	for j := m.next(i); ; j = m.next(j) {
		s := &m.slots[j]
		if s[0] == 0 && s[1] == 0 {
			break
		}
		h := m.home(s.key())
		// s may fill hole i unless its home lies cyclically in (i, j].
		if (j > i && (h <= i || h > j)) || (j < i && h <= i && h > j) {
			m.slots[i] = *s
			i = j
		}
	}
	m.slots[i] = slot{}
	m.n--
	if !m.keep && len(m.slots) > 64 && m.n*8 < len(m.slots) {
		m.resize(len(m.slots) / 3)
	}
	return v, true
}

// reserve sizes the table for n entries, so that filling it never resizes.
// A reserved table is seven tenths full at n entries, not four fifths as
// growth would leave it: an engine's table is full as long as its cache
// is, and at four fifths the runs a deletion shifts back and a miss scans
// are over twice as long. With both tables reserved roomier (see
// nodeMap.reserve), removing a block at 1000 workers took 159–213 ns
// instead of 277–323 ns in bench index, for 6 bytes more a pair.
func (m *u64map) reserve(n int) {
	if want := n*10/7 + 1; want > len(m.slots) {
		m.resize(want)
	}
}

func (m *u64map) resize(size int) {
	old := m.slots
	m.slots = make([]slot, size)
	// Keys are unique and the new table has room: each goes to the first
	// free slot from its home, with none of Put's checks. Walking the old
	// table in order visits homes in nearly increasing order (placement is
	// monotonic in the mixed key), so the writes are close to sequential.
	for i := range old {
		s := &old[i]
		if s[0] == 0 && s[1] == 0 {
			continue
		}
		j := m.home(s.key())
		for m.slots[j][0] != 0 || m.slots[j][1] != 0 {
			j = m.next(j)
		}
		m.slots[j] = *s
	}
}

// Range calls f for every entry until f returns false. f must not modify m.
func (m *u64map) Range(f func(k uint64, v uint32) bool) {
	if m.zeroSet && !f(0, m.zeroVal) {
		return
	}
	for i := range m.slots {
		if s := &m.slots[i]; s[0] != 0 || s[1] != 0 {
			if !f(s.key(), s[2]) {
				return
			}
		}
	}
}
