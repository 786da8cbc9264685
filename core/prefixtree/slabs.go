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
//
// They are dropped at the first collection that finds no tree carving
// labels from slabs and none taken or handed on since the one before, so
// that a process holds them only while it builds trees: a sweep's other
// runs, the modes without trees, get the memory back.
var spareSlabs struct {
	sync.Mutex
	slabs  [][]uint32
	tokens int
	trees  int  // trees carving labels from slabs (slabSet.carving)
	used   bool // a slab taken or handed on since the last collection
	armed  bool // a collection is watched (watchCollection)
}

// maxSpareTokens bounds the spare slabs (512 MiB): what a fleet of eight
// trees holding a conversation trace's prompts fills; a process that
// lets no tree go keeps none.
const maxSpareTokens = 128 << 20

// slabSet is the slabs one tree carved labels from. It is apart from
// the tree so that a cleanup can hand them on once the tree is collected.
type slabSet struct {
	slabs   [][]uint32
	carving bool // counted in spareSlabs.trees
}

// newSlab is an empty slab of room for at least size tokens: the
// shortest spare one that has the room, else a new one.
func (t *Tree) newSlab(size int) []uint32 {
	if t.slabs == nil {
		t.slabs = &slabSet{carving: true}
		spareSlabs.Lock()
		spareSlabs.trees++
		spareSlabs.Unlock()
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
	spareSlabs.used = true
	last := len(spareSlabs.slabs) - 1
	spareSlabs.slabs[best] = spareSlabs.slabs[last]
	spareSlabs.slabs[last] = nil
	spareSlabs.slabs = spareSlabs.slabs[:last]
	spareSlabs.tokens -= cap(s)
	return s
}

// release hands the set's slabs to the spare ones, within maxSpareTokens,
// as its tree carves no more labels from slabs (it is collected, or has
// moved out of them). No label may lie in them any more.
func (set *slabSet) release() {
	spareSlabs.Lock()
	defer spareSlabs.Unlock()
	if set.carving {
		set.carving = false
		spareSlabs.trees--
	}
	if len(set.slabs) > 0 {
		spareSlabs.used = true
		watchCollection()
	}
	for _, s := range set.slabs {
		poisonSlab(s)
		if spareSlabs.tokens+cap(s) <= maxSpareTokens {
			spareSlabs.slabs = append(spareSlabs.slabs, s)
			spareSlabs.tokens += cap(s)
		}
	}
	set.slabs = nil
}

// watchCollection has the next collection call collection, unless one is
// watched already. spareSlabs is locked.
func watchCollection() {
	if spareSlabs.armed {
		return
	}
	spareSlabs.armed = true
	runtime.AddCleanup(new(sentinel), func(struct{}) { collection() }, struct{}{})
}

// sentinel is what watchCollection lets go of: large enough not to be
// batched with other small objects, whose cleanups may never run.
type sentinel [2]*int

// collection drops the spare slabs when no tree is alive and none was
// taken or handed on since the last collection; otherwise it watches
// the next one.
func collection() {
	spareSlabs.Lock()
	defer spareSlabs.Unlock()
	spareSlabs.armed = false
	if spareSlabs.used || spareSlabs.trees > 0 {
		spareSlabs.used = false
		if len(spareSlabs.slabs) > 0 {
			watchCollection()
		}
		return
	}
	clear(spareSlabs.slabs)
	spareSlabs.slabs, spareSlabs.tokens = spareSlabs.slabs[:0], 0
}
