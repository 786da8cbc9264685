package router

// idTable maps engine ids to small ints. It is built once per fleet and
// only read afterwards, so it needs no lock. Every lookup gets one probe
// per worker holding the prompt's first block, often the whole fleet; a
// multiplicative hash into a power-of-two table, at most half full, costs
// a few nanoseconds where Go's map costs about twenty.
type idTable struct {
	keys  []uint64
	vals  []int32
	used  []bool
	shift uint
}

func newIDTable(n int) idTable {
	size, bits := 4, uint(2)
	for size < 2*n {
		size, bits = size*2, bits+1
	}
	return idTable{keys: make([]uint64, size), vals: make([]int32, size), used: make([]bool, size), shift: 64 - bits}
}

func (t *idTable) slot(id uint64) int { return int((id * 0x9e3779b97f4a7c15) >> t.shift) }

// put adds id → v; ids must be distinct and at most the n the table was
// made for.
func (t *idTable) put(id uint64, v int32) {
	i := t.slot(id)
	for t.used[i] {
		i = (i + 1) & (len(t.keys) - 1)
	}
	t.keys[i], t.vals[i], t.used[i] = id, v, true
}

func (t *idTable) get(id uint64) (int32, bool) {
	if len(t.keys) == 0 {
		return 0, false
	}
	for i := t.slot(id); t.used[i]; i = (i + 1) & (len(t.keys) - 1) {
		if t.keys[i] == id {
			return t.vals[i], true
		}
	}
	return 0, false
}
