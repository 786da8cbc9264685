package prefixtree

import (
	"runtime"
	"sync"

	"github.com/kvrouter/kvrouter/core/hugepage"
)

// spareSlabs are the slabs of trees that need them no more (collected,
// or moved out of them), kept for the next trees. A simulator's sweep
// builds one fleet's trees after another in one process, and every tree
// filled slabs of fresh memory, which the kernel faulted in and zeroed
// page by page, or the heap zeroed, while the last fleet's slabs waited
// for the collector: that was a seventh of a cache-aware run. A spare
// slab is not zeroed: a label is written before it is read, and nothing
// reads a slab past its labels.
var spareSlabs struct {
	sync.Mutex
	slabs  [][]uint32
	tokens int
}

// maxSpareTokens bounds the spare slabs (512 MiB): what a fleet of eight
// trees holding a conversation trace's prompts fills; a process that
// lets no tree go keeps none.
const maxSpareTokens = 128 << 20

// slabSet is the slabs one tree carved labels from. It is apart from
// the tree so that a cleanup can hand them on once the tree is collected.
type slabSet struct{ slabs [][]uint32 }

// newSlab is an empty slab of room for at least size tokens: the
// shortest spare one that has the room, else a new one.
func (t *Tree) newSlab(size int) []uint32 {
	if t.slabs == nil {
		t.slabs = new(slabSet)
		runtime.AddCleanup(t, (*slabSet).release, t.slabs)
	}
	s := takeSlab(size)
	if s == nil {
		s = hugepage.Make[uint32](size)
	}
	t.slabs.slabs = append(t.slabs.slabs, s)
	return s[:0]
}

func takeSlab(size int) []uint32 {
	spareSlabs.Lock()
	defer spareSlabs.Unlock()
	best := -1
	for i, s := range spareSlabs.slabs {
		if cap(s) >= size && (best < 0 || cap(s) < cap(spareSlabs.slabs[best])) {
			best = i
		}
	}
	if best < 0 {
		return nil
	}
	s := spareSlabs.slabs[best]
	last := len(spareSlabs.slabs) - 1
	spareSlabs.slabs[best] = spareSlabs.slabs[last]
	spareSlabs.slabs[last] = nil
	spareSlabs.slabs = spareSlabs.slabs[:last]
	spareSlabs.tokens -= cap(s)
	return s
}

// release hands the set's slabs to the spare ones, within maxSpareTokens.
// No label may lie in them any more.
func (set *slabSet) release() {
	if set == nil {
		return
	}
	spareSlabs.Lock()
	defer spareSlabs.Unlock()
	for _, s := range set.slabs {
		poisonSlab(s)
		if spareSlabs.tokens+cap(s) <= maxSpareTokens {
			spareSlabs.slabs = append(spareSlabs.slabs, s)
			spareSlabs.tokens += cap(s)
		}
	}
	set.slabs = nil
}
