package index

import (
	"math/bits"
	"unsafe"

	"github.com/kvrouter/kvrouter/core/hugepage"
	"github.com/kvrouter/kvrouter/core/prefetch"
)

// setMap is Single's table from a sequence hash to the set of ranks
// holding it while the index has at most setMapRanks ranks: pairMap's
// linear probing in 8-byte slots, eight to a cache line, so that the
// table of a million blocks takes 16 MB rather than 32 and more of it
// stays in the caches.
//
// A slot holds h<<8 | set, h = k·mixer (a bijection of k): the low 56
// bits of h and the set of up to 8 ranks (an empty slot is 0; a key's set
// is never empty). The top 8 bits of h are the top 8 bits of the home
// slot, which the table knows without storing them because no key lies
// as far as span slots from its home: two keys with the same low 56 bits
// have homes a non-zero multiple of span apart (their top 8 bits differ),
// so within span slots of a key's home no other key has its stored bits,
// and a probe that looks no further answers exactly. An insertion that
// finds no free slot within span grows the table, which doubles span; a
// table of a million slots has a span of 4,096, beyond any run at its
// load.
type setMap struct {
	slots []uint64
	shift uint8 // 64 - log2(len(slots))
	span  int   // len(slots) >> 8
	n     int
}

const (
	// setMapRanks is how many ranks a setMap's sets hold.
	setMapRanks = 8
	setBits     = 1<<setMapRanks - 1
	// setMapMinSlots keeps span at 16 or more.
	setMapMinSlots = 16 << 8
	mixer          = 0x9e3779b97f4a7c15
)

// unmixer is mixer's inverse modulo 2^64: a key is h·unmixer.
var unmixer = func() uint64 {
	inv := uint64(mixer) // right to 3 bits; each step doubles them
	for range 5 {
		inv *= 2 - mixer*inv
	}
	return inv
}()

// home is the first slot of the home line of the key whose mixed hash is
// h: runs start at line starts, as pairMap's do.
func (m *setMap) home(h uint64) int { return int(h>>m.shift) &^ 7 }

// dist is how far slot i, which holds w, lies from its key's home: the
// home's bits below its top 8 are w's, and the home lies less than span
// before i.
func (m *setMap) dist(i int, w uint64) int {
	return (i - int((w>>8)>>m.shift)&^7) & (m.span - 1)
}

// reserve sizes m for n keys without growing.
func (m *setMap) reserve(n int) {
	if want := slotsFor(n, setMapMinSlots); want > len(m.slots) {
		m.rehash(want)
	}
}

// slotsFor is the size of a table of at least least slots that holds n
// keys without growing: at most three quarters full.
func slotsFor(n, least int) int {
	for least*3 < n*4 {
		least *= 2
	}
	return least
}

// rehash moves the keys to a table of size slots, or of more if one
// would lie a span or more from its home.
func (m *setMap) rehash(size int) {
	old := *m
	for {
		m.slots = hugepage.Make[uint64](size)
		m.shift = uint8(64 - bits.TrailingZeros(uint(size)))
		m.span = size >> 8
		ok := true
		for i, w := range old.slots {
			if w == 0 {
				continue
			}
			h := old.hash(i, w)
			j, free := m.free(h)
			if !free {
				ok = false
				break
			}
			m.slots[j] = h<<8 | w&setBits
		}
		if ok {
			return
		}
		size *= 2
	}
}

// free returns the first free slot within span of h's home.
func (m *setMap) free(h uint64) (int, bool) {
	mask := len(m.slots) - 1
	i := m.home(h)
	for d := 0; d < m.span; d++ {
		if m.slots[(i+d)&mask] == 0 {
			return (i + d) & mask, true
		}
	}
	return 0, false
}

func (m *setMap) prefetch(k uint64) {
	if len(m.slots) > 0 {
		prefetch.Line(unsafe.Pointer(&m.slots[m.home(k*mixer)]))
	}
}

// prefetchRun is pairMap.prefetchRun.
func (m *setMap) prefetchRun(k uint64) {
	if len(m.slots) > 0 {
		h := m.home(k * mixer)
		prefetch.Line(unsafe.Pointer(&m.slots[h]))
		prefetch.Line(unsafe.Pointer(&m.slots[(h+8)&(len(m.slots)-1)]))
	}
}

// probe returns the slot of the key whose mixed hash is h and whether it
// holds the key; else the first free slot within span of its home, or -1
// if there is none.
func (m *setMap) probe(h uint64) (int, bool) {
	mask := len(m.slots) - 1
	tag := h << 8
	i := m.home(h)
	for d := 0; d < m.span; d, i = d+1, (i+1)&mask {
		w := m.slots[i]
		if w == 0 {
			return i, false
		}
		if w&^setBits == tag {
			return i, true
		}
	}
	return -1, false
}

// get returns k's set (empty if absent).
func (m *setMap) get(k uint64) uint64 {
	if len(m.slots) == 0 {
		return 0
	}
	if i, ok := m.probe(k * mixer); ok {
		return m.slots[i] & setBits
	}
	return 0
}

// add puts bit into k's set and reports whether it was there.
func (m *setMap) add(k, bit uint64) bool {
	if (m.n+1)*4 > len(m.slots)*3 {
		m.rehash(max(2*len(m.slots), setMapMinSlots))
	}
	h := k * mixer
	i, ok := m.probe(h)
	for i < 0 {
		m.rehash(2 * len(m.slots))
		i, ok = m.probe(h)
	}
	if ok {
		had := m.slots[i]&bit != 0
		m.slots[i] |= bit
		return had
	}
	m.slots[i] = h<<8 | bit
	m.n++
	return false
}

// remove takes bit out of k's set, and k with its last, and reports
// whether it was there.
func (m *setMap) remove(k, bit uint64) bool {
	if len(m.slots) == 0 {
		return false
	}
	i, ok := m.probe(k * mixer)
	if !ok || m.slots[i]&bit == 0 {
		return false
	}
	if m.slots[i] &^= bit; m.slots[i]&setBits == 0 {
		m.drop(i)
	}
	return true
}

// drop empties slot i, shifting back the entries after it whose home does
// not lie in (i, j].
func (m *setMap) drop(i int) {
	mask := len(m.slots) - 1
	for j := (i + 1) & mask; m.slots[j] != 0; j = (j + 1) & mask {
		if m.dist(j, m.slots[j]) >= (j-i)&mask {
			m.slots[i] = m.slots[j]
			i = j
		}
	}
	m.slots[i] = 0
	m.n--
}

// hash is the mixed hash of the key in slot i, which holds w: its top 8
// bits are its home's.
func (m *setMap) hash(i int, w uint64) uint64 {
	home := (i - m.dist(i, w)) & (len(m.slots) - 1)
	return w>>8 | uint64(home>>(56-m.shift))<<56
}

// each calls f with every key and its set.
func (m *setMap) each(f func(k, set uint64)) {
	for i, w := range m.slots {
		if w != 0 {
			f(m.hash(i, w)*unmixer, w&setBits)
		}
	}
}
