package index

import (
	"cmp"
	"slices"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/kv"
)

// DumpBatch is the most events a Dumper hands its visitor at once.
const DumpBatch = 1024

// Dumper streams an index's dump (see Index.DumpTo) through bounded
// batches. Its scratch grows to the largest worker rank's blocks (24 bytes
// a block) and is reused from rank to rank and from dump to dump, so a
// dump's memory follows the largest rank, never the index: the number of
// ranks and what the other ranks hold cost nothing. The zero value is
// ready; one Dumper serves one dump at a time.
type Dumper struct {
	// entries are the rank's held blocks, by node and then engine id;
	// bridges the nodes it does not hold but holds blocks below.
	entries, bridges []dumpEntry
	bridgeOf         map[uint32]int32
	path             []uint32
	done             []uint64 // bit per entry, then per bridge: emitted
	stack            []int32
	order            []int32 // entries by engine id: the order they are emitted in

	events  []kv.Event
	blocks  []kv.Block
	parents []uint64
	removed []uint64
}

type dumpEntry struct {
	id, local uint64
	node      uint32
	parent    int32 // rootRef, an entry's position, or bridgeRef(bridge)
}

const rootRef = -1

func bridgeRef(b int) int32 { return int32(-2 - b) }

// DumpTo hands visit, batch after batch, single-block events that rebuild
// an equal index when applied to an empty one, worker rank after worker
// rank (Dump collects them). A batch is valid until visit returns; an
// error from visit stops the dump and is returned.
//
// Each rank is read under its shard's read lock, once, so the dump is
// consistent per rank; the lock is not held between ranks nor while visit
// runs, so that a slow reader of the dump never holds up the shard's
// writers.
func (ix *Index) DumpTo(d *Dumper, visit func([]kv.Event) error) error {
	if cap(d.events) < DumpBatch {
		d.events = make([]kv.Event, 0, DumpBatch)
		d.blocks = make([]kv.Block, 0, DumpBatch)
		d.parents = make([]uint64, 0, DumpBatch)
	}
	d.events, d.blocks, d.parents, d.removed = d.events[:0], d.blocks[:0], d.parents[:0], d.removed[:0]
	for i := range ix.shards {
		for tier := -1; tier < lowerTiers; tier++ {
			if err := d.dumpTree(&ix.shards[i], tier, visit); err != nil {
				return err
			}
		}
	}
	return d.flush(visit)
}

// dumpTree dumps the ranks of the shard's tree of one tier (-1: the
// device), their events marked with it.
func (d *Dumper) dumpTree(sh *shard, tier int, visit func([]kv.Event) error) error {
	name := kv.TierDevice
	if tier >= 0 {
		name = lowerTierNames[tier]
	}
	for s := 0; ; s++ {
		sh.mu.RLock()
		t := sh.tree(tier)
		if t == nil || s >= len(t.workers) {
			sh.mu.RUnlock()
			return nil
		}
		w, ok := d.read(t, uint32(s))
		sh.mu.RUnlock()
		if !ok {
			continue
		}
		if err := d.emitRank(w, name, visit); err != nil {
			return err
		}
	}
}

// Dump returns the events DumpTo hands out, all at once: the snapshot and
// recovery format. It holds the whole dump; serve it with DumpTo.
func (ix *Index) Dump() []kv.Event {
	var out []kv.Event
	var d Dumper
	_ = ix.DumpTo(&d, func(evs []kv.Event) error {
		for _, ev := range evs {
			if ev.Stored.Parent != nil {
				ev.Stored.Parent = kv.Ptr(*ev.Stored.Parent)
			}
			ev.Stored.Blocks = slices.Clone(ev.Stored.Blocks)
			ev.Removed.EngineHashes = slices.Clone(ev.Removed.EngineHashes)
			out = append(out, ev)
		}
		return nil
	})
	return out
}

// read copies what the dump of slot s needs out of t: the blocks it holds
// with their parents resolved. A worker may hold a block whose parent it no
// longer holds (removals do not cascade); such a parent becomes a bridge:
// a block stored under an id the worker does not use and removed again at
// the end, which leaves the path in place and the worker off it.
func (d *Dumper) read(t *tree, s uint32) (kv.Worker, bool) {
	ws := &t.workers[s]
	if !ws.live {
		return kv.Worker{}, false
	}
	d.entries, d.bridges = d.entries[:0], d.bridges[:0]
	clear(d.bridgeOf)
	ws.blocks.Range(func(h uint64, n uint32) bool {
		d.entries = append(d.entries, dumpEntry{id: h, node: n})
		return true
	})
	slices.SortFunc(d.entries, func(a, b dumpEntry) int {
		if c := cmp.Compare(a.node, b.node); c != 0 {
			return c
		}
		return cmp.Compare(a.id, b.id)
	})
	for i := range d.entries {
		e := &d.entries[i]
		nd := t.nodes.at(e.node)
		e.local = nd.local()
		e.parent = d.ref(t, ws, nd.parent)
	}
	return ws.id, true
}

// ref is how a block below node p names it: the root, the first entry of
// p (its smallest engine id), or a bridge, made with the bridges above it
// when p is new.
func (d *Dumper) ref(t *tree, ws *workerState, p uint32) int32 {
	d.path = d.path[:0]
	var top int32
	for {
		if p == rootParent {
			top = rootRef
			break
		}
		if i, ok := d.entryOf(p); ok {
			top = int32(i)
			break
		}
		if b, ok := d.bridgeOf[p]; ok {
			top = bridgeRef(int(b))
			break
		}
		d.path = append(d.path, p)
		p = t.nodes.at(p).parent
	}
	if d.bridgeOf == nil && len(d.path) > 0 {
		d.bridgeOf = make(map[uint32]int32)
	}
	for i := len(d.path) - 1; i >= 0; i-- {
		n := d.path[i]
		b := len(d.bridges)
		d.bridges = append(d.bridges, dumpEntry{id: bridgeID(t, ws, n), local: t.nodes.at(n).local(), node: n, parent: top})
		d.bridgeOf[n] = int32(b)
		top = bridgeRef(b)
	}
	return top
}

func (d *Dumper) entryOf(n uint32) (int, bool) {
	i, ok := slices.BinarySearchFunc(d.entries, n, func(e dumpEntry, n uint32) int { return cmp.Compare(e.node, n) })
	return i, ok
}

// bridgeID picks an engine id the worker does not use. Bridges are named
// after their paths, so two of them collide only when their 64-bit hashes
// do.
func bridgeID(t *tree, ws *workerState, n uint32) uint64 {
	h := blockhash.Chain(t.nodes.at(n).seq(), 0xb41d6e)
	for {
		if _, used := ws.blocks.Get(h); !used {
			return h
		}
		h = blockhash.Chain(h, 1)
	}
}

func (d *Dumper) entry(x int32) *dumpEntry {
	if n := int32(len(d.entries)); x >= n {
		return &d.bridges[x-n]
	}
	return &d.entries[x]
}

// pos is the position in done of what ref names (not the root).
func (d *Dumper) pos(ref int32) int32 {
	if ref >= 0 {
		return ref
	}
	return int32(len(d.entries)) + (-2 - ref)
}

func (d *Dumper) isDone(x int32) bool { return d.done[x>>6]&(1<<(x&63)) != 0 }

// emitRank hands out the rank's events on one tier, every block after its
// parent.
func (d *Dumper) emitRank(w kv.Worker, tier kv.StorageTier, visit func([]kv.Event) error) error {
	total := len(d.entries) + len(d.bridges)
	words := (total + 63) / 64
	if cap(d.done) < words {
		d.done = make([]uint64, words)
	}
	d.done = d.done[:words]
	clear(d.done)
	// Emitted by engine id, not by node: node numbers follow the order in
	// which blocks reached this index, so two equal indexes dump alike only
	// if the order is the blocks' own.
	d.order = d.order[:0]
	for i := range d.entries {
		d.order = append(d.order, int32(i))
	}
	slices.SortFunc(d.order, func(a, b int32) int { return cmp.Compare(d.entries[a].id, d.entries[b].id) })
	var id uint64
	for _, i := range d.order {
		d.stack = append(d.stack[:0], i)
		for len(d.stack) > 0 {
			x := d.stack[len(d.stack)-1]
			if d.isDone(x) {
				d.stack = d.stack[:len(d.stack)-1]
				continue
			}
			e := d.entry(x)
			var parent *uint64
			if e.parent != rootRef {
				p := d.pos(e.parent)
				if !d.isDone(p) {
					d.stack = append(d.stack, p)
					continue
				}
				d.parents = append(d.parents, d.entry(p).id)
				parent = &d.parents[len(d.parents)-1]
			}
			d.blocks = append(d.blocks, kv.Block{EngineHash: e.id, LocalHash: e.local})
			n := len(d.blocks)
			ev := kv.StoredEvent(w, id, parent, d.blocks[n-1:n:n]...)
			ev.Tier = tier
			if err := d.add(ev, visit); err != nil {
				return err
			}
			id++
			d.done[x>>6] |= 1 << (x & 63)
			d.stack = d.stack[:len(d.stack)-1]
		}
	}
	if len(d.bridges) == 0 {
		return nil
	}
	start := len(d.removed)
	for _, b := range d.bridges {
		d.removed = append(d.removed, b.id)
	}
	// Bridges are found in node order, which equal indexes need not share.
	slices.Sort(d.removed[start:])
	ev := kv.RemovedEvent(w, id, d.removed[start:len(d.removed):len(d.removed)]...)
	ev.Tier = tier
	return d.add(ev, visit)
}

func (d *Dumper) add(ev kv.Event, visit func([]kv.Event) error) error {
	d.events = append(d.events, ev)
	// An event adds at most one block and one parent, so the arrays the
	// batch points into (DumpBatch long) never move while it fills.
	if len(d.events) < DumpBatch {
		return nil
	}
	return d.flush(visit)
}

func (d *Dumper) flush(visit func([]kv.Event) error) error {
	if len(d.events) == 0 {
		return nil
	}
	err := visit(d.events)
	d.events, d.blocks, d.parents = d.events[:0], d.blocks[:0], d.parents[:0]
	// Removed events may point into removed: a new array, not the batch's.
	d.removed = nil
	return err
}
