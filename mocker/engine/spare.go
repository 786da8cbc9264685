package engine

import (
	"sync"
	"unsafe"
)

// spareTables are the block tables of engines that are done (Engine.Free),
// kept for the next engines made with Config.ExpectedBlocks: a simulator's
// sweep runs one fleet after another in one process, and each fleet's
// tables were fresh memory, faulted in page by page and zeroed, while the
// last fleet's waited for the garbage collector.
var spareTables struct {
	sync.Mutex
	sets  []blockTables // oldest first
	bytes int
}

// maxSpareBytes bounds the spare tables (their own bytes; a table on
// huge pages holds up to 2 MB more for its alignment): what the engines
// of the runs a sweep has in flight hold (16 engines of 131,072 blocks,
// 96 MB), not more, so that tables no engine takes hold little memory.
const maxSpareBytes = 128 << 20

// blockTables are a block manager's large arrays.
type blockTables struct {
	blocks []block
	slots  []uint64
	lru    []int32
}

func (t *blockTables) bytes() int {
	return cap(t.blocks)*int(unsafe.Sizeof(block{})) + len(t.slots)*8 + cap(t.lru)*4
}

// takeTables takes a spare set of tables that fits n blocks (reserve):
// slots as many as n needs, the other two at least as long as n needs.
func takeTables(n int) (blockTables, bool) {
	slots := mapSlots(n)
	spareTables.Lock()
	defer spareTables.Unlock()
	sets := spareTables.sets
	for i := len(sets) - 1; i >= 0; i-- {
		t := sets[i]
		if len(t.slots) == slots && cap(t.blocks) >= n && cap(t.lru) >= lruRoom(n) {
			spareTables.sets = append(sets[:i], sets[i+1:]...)
			spareTables.bytes -= t.bytes()
			return t, true
		}
	}
	return blockTables{}, false
}

// putTables keeps t for a later engine, dropping the oldest sets beyond
// maxSpareBytes.
func putTables(t blockTables) {
	spareTables.Lock()
	defer spareTables.Unlock()
	spareTables.sets = append(spareTables.sets, t)
	spareTables.bytes += t.bytes()
	for spareTables.bytes > maxSpareBytes {
		spareTables.bytes -= spareTables.sets[0].bytes()
		spareTables.sets[0] = blockTables{}
		spareTables.sets = spareTables.sets[1:]
	}
}
