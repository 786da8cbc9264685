package index

import (
	"container/heap"
	"slices"
	"sync/atomic"
	"unsafe"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/prefetch"
)

// tree is the single-threaded heart of the index: which worker ranks hold
// which blocks. It does no locking; Index wraps it in shards.
//
// The prefix tree is stored flat. A node is identified by the sequence hash
// of its path (blockhash.Chain folded over the local hashes from the root),
// which is exactly the hash a request computes for its own blocks. Matching
// a request is therefore one hash-map probe per block, with no per-node
// child maps: that is what keeps a pair (block, worker) under 64 bytes and a
// lookup free of pointer chasing. Nodes live in an arena of pointer-free
// structs, so the garbage collector never scans the index.
//
// Nodes that no worker holds are kept while they have children, so that a
// child's path is never lost when its parent is removed without cascade.
type tree struct {
	nodes paged[node]
	free  []uint32
	// bySeq maps a path's sequence hash to its node.
	bySeq nodeMap
	// stamps holds each node's last-use tick, only under a memory cap
	// (lru). Readers write it atomically so that eviction can pick the
	// least recently matched leaves.
	stamps paged[uint32]
	lru    bool
	// sets holds the worker slots of nodes held by two or more workers; a
	// node held by one worker keeps it inline.
	sets     []holderSet
	freeSets []uint32

	workers []workerState
	slotOf  map[kv.Worker]uint32
	// reserved is each worker's announced capacity in blocks, used to size
	// its engine-id table once (growing a table of millions of entries
	// costs more than filling it) and to bound it (RankBound).
	reserved map[kv.Worker]int
	// refused counts, per worker, the stored blocks refused past its
	// bound; kept while the worker is announced, across its clears.
	refused map[kv.Worker]uint64
	// freeSlots are slots of removed workers, reused so that slot numbers
	// (and the per-query scratch sized by them) stay bounded.
	freeSlots []uint32

	pairs uint64
	// holey counts the workers marked holey (see Prefix closure); find
	// jumps only while it is 0.
	holey int
	// tick is the logical clock of last use: bumped by every FindMatches
	// call, read atomically by concurrent readers.
	tick atomic.Uint32

	stats Stats

	// locate, when set, is asked where a stored event's unknown parent
	// sits (see Config.Locate).
	locate Locator
	// foreign, on a lower tier's tree, finds the sequence hash of a
	// parent the worker holds on another tier (see tiers.go).
	foreign func(w kv.Worker, h uint64) (uint64, bool)
	// placed is the node beginStored placed for a parent found on another
	// tier, pinned (one child more) while the chain is stored below it: a
	// block of the chain that replaces one of the worker's may otherwise
	// collect it, and the chain would hang from a freed node. The chain's
	// first block may also already exist below another such node of the
	// same path, leaving this one childless: storeBlocks' caller unpins
	// and collects it (see unplace).
	placed uint32

	// Scratch of the warm passes (see warmStore).
	seqs      []uint64
	warmNodes []uint32

	// readersWaiting, in an Index's trees, counts the lookups waiting for
	// the shard's lock: a store or removal stops at the next block while
	// it is not 0, so that its caller lets them in (see storeChunked).
	readersWaiting *atomic.Int32
}

const rootParent = 0 // node 0 is a sentinel; parent 0 means "hangs off the root"

type node struct {
	// The hashes are stored as 32-bit halves so that the struct needs only
	// 4-byte alignment: 28 bytes instead of 32, per cached block.
	seqLo, seqHi     uint32
	localLo, localHi uint32
	parent           uint32
	children         uint32
	// h says who holds the node: noHolder, one worker slot, or setFlag
	// with an index into tree.sets for two or more holders.
	h uint32
}

const (
	noHolder = ^uint32(0)
	setFlag  = uint32(1) << 31
)

func newNode(seq, local uint64, parent uint32) node {
	return node{seqLo: uint32(seq), seqHi: uint32(seq >> 32), localLo: uint32(local), localHi: uint32(local >> 32), parent: parent, h: noHolder}
}

func (n *node) seq() uint64   { return uint64(n.seqLo) | uint64(n.seqHi)<<32 }
func (n *node) local() uint64 { return uint64(n.localLo) | uint64(n.localHi)<<32 }
func (n *node) held() bool    { return n.h != noHolder }

// nw is the number of worker slots holding n.
func (t *tree) nw(n *node) int {
	switch {
	case n.h == noHolder:
		return 0
	case n.h&setFlag != 0:
		return len(t.sets[n.h&^setFlag].slots)
	}
	return 1
}

// holderSet is the slots of a node held by several workers, with the XOR
// of their fingerprints: along a path the holder set rarely changes (a
// system prompt is held by the whole fleet level after level), and equal
// fingerprints let find skip such a level in O(1) instead of O(holders).
// kids[i] bounds from above how many of the node's children slots[i]
// holds (see Prefix closure).
type holderSet struct {
	fp    uint64
	slots []uint32
	kids  []uint32
}

// slotFP fingerprints one worker slot (splitmix64's finaliser), so that
// the XOR over a set identifies the set with overwhelming probability.
func slotFP(s uint32) uint64 {
	z := uint64(s) + 0x9e3779b97f4a7c15
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	return z ^ z>>31
}

// fp is the fingerprint of n's holder set.
func (t *tree) fp(n *node) uint64 {
	switch {
	case n.h == noHolder:
		return 0
	case n.h&setFlag != 0:
		return t.sets[n.h&^setFlag].fp
	}
	return slotFP(n.h)
}

type workerState struct {
	id   kv.Worker
	live bool
	// holey: the worker may hold a block without its parent (see Prefix
	// closure).
	holey bool
	// blocks maps the engine's opaque block id to the node it named.
	blocks u64map
	// bound is RankBound of the worker's announced capacity; 0 for none.
	bound int
	// extraRefs counts, per node, engine ids beyond the first that name the
	// same node (e.g. the same tokens stored under two cache salts), so that
	// removing one of them does not forget the block.
	extraRefs map[uint32]uint32
	// inferred are the nodes held under an id the index made up (see
	// anchor), each with the number of this worker's held nodes directly
	// below it: an inferred block is known only through the blocks that
	// hang from it, so it is dropped with the last of them.
	inferred map[uint32]uint32
}

func newTree(lru bool) *tree {
	t := &tree{
		slotOf:   make(map[kv.Worker]uint32),
		reserved: make(map[kv.Worker]int),
		refused:  make(map[kv.Worker]uint64),
		lru:      lru,
	}
	t.nodes.grow() // node 0 is the root sentinel
	if lru {
		t.stamps.grow()
	}
	t.tick.Store(1)
	return t
}

// slot returns the dense slot of w, creating it when create is set.
func (t *tree) slot(w kv.Worker, create bool) (uint32, bool) {
	if s, ok := t.slotOf[w]; ok {
		return s, true
	}
	if !create {
		return 0, false
	}
	var s uint32
	if n := len(t.freeSlots); n > 0 {
		s = t.freeSlots[n-1]
		t.freeSlots = t.freeSlots[:n-1]
	} else {
		s = uint32(len(t.workers))
		t.workers = append(t.workers, workerState{})
	}
	t.workers[s] = workerState{id: w, live: true, bound: RankBound(t.reserved[w])}
	t.workers[s].blocks.reserve(t.reserved[w])
	t.slotOf[w] = s
	return s, true
}

// workerSet returns the slots holding n. one is scratch for the inline case.
func (t *tree) workerSet(n *node, one *[1]uint32) []uint32 {
	switch {
	case n.h == noHolder:
		return nil
	case n.h&setFlag != 0:
		return t.sets[n.h&^setFlag].slots
	}
	one[0] = n.h
	return one[:]
}

func (t *tree) holds(n *node, s uint32) bool {
	var one [1]uint32
	return slices.Contains(t.workerSet(n, &one), s)
}

// Prefix closure. A worker whose held blocks always include their
// parents holds, with any block, the whole path above it; find relies on
// that to probe a match every jumpSpan blocks instead of at every one
// (see find). Engines evict leaves first (vLLM frees a request's blocks
// tail first, SGLang evicts radix-tree leaves), so a worker breaks closure
// only when an event is lost or an engine evicts otherwise. The tree
// tracks the workers that may have broken it: a worker is marked holey
// when it comes to hold a block without its parent, or drops a block
// while holding one of its children. The second needs the number of a
// node's children its holder holds: for a node of one holder, its
// children count (exact while no worker is holey, an upper bound
// otherwise); for a node of several, the holder set's kids. The counts
// only err upwards, so a hole is never missed; a worker is unmarked when
// it holds nothing.

// holderIndex is s's position among n's holders, or -1.
func (t *tree) holderIndex(n *node, s uint32) int {
	switch {
	case n.h == noHolder:
		return -1
	case n.h&setFlag != 0:
		return slices.Index(t.sets[n.h&^setFlag].slots, s)
	case n.h == s:
		return 0
	}
	return -1
}

// heldKids bounds from above how many of n's children its holder at
// position i holds.
func (t *tree) heldKids(n *node, i int) uint32 {
	if n.h&setFlag != 0 {
		return t.sets[n.h&^setFlag].kids[i]
	}
	return n.children
}

// newHolderKids is the kids count of s joining n's holders: a worker that
// holds no orphan holds no child of a node it did not hold.
func (t *tree) newHolderKids(n *node, s uint32) uint32 {
	if t.workers[s].holey {
		return n.children
	}
	return 0
}

func (t *tree) markHoley(s uint32) {
	if ws := &t.workers[s]; !ws.holey {
		ws.holey = true
		t.holey++
	}
}

// countKid records that s, which holds or held n, came to hold (delta 1)
// or let go of (delta -1) a child of n.
func (t *tree) countKid(n *node, s uint32, delta int) {
	i := t.holderIndex(n, s)
	switch {
	case i < 0:
		if delta > 0 {
			t.markHoley(s) // s holds a block without its parent
		}
	case n.h&setFlag != 0:
		k := &t.sets[n.h&^setFlag].kids[i]
		*k = uint32(int(*k) + delta)
	}
}

func (t *tree) addHolder(n *node, s uint32) {
	if n.parent != rootParent {
		t.countKid(t.nodes.at(n.parent), s, 1)
	}
	switch {
	case n.h == noHolder:
		n.h = s
	case n.h&setFlag == 0:
		set := t.newSet()
		hs := &t.sets[set]
		hs.slots = append(hs.slots, n.h, s)
		hs.kids = append(hs.kids, n.children, t.newHolderKids(n, s))
		hs.fp = slotFP(n.h) ^ slotFP(s)
		n.h = set | setFlag
	default:
		hs := &t.sets[n.h&^setFlag]
		hs.slots = append(hs.slots, s)
		hs.kids = append(hs.kids, t.newHolderKids(n, s))
		hs.fp ^= slotFP(s)
	}
	t.pairs++
}

func (t *tree) dropHolder(n *node, s uint32) {
	i := t.holderIndex(n, s)
	if i < 0 {
		return
	}
	if t.heldKids(n, i) > 0 {
		t.markHoley(s)
	}
	if n.parent != rootParent {
		t.countKid(t.nodes.at(n.parent), s, -1)
	}
	if n.h&setFlag == 0 {
		n.h = noHolder
	} else {
		set := n.h &^ setFlag
		hs := &t.sets[set]
		last := len(hs.slots) - 1
		hs.slots[i], hs.kids[i] = hs.slots[last], hs.kids[last]
		hs.slots, hs.kids = hs.slots[:last], hs.kids[:last]
		hs.fp ^= slotFP(s)
		if last == 1 {
			n.h = hs.slots[0]
			t.releaseSet(set)
		}
	}
	t.pairs--
}

func (t *tree) newSet() uint32 {
	if n := len(t.freeSets); n > 0 {
		s := t.freeSets[n-1]
		t.freeSets = t.freeSets[:n-1]
		return s
	}
	t.sets = append(t.sets, holderSet{slots: make([]uint32, 0, 4), kids: make([]uint32, 0, 4)})
	return uint32(len(t.sets) - 1)
}

func (t *tree) releaseSet(s uint32) {
	hs := &t.sets[s]
	if cap(hs.slots) > 64 {
		hs.slots, hs.kids = make([]uint32, 0, 4), make([]uint32, 0, 4)
	} else {
		hs.slots, hs.kids = hs.slots[:0], hs.kids[:0]
	}
	hs.fp = 0
	t.freeSets = append(t.freeSets, s)
}

// child returns the node for local below parent, creating it if needed.
func (t *tree) child(parent uint32, local uint64) uint32 {
	return t.childAt(parent, local, t.seqBelow(parent, local))
}

// seqBelow is the sequence hash of the block local below node parent.
func (t *tree) seqBelow(parent uint32, local uint64) uint64 {
	if parent == rootParent {
		return local
	}
	return blockhash.Chain(t.nodes.at(parent).seq(), local)
}

// childAt is child for a caller that already knows the sequence hash.
func (t *tree) childAt(parent uint32, local, seq uint64) uint32 {
	// The node the block takes if it is new (the free list's last, or the
	// arena's next), so that one probe both finds the block and places it:
	// the store loop took 79–91 ns a block instead of 94–100.
	n := uint32(t.nodes.len())
	if k := len(t.free); k > 0 {
		n = t.free[k-1]
	}
	if existing, ok := t.bySeq.getOrPut(seq, &t.nodes, n); ok {
		return existing
	}
	if k := len(t.free); k > 0 {
		t.free = t.free[:k-1]
	} else {
		t.nodes.grow()
		if t.lru {
			t.stamps.grow()
		}
	}
	*t.nodes.at(n) = newNode(seq, local, parent)
	if t.lru {
		*t.stamps.at(n) = t.tick.Load()
	}
	if parent != rootParent {
		t.nodes.at(parent).children++
	}
	return n
}

// collect deletes n, and then its ancestors, while they are held by no
// worker and have no children.
func (t *tree) collect(n uint32) {
	for n != rootParent {
		nd := t.nodes.at(n)
		if nd.held() || nd.children > 0 {
			return
		}
		parent := nd.parent
		t.bySeq.remove(nd.seq(), n)
		*nd = node{h: noHolder}
		t.free = append(t.free, n)
		if parent != rootParent {
			t.nodes.at(parent).children--
		}
		n = parent
	}
}

// collectIfLive is collect for callers that may name a node twice (or
// one an earlier collect already freed).
func (t *tree) collectIfLive(n uint32) {
	if cur, ok := t.bySeq.get(t.nodes.at(n).seq(), &t.nodes); ok && cur == n {
		t.collect(n)
	}
}

// dropExtraRef drops one of the extra references counted for k (engine
// ids beyond the first naming one block), reporting whether there was one.
func dropExtraRef[K comparable](extra map[K]uint32, k K) bool {
	c := extra[k]
	switch {
	case c == 0:
		return false
	case c == 1:
		delete(extra, k)
	default:
		extra[k] = c - 1
	}
	return true
}

// unref drops one engine reference of worker slot s to node n.
func (t *tree) unref(s uint32, n uint32) {
	if dropExtraRef(t.workers[s].extraRefs, n) {
		return
	}
	nd := t.nodes.at(n)
	parent := nd.parent
	t.dropHolder(nd, s)
	t.collect(n)
	t.childGone(s, parent)
}

// childGone drops an inferred parent whose last held child went away.
func (t *tree) childGone(s, parent uint32) {
	ws := &t.workers[s]
	if len(ws.inferred) == 0 {
		return
	}
	c, ok := ws.inferred[parent]
	if !ok {
		return
	}
	if c > 1 {
		ws.inferred[parent] = c - 1
		return
	}
	delete(ws.inferred, parent)
	ws.blocks.Delete(inferredID(t.nodes.at(parent).seq()))
	t.unref(s, parent)
}

// ref records that worker slot s holds node n under engine id h.
func (t *tree) ref(s uint32, h uint64, n uint32) {
	t.hold(s, h, n)
	t.workers[s].blocks.Put(h, n)
}

// hold is ref for a caller that has already mapped h to n in the slot's
// engine ids.
func (t *tree) hold(s uint32, h uint64, n uint32) {
	ws := &t.workers[s]
	nd := t.nodes.at(n)
	if len(ws.inferred) > 0 && t.replaceInferred(ws, n, h) {
		return
	}
	if t.holds(nd, s) {
		if ws.extraRefs == nil {
			ws.extraRefs = make(map[uint32]uint32)
		}
		ws.extraRefs[n]++
	} else {
		t.addHolder(nd, s)
		if len(ws.inferred) > 0 {
			if _, ok := ws.inferred[nd.parent]; ok {
				ws.inferred[nd.parent]++
			}
		}
	}
	if t.lru {
		*t.stamps.at(n) = t.tick.Load()
	}
}

func (t *tree) applyStored(w kv.Worker, st *kv.Stored) error {
	s, cur, err := t.beginStored(w, st)
	if err == nil {
		t.storeBlocks(s, cur, st.Blocks)
		t.unplace()
	}
	return err
}

// unplace unpins the node beginStored placed and collects it, if nothing
// hangs from it.
func (t *tree) unplace() {
	if t.placed != rootParent {
		t.nodes.at(t.placed).children--
		t.collect(t.placed)
		t.placed = rootParent
	}
}

// beginStored finds where a stored chain attaches: the worker's slot and
// the node of the parent block (rootParent for none).
func (t *tree) beginStored(w kv.Worker, st *kv.Stored) (s, cur uint32, err error) {
	if len(st.Blocks) == 0 {
		t.stats.EmptyStored++
		return 0, 0, ErrEmptyStored
	}
	s, _ = t.slot(w, true)
	cur = rootParent
	if st.Parent != nil {
		p, ok := t.workers[s].blocks.Get(*st.Parent)
		if !ok && t.foreign != nil {
			if seq, found := t.foreign(w, *st.Parent); found {
				p, ok = t.childAt(rootParent, seq, seq), true
				t.placed = p
				t.nodes.at(p).children++
			}
		}
		if !ok && t.locate != nil {
			if path := t.locate(w, st.Blocks); len(path) > 0 {
				p, ok = t.anchor(s, path, *st.Parent), true
				t.stats.Reanchored++
			}
		}
		if !ok {
			t.stats.UnknownParent++
			t.dropSlotIfEmpty(s)
			return 0, 0, ErrUnknownParent
		}
		cur = p
	}
	return s, cur, nil
}

// anchor makes worker slot s hold the path of local hashes from the root,
// its last block under engine id parent, and returns that block's node.
// Blocks above it the slot does not hold yet are held under inferredID:
// the engine must hold them (it stores a block only below its prefix), but
// never told the index their ids.
func (t *tree) anchor(s uint32, path []uint64, parent uint64) uint32 {
	ws := &t.workers[s]
	cur := uint32(rootParent)
	for i, local := range path {
		cur = t.child(cur, local)
		nd := t.nodes.at(cur)
		if i == len(path)-1 {
			t.ref(s, parent, cur)
			break
		}
		if t.holds(nd, s) {
			continue
		}
		if ws.inferred == nil {
			ws.inferred = make(map[uint32]uint32)
		}
		ws.inferred[cur] = 0
		t.ref(s, inferredID(nd.seq()), cur)
		t.stats.BlocksInferred++
	}
	return cur
}

// replaceInferred gives node n, if ws holds it on inference, the engine's
// own id h: the engine named it, so its removal will now drop it.
func (t *tree) replaceInferred(ws *workerState, n uint32, h uint64) bool {
	seq := t.nodes.at(n).seq()
	if _, ok := ws.inferred[n]; !ok || h == inferredID(seq) {
		return false
	}
	delete(ws.inferred, n)
	ws.blocks.Delete(inferredID(seq))
	ws.blocks.Put(h, n)
	return true
}

// inferredID is the id an inferred block is held under: derived from its
// path, so that every anchoring through it agrees, and salted away from the
// sequence hash itself.
func inferredID(seq uint64) uint64 { return blockhash.Chain(seq, 0x1f3e2d) }

// storeBlocks hangs blocks below cur for slot s and returns the last one
// and how many of blocks it stored: fewer than all when lookups wait (see
// readersWaiting), at least one.
func (t *tree) storeBlocks(s, cur uint32, blocks []kv.Block) (uint32, int) {
	seqs := t.warmStore(s, cur, blocks)
	for i, b := range blocks {
		if i > 0 && t.lookupsWait() {
			return cur, i
		}
		n := t.childAt(cur, b.LocalHash, seqs[i])
		// One probe both checks the id and, when it is new (nearly always),
		// maps it.
		old, had := t.workers[s].blocks.Insert(b.EngineHash, n)
		if had {
			t.stats.DuplicateBlocks++
		}
		switch {
		case !had:
			t.hold(s, b.EngineHash, n)
		case old == n:
			cur = n
			continue
		default:
			// The engine reused an id for other content: it must have dropped
			// the old block without telling us. Its latest word wins. n is
			// pinned meanwhile: dropping old may otherwise collect it (old
			// may hang below n, or be n's parent).
			t.nodes.at(n).children++
			t.unref(s, old)
			t.nodes.at(n).children--
			t.ref(s, b.EngineHash, n)
		}
		t.stats.BlocksStored++
		cur = n
	}
	return cur, len(blocks)
}

// lookupsWait reports whether lookups wait for the shard this tree's writer
// holds. Between two blocks the tree is in a state the worker passes
// through, which a lookup may see.
func (t *tree) lookupsWait() bool {
	return t.readersWaiting != nil && t.readersWaiting.Load() > 0
}

// stillAt reports whether slot s still belongs to w and holds node cur: a
// chunked store resumes only where it left off.
func (t *tree) stillAt(w kv.Worker, s, cur uint32) bool {
	ws := &t.workers[s]
	return ws.live && ws.id == w && t.holds(t.nodes.at(cur), s)
}

// applyRemoved removes rm's blocks of w and returns how many of its ids it
// handled: fewer than all when lookups wait (see readersWaiting), at
// least one.
func (t *tree) applyRemoved(w kv.Worker, rm *kv.Removed) int {
	s, ok := t.slot(w, false)
	if !ok {
		t.stats.UnknownBlocks += uint64(len(rm.EngineHashes))
		return len(rm.EngineHashes)
	}
	ws := &t.workers[s]
	t.warmRemove(ws, rm.EngineHashes)
	done := len(rm.EngineHashes)
	for i, h := range rm.EngineHashes {
		if i > 0 && t.lookupsWait() {
			done = i
			break
		}
		n, ok := ws.blocks.Take(h)
		if !ok {
			t.stats.UnknownBlocks++
			continue
		}
		t.unref(s, n)
		t.stats.BlocksRemoved++
	}
	t.dropSlotIfEmpty(s)
	return done
}

// clearSlot drops every block of slot s and frees the slot.
func (t *tree) clearSlot(s uint32) {
	ws := &t.workers[s]
	ws.blocks.Range(func(_ uint64, n uint32) bool {
		t.dropHolder(t.nodes.at(n), s)
		return true
	})
	ws.blocks.Range(func(_ uint64, n uint32) bool {
		t.collectIfLive(n)
		return true
	})
	delete(t.slotOf, ws.id)
	if ws.holey {
		t.holey--
	}
	*ws = workerState{}
	t.freeSlots = append(t.freeSlots, s)
}

func (t *tree) dropSlotIfEmpty(s uint32) {
	if t.workers[s].blocks.Len() == 0 {
		t.clearSlot(s)
	}
}

func (t *tree) clearWorker(w kv.Worker) {
	if s, ok := t.slot(w, false); ok {
		t.clearSlot(s)
	}
}

// reserveNodes sizes the sequence-hash table for the capacity the
// shard's workers announced (see nodeMap.reserve).
func (t *tree) reserveNodes() {
	total := 0
	for _, n := range t.reserved {
		total += n
	}
	t.bySeq.reserve(total)
}

// overBound counts n stored blocks of slot s refused past its bound.
func (t *tree) overBound(s uint32, n int) {
	t.refused[t.workers[s].id] += uint64(n)
	t.stats.BlocksOverBound += uint64(n)
}

// removeWorkerID drops every rank of engine id.
func (t *tree) removeWorkerID(id uint64) {
	for w := range t.reserved {
		if w.ID == id {
			delete(t.reserved, w)
		}
	}
	for w := range t.refused {
		if w.ID == id {
			delete(t.refused, w)
		}
	}
	t.reserveNodes()
	for s := range t.workers {
		if ws := &t.workers[s]; ws.live && ws.id.ID == id {
			t.clearSlot(uint32(s))
		}
	}
}

// scratch is per-call working memory for find, sized by worker slots.
type scratch struct {
	mark   []uint32
	epoch  uint32
	active []uint32
}

func (sc *scratch) reset(slots int) {
	if len(sc.mark) < slots {
		sc.mark = make([]uint32, slots)
		sc.epoch = 0
	}
	if sc.epoch > 1<<31 {
		clear(sc.mark)
		sc.epoch = 0
	}
}

// find appends to out, for every worker holding seq[0], how many leading
// blocks of seq it holds. It only reads the tree (stamps are atomic), so
// many finds may run at once.
//
// sc.mark[s] == cur means slot s is still matching. A level whose holder
// set equals the active set (same size and fingerprint) changes nothing
// and costs O(1); otherwise the level's holders are re-marked with a new
// epoch and the active set is filtered.
func (t *tree) find(seq []uint64, sc *scratch, out []Overlap) []Overlap {
	if len(seq) == 0 {
		return out
	}
	n0, ok := t.bySeq.get(seq[0], &t.nodes)
	if !ok {
		return out
	}
	var tick uint32
	if t.lru {
		tick = t.tick.Add(1)
	}
	sc.reset(len(t.workers))
	var one [1]uint32
	nd := t.nodes.at(n0)
	t.touch(n0, tick)
	sc.epoch++
	cur := sc.epoch
	sc.active = append(sc.active[:0], t.workerSet(nd, &one)...)
	for _, s := range sc.active {
		sc.mark[s] = cur
	}
	activeFP := t.fp(nd)
	// While every worker is prefix-closed, a level held by exactly the
	// matching workers says they hold every level above it too: probe
	// jumpSpan levels ahead, and where the set has changed find the level
	// it changes at by bisection. Under a memory cap every matched node's
	// stamp must be touched, so the walk stays level by level.
	jump := t.holey == 0 && !t.lru
	if jump {
		// A probe waits on its slot and then on its node. Most probes find
		// the set unchanged and jump on, so ask for the slots of the probes
		// ahead while this one waits.
		for a := 1; a <= jumpAhead; a++ {
			if q := a * jumpSpan; q < len(seq) {
				t.bySeq.prefetchHome(seq[q])
			}
		}
	}
	depth := 1
walk:
	for depth < len(seq) {
		end := len(seq)
		if jump {
			p := min(depth+jumpSpan, len(seq)) - 1
			if q := p + jumpAhead*jumpSpan; q < len(seq) {
				t.bySeq.prefetchHome(seq[q])
			}
			if t.heldByActive(seq[p], len(sc.active), activeFP) {
				depth = p + 1
				continue
			}
			// Prefix-closed holder sets only shrink down a path, so the
			// levels still held by exactly the active set come first:
			// bisect for the first that is not, and walk only it.
			lo, hi := depth, p
			for lo < hi {
				if mid := (lo + hi) / 2; t.heldByActive(seq[mid], len(sc.active), activeFP) {
					lo = mid + 1
				} else {
					hi = mid
				}
			}
			depth, end = lo, lo+1
		}
		for ; depth < end; depth++ {
			n, ok := t.bySeq.get(seq[depth], &t.nodes)
			if !ok {
				break walk
			}
			nd := t.nodes.at(n)
			if t.nw(nd) == len(sc.active) && t.fp(nd) == activeFP {
				t.touch(n, tick)
				continue
			}
			sc.epoch++
			next := sc.epoch
			kept := 0
			for _, s := range t.workerSet(nd, &one) {
				if sc.mark[s] == cur {
					sc.mark[s] = next
					kept++
				}
			}
			if kept == 0 {
				break walk
			}
			t.touch(n, tick)
			cur = next
			if kept == len(sc.active) {
				continue
			}
			j := 0
			for _, s := range sc.active {
				if sc.mark[s] == cur {
					sc.active[j] = s
					j++
				} else {
					activeFP ^= slotFP(s)
					out = append(out, Overlap{Worker: t.workers[s].id, Blocks: uint32(depth)})
				}
			}
			sc.active = sc.active[:j]
		}
	}
	for _, s := range sc.active {
		out = append(out, Overlap{Worker: t.workers[s].id, Blocks: uint32(depth)})
	}
	return out
}

// jumpSpan is how far find probes ahead while every worker is
// prefix-closed: a match of 512 blocks costs 32 probes, and each change of
// the holder set (a match ending) log2(jumpSpan) more. Against a span of
// 8 walked level by level where the set changed, bisecting spans of 16
// and 32 matched 64 workers' 512-block prompts in about 55 % and 40 % of
// the time (BenchmarkFindMatches); 32 would leave the reference test's
// chains too short to exercise the jump.
const jumpSpan = 16

// jumpAhead is how many probes ahead find asks for slots. Matching
// 512-block prompts against 64 and 1000 workers in four shards, asking
// none ahead took 15 % longer; two, three and five did alike.
const jumpAhead = 3

// heldByActive reports whether the node of seq exists and its holders are
// the active set, compared by size and fingerprint.
func (t *tree) heldByActive(seq uint64, active int, activeFP uint64) bool {
	n, ok := t.bySeq.get(seq, &t.nodes)
	if !ok {
		return false
	}
	nd := t.nodes.at(n)
	return t.nw(nd) == active && t.fp(nd) == activeFP
}

func (t *tree) touch(n uint32, tick uint32) {
	if !t.lru {
		return
	}
	if p := t.stamps.at(n); atomic.LoadUint32(p) != tick {
		atomic.StoreUint32(p, tick)
	}
}

// renormalizeTicks keeps stamps ordered when the 32-bit clock nears its
// end: halving every stamp keeps their order (up to ties) and frees half
// of the range. Runs under the write lock, about once per two billion
// lookups.
func (t *tree) renormalizeTicks() {
	if t.tick.Load() < 1<<31 {
		return
	}
	for i := range t.stamps.len() {
		*t.stamps.at(uint32(i)) /= 2
	}
	t.tick.Store(1 << 30)
}

// evictTo drops leaves, whole nodes at a time, until at most target pairs
// remain: the least recently matched first under lru, else the last
// placed in the arena. A parent becomes a candidate once its
// last child is gone, so a prefix never goes before its extensions.
func (t *tree) evictTo(target uint64) {
	if t.pairs <= target {
		return
	}
	h := &leafHeap{}
	if t.lru {
		h.stamps = &t.stamps
	}
	for i := uint32(1); int(i) < t.nodes.len(); i++ {
		if nd := t.nodes.at(i); nd.held() && nd.children == 0 {
			h.items = append(h.items, uint32(i))
		}
	}
	heap.Init(h)
	affected := make(map[uint32]bool)
	dead := make(map[uint32]bool)
	var one [1]uint32
	for t.pairs > target && h.Len() > 0 {
		n := heap.Pop(h).(uint32)
		nd := t.nodes.at(n)
		for _, s := range slices.Clone(t.workerSet(nd, &one)) {
			affected[s] = true
			t.dropHolder(nd, s)
			t.stats.PairsEvicted++
		}
		dead[n] = true
		p := nd.parent
		if p != rootParent {
			pn := t.nodes.at(p)
			if pn.children == 1 && pn.held() {
				heap.Push(h, p)
			}
		}
	}
	// Forget the engine ids that named evicted nodes before the nodes (and
	// their slots in the arena) are recycled.
	var gone []uint64
	for s := range affected {
		ws := &t.workers[s]
		gone = gone[:0]
		ws.blocks.Range(func(eh uint64, n uint32) bool {
			if dead[n] {
				gone = append(gone, eh)
				delete(ws.extraRefs, n)
				// An inferred parent of n keeps counting it: it stays,
				// as an ordinary leaf, until a later pass evicts it.
				delete(ws.inferred, n)
			}
			return true
		})
		for _, eh := range gone {
			ws.blocks.Delete(eh)
		}
	}
	for n := range dead {
		t.collectIfLive(n)
	}
	for s := range affected {
		if t.workers[s].live {
			t.dropSlotIfEmpty(s)
		}
	}
}

type leafHeap struct {
	stamps *paged[uint32]
	items  []uint32
}

func (h *leafHeap) Len() int { return len(h.items) }
func (h *leafHeap) Less(i, j int) bool {
	if h.stamps != nil {
		if a, b := *h.stamps.at(h.items[i]), *h.stamps.at(h.items[j]); a != b {
			return a < b
		}
	}
	return h.items[i] > h.items[j]
}
func (h *leafHeap) Swap(i, j int) { h.items[i], h.items[j] = h.items[j], h.items[i] }
func (h *leafHeap) Push(x any)    { h.items = append(h.items, x.(uint32)) }
func (h *leafHeap) Pop() any {
	x := h.items[len(h.items)-1]
	h.items = h.items[:len(h.items)-1]
	return x
}

// Warming. On an index larger than the CPU's caches a block costs a few
// cache misses (its node in bySeq, its engine id in the worker's table,
// the node itself), each a full memory latency, and a loop that does one
// block after the other waits for them one at a time. The warm passes
// below ask for a chunk's lines first, in loops whose iterations do not
// depend on each other, so the CPU keeps many misses in flight; the loop
// that then does the work finds its lines in cache. They ask with
// prefetches rather than loads: a load the CPU must wait for before it
// retires fills its reorder buffer after a few blocks, while a prefetch
// retires at once, so the whole chunk's misses go out together (the warm
// pass of a stored block took 77–105 ns instead of 128–147 at 1000
// workers). A removal shifts back the run after the entry it deletes, in
// both tables, so it is given the line after each entry's home too (the
// loop that removes took 170–178 ns a block instead of 230–271); so is a
// store for the worker's table, where an id is new and its scan runs to
// the end of the run (the loop that stores took 91–102 ns a block instead
// of 110–133; the same for the sequence-hash table cost more than it
// saved). A store does not ask for the nodes its blocks may already have:
// finding them by their slots' tags waited for those slots, and most
// stored blocks are new (a stored block took 148–218 ns warm and stored
// without that pass, 200–306 with it). They change nothing.

// warmStore warms what storing blocks below cur for slot s will touch and
// returns the blocks' sequence hashes (valid until the next call).
func (t *tree) warmStore(s, cur uint32, blocks []kv.Block) []uint64 {
	ws := &t.workers[s]
	seqs := t.seqs[:0]
	seq, parent := uint64(0), cur
	for i, b := range blocks {
		if i == 0 {
			seq = t.seqBelow(parent, b.LocalHash)
		} else {
			seq = blockhash.Chain(seq, b.LocalHash)
		}
		seqs = append(seqs, seq)
		t.bySeq.prefetchHome(seq)
		ws.blocks.prefetchRun(b.EngineHash)
	}
	// New nodes come off the free list: warm the ones the chunk may take.
	for i := len(t.free) - 1; i >= 0 && i >= len(t.free)-len(blocks); i-- {
		prefetch.Line(unsafe.Pointer(t.nodes.at(t.free[i])))
	}
	t.seqs = seqs
	return seqs
}

// warmRemove warms what removing the engine ids hashes of ws will touch:
// the ids' entries, their nodes, and for nodes the removal may free, their
// entries in bySeq. Not their parents: engines evict a chain leaf first,
// so a parent is most often the next block of the same chunk, warmed as
// a node of its own (asking for parents as well made removals 5–10 %
// slower: more requests than the core holds in flight).
func (t *tree) warmRemove(ws *workerState, hashes []uint64) {
	for _, h := range hashes {
		ws.blocks.prefetchRun(h)
	}
	nodes := t.warmNodes[:0]
	for _, h := range hashes {
		if n, ok := ws.blocks.Get(h); ok {
			nodes = append(nodes, n)
			prefetch.Line(unsafe.Pointer(t.nodes.at(n)))
		}
	}
	for _, n := range nodes {
		// A node held by ws alone goes with this removal or, for a parent
		// removed before its children, later in the same chunk.
		if nd := t.nodes.at(n); nd.h&setFlag == 0 {
			t.bySeq.prefetchRun(nd.seq())
		}
	}
	t.warmNodes = nodes
}
