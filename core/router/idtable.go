package router

// idTable maps engine ids to small ints and the engines' rank counts. It
// is built once per fleet and only read afterwards, so it needs no lock.
// Every decision looks up each worker holding the prompt's first block,
// often the whole fleet twice over (the event-fed and the predicted
// index); a multiplicative hash into a power-of-two table, at most half
// full, costs a few nanoseconds where Go's map costs about twenty. An
// entry keeps its key, value and rank count on one cache line, where three
// arrays could cost a lookup three misses once the fleet's table has left
// the cache.
type idTable struct {
	entries []idEntry
	shift   uint
}

type idEntry struct {
	id    uint64
	v     int32
	ranks int32 // 0 marks an unused entry
}

func newIDTable(n int) idTable {
	size, bits := 4, uint(2)
	for size < 2*n {
		size, bits = size*2, bits+1
	}
	return idTable{entries: make([]idEntry, size), shift: 64 - bits}
}

func (t *idTable) slot(id uint64) int { return int((id * 0x9e3779b97f4a7c15) >> t.shift) }

// put adds id → v for an engine of ranks ≥ 1 ranks; ids must be distinct
// and at most the n the table was made for.
func (t *idTable) put(id uint64, v, ranks int32) {
	i := t.slot(id)
	for t.entries[i].ranks != 0 {
		i = (i + 1) & (len(t.entries) - 1)
	}
	t.entries[i] = idEntry{id: id, v: v, ranks: ranks}
}

// get returns id's value and rank count.
func (t *idTable) get(id uint64) (v, ranks int32, ok bool) {
	if len(t.entries) == 0 {
		return 0, 0, false
	}
	for i := t.slot(id); t.entries[i].ranks != 0; i = (i + 1) & (len(t.entries) - 1) {
		if e := &t.entries[i]; e.id == id {
			return e.v, e.ranks, true
		}
	}
	return 0, 0, false
}
