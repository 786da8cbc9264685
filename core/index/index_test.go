package index

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"unsafe"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/kv"
)

// refModel is the brute-force definition of the index: per worker rank, the
// path (as a sequence hash) each engine id names and how many ids name each
// path. Nothing is shared, nothing is clever.
type refModel struct {
	ids   map[kv.Worker]map[uint64]uint64 // engine id → path seq hash
	holds map[kv.Worker]map[uint64]int    // path seq hash → references
	// foreign, for a lower tier, resolves a parent held on another tier.
	foreign func(w kv.Worker, id uint64) (uint64, bool)
}

func newRef() *refModel {
	return &refModel{ids: map[kv.Worker]map[uint64]uint64{}, holds: map[kv.Worker]map[uint64]int{}}
}

func (r *refModel) unref(w kv.Worker, seq uint64) {
	r.holds[w][seq]--
	if r.holds[w][seq] == 0 {
		delete(r.holds[w], seq)
	}
}

func (r *refModel) apply(ev *kv.Event) error {
	w := ev.Worker
	if r.ids[w] == nil {
		r.ids[w] = map[uint64]uint64{}
		r.holds[w] = map[uint64]int{}
	}
	switch ev.Kind {
	case kv.KindStored:
		if len(ev.Stored.Blocks) == 0 {
			return ErrEmptyStored
		}
		cur, root := uint64(0), true
		if ev.Stored.Parent != nil {
			p, ok := r.ids[w][*ev.Stored.Parent]
			if !ok && r.foreign != nil {
				p, ok = r.foreign(w, *ev.Stored.Parent)
			}
			if !ok {
				return ErrUnknownParent
			}
			cur, root = p, false
		}
		for _, b := range ev.Stored.Blocks {
			seq := b.LocalHash
			if !root {
				seq = blockhash.Chain(cur, b.LocalHash)
			}
			if old, ok := r.ids[w][b.EngineHash]; ok {
				if old == seq {
					cur, root = seq, false
					continue
				}
				r.unref(w, old)
			}
			r.ids[w][b.EngineHash] = seq
			r.holds[w][seq]++
			cur, root = seq, false
		}
	case kv.KindRemoved:
		for _, h := range ev.Removed.EngineHashes {
			if seq, ok := r.ids[w][h]; ok {
				delete(r.ids[w], h)
				r.unref(w, seq)
			}
		}
	case kv.KindCleared:
		r.ids[w] = map[uint64]uint64{}
		r.holds[w] = map[uint64]int{}
	}
	return nil
}

func (r *refModel) removeWorker(id uint64) {
	for w := range r.ids {
		if w.ID == id {
			delete(r.ids, w)
			delete(r.holds, w)
		}
	}
}

func (r *refModel) find(seq []uint64) map[kv.Worker]uint32 {
	out := map[kv.Worker]uint32{}
	for w, held := range r.holds {
		d := 0
		for d < len(seq) && held[seq[d]] > 0 {
			d++
		}
		if d > 0 {
			out[w] = uint32(d)
		}
	}
	return out
}

func asMap(t *testing.T, ov []Overlap) map[kv.Worker]uint32 {
	t.Helper()
	out := map[kv.Worker]uint32{}
	for _, o := range ov {
		if _, dup := out[o.Worker]; dup {
			t.Fatalf("worker %v reported twice", o.Worker)
		}
		out[o.Worker] = o.Blocks
	}
	return out
}

// check verifies the tree's internal invariants.
func (t *tree) check() error {
	var pairs uint64
	children := map[uint32]uint32{}
	for i := uint32(1); int(i) < t.nodes.len(); i++ {
		nd := t.nodes.at(i)
		if n, ok := t.bySeq.get(nd.seq(), &t.nodes); !ok || n != uint32(i) {
			continue // free slot
		}
		var one [1]uint32
		set := t.workerSet(nd, &one)
		if len(set) != t.nw(nd) {
			return fmt.Errorf("node %d: nw %d but set %v", i, t.nw(nd), set)
		}
		for _, s := range set {
			if !t.workers[s].live {
				return fmt.Errorf("node %d held by dead slot %d", i, s)
			}
		}
		var fp uint64
		for _, s := range set {
			fp ^= slotFP(s)
		}
		if fp != t.fp(nd) {
			return fmt.Errorf("node %d: fingerprint out of date", i)
		}
		pairs += uint64(t.nw(nd))
		if nd.parent != rootParent {
			children[nd.parent]++
			if want := blockhash.Chain(t.nodes.at(nd.parent).seq(), nd.local()); want != nd.seq() {
				return fmt.Errorf("node %d: seq does not chain from parent", i)
			}
		} else if nd.seq() != nd.local() {
			return fmt.Errorf("root child %d: seq != local", i)
		}
		if !nd.held() && nd.children == 0 {
			return fmt.Errorf("node %d: garbage left behind", i)
		}
	}
	if t.bySeq.len()+len(t.free) != t.nodes.len()-1 {
		return fmt.Errorf("%d live + %d free != %d nodes", t.bySeq.len(), len(t.free), t.nodes.len()-1)
	}
	for n, c := range children {
		if t.nodes.at(n).children != c {
			return fmt.Errorf("node %d: children %d, counted %d", n, t.nodes.at(n).children, c)
		}
	}
	if pairs != t.pairs {
		return fmt.Errorf("pairs %d, counted %d", t.pairs, pairs)
	}
	if err := t.checkClosure(); err != nil {
		return err
	}
	for s := range t.workers {
		ws := &t.workers[s]
		if !ws.live {
			continue
		}
		if ws.blocks.Len() == 0 {
			return fmt.Errorf("slot %d live without blocks", s)
		}
		var err error
		ws.blocks.Range(func(h uint64, n uint32) bool {
			if !t.holds(t.nodes.at(n), uint32(s)) {
				err = fmt.Errorf("slot %d: id %d names node %d it does not hold", s, h, n)
			}
			return err == nil
		})
		if err != nil {
			return err
		}
		below := map[uint32]uint32{}
		ws.blocks.Range(func(_ uint64, n uint32) bool {
			if p := t.nodes.at(n).parent; p != rootParent {
				if _, ok := ws.inferred[p]; ok {
					below[p]++
				}
			}
			return true
		})
		for n, c := range ws.inferred {
			if got, ok := ws.blocks.Get(inferredID(t.nodes.at(n).seq())); !ok || got != n {
				return fmt.Errorf("slot %d: inferred node %d not held under its inferred id", s, n)
			}
			if below[n] != c {
				return fmt.Errorf("slot %d: inferred node %d counts %d children, holds %d", s, n, c, below[n])
			}
		}
	}
	return nil
}

// checkClosure checks the prefix-closure bookkeeping against the tree:
// every worker not marked holey holds the parent of each block it holds,
// the holey count is right, and every kids count is at least the number
// of the node's children its holder holds (the counts may only err
// upwards).
func (t *tree) checkClosure() error {
	holey := 0
	for s := range t.workers {
		if ws := &t.workers[s]; ws.live && ws.holey {
			holey++
		}
	}
	if holey != t.holey {
		return fmt.Errorf("holey count %d, counted %d", t.holey, holey)
	}
	heldKids := map[[2]uint32]uint32{} // (node, slot) → children of node the slot holds
	var one [1]uint32
	for i := uint32(1); int(i) < t.nodes.len(); i++ {
		nd := t.nodes.at(i)
		if n, ok := t.bySeq.get(nd.seq(), &t.nodes); !ok || n != i {
			continue
		}
		for _, s := range t.workerSet(nd, &one) {
			if nd.parent == rootParent {
				continue
			}
			if t.holds(t.nodes.at(nd.parent), s) {
				heldKids[[2]uint32{nd.parent, s}]++
			} else if !t.workers[s].holey {
				return fmt.Errorf("slot %d holds node %d without its parent and is not marked holey", s, i)
			}
		}
	}
	for i := uint32(1); int(i) < t.nodes.len(); i++ {
		nd := t.nodes.at(i)
		if n, ok := t.bySeq.get(nd.seq(), &t.nodes); !ok || n != i {
			continue
		}
		for j, s := range t.workerSet(nd, &one) {
			if got, want := t.heldKids(nd, j), heldKids[[2]uint32{i, s}]; got < want {
				return fmt.Errorf("node %d: slot %d holds %d of its children, counted %d", i, s, want, got)
			}
		}
	}
	return nil
}

func TestNodeIs28Bytes(t *testing.T) {
	if size := unsafe.Sizeof(node{}); size != 28 {
		t.Fatalf("node is %d bytes; every cached block pays for it", size)
	}
}

func (ix *Index) check() error {
	for i := range ix.shards {
		if err := ix.shards[i].t.check(); err != nil {
			return fmt.Errorf("shard %d: %w", i, err)
		}
	}
	return nil
}

// held returns every (worker, path) pair of the index.
func (ix *Index) held() map[kv.Worker]map[uint64]bool {
	out := map[kv.Worker]map[uint64]bool{}
	for i := range ix.shards {
		t := ix.shards[i].t
		for n := uint32(1); int(n) < t.nodes.len(); n++ {
			nd := t.nodes.at(n)
			if cur, ok := t.bySeq.get(nd.seq(), &t.nodes); !ok || cur != uint32(n) {
				continue
			}
			var one [1]uint32
			for _, s := range t.workerSet(nd, &one) {
				w := t.workers[s].id
				if out[w] == nil {
					out[w] = map[uint64]bool{}
				}
				out[w][nd.seq()] = true
			}
		}
	}
	return out
}

// eventGen draws random event streams that hit every path of Apply: small
// alphabets make workers share paths, reuse engine ids and name parents
// they dropped.
type eventGen struct {
	rng     *rand.Rand
	workers []kv.Worker
	known   map[kv.Worker][]uint64 // engine ids the worker was told to store
	nextID  uint64
	// freshIDs gives every stored block a new engine id, as real engines
	// do; otherwise ids are drawn from a small range and get reused.
	freshIDs bool
	// seqIDs, when set, says how a worker names its blocks: 1 in
	// seqIDs(w) by sequence hashes, as the simulator's engines do, 0
	// never, and in between by sequence hashes but for that share of its
	// blocks.
	seqIDs func(w kv.Worker) float64
}

func newGen(seed uint64) *eventGen {
	g := &eventGen{rng: rand.New(rand.NewPCG(seed, 7)), known: map[kv.Worker][]uint64{}}
	for id := uint64(1); id <= 3; id++ {
		for r := uint32(0); r < 2; r++ {
			g.workers = append(g.workers, kv.Worker{ID: id, DPRank: r})
		}
	}
	return g
}

func (g *eventGen) next() kv.Event {
	w := g.workers[g.rng.IntN(len(g.workers))]
	g.nextID++
	known := g.known[w]
	switch x := g.rng.IntN(100); {
	case x < 60:
		var parent *uint64
		switch y := g.rng.IntN(10); {
		case y < 7 && len(known) > 0:
			parent = kv.Ptr(known[g.rng.IntN(len(known))])
		case y == 7:
			parent = kv.Ptr(1000 + g.rng.Uint64N(50)) // likely unknown
		}
		blocks := make([]kv.Block, g.rng.IntN(5))
		var share float64
		if g.seqIDs != nil {
			share = g.seqIDs(w)
		}
		for i := range blocks {
			blocks[i] = kv.Block{EngineHash: g.rng.Uint64N(60), LocalHash: g.rng.Uint64N(4)}
			if g.freshIDs {
				blocks[i].EngineHash = 1<<20 + g.nextID<<3 + uint64(i)
			}
			if share > 0 && g.rng.Float64() < share {
				// Chained on the parent's id: its sequence hash when it
				// was named so (an unknown parent's event is refused).
				switch {
				case i > 0:
					blocks[i].EngineHash = blockhash.Chain(blocks[i-1].EngineHash, blocks[i].LocalHash)
				case parent != nil:
					blocks[i].EngineHash = blockhash.Chain(*parent, blocks[i].LocalHash)
				default:
					blocks[i].EngineHash = blocks[i].LocalHash
				}
			}
			g.known[w] = append(g.known[w], blocks[i].EngineHash)
		}
		return kv.StoredEvent(w, g.nextID, parent, blocks...)
	case x < 92:
		hs := make([]uint64, 1+g.rng.IntN(4))
		for i := range hs {
			if len(known) > 0 && g.rng.IntN(4) > 0 {
				hs[i] = known[g.rng.IntN(len(known))]
			} else {
				hs[i] = g.rng.Uint64N(70)
			}
		}
		return kv.RemovedEvent(w, g.nextID, hs...)
	default:
		g.known[w] = nil
		return kv.ClearedEvent(w, g.nextID)
	}
}

// queries returns lookups that reach deep into the tree: every path a
// worker holds, extended by a random block, plus random paths.
func queries(rng *rand.Rand, ix *Index) [][]uint64 {
	var qs [][]uint64
	for i := range ix.shards {
		t := ix.shards[i].t
		for n := uint32(1); int(n) < t.nodes.len(); n++ {
			if cur, ok := t.bySeq.get(t.nodes.at(n).seq(), &t.nodes); !ok || cur != uint32(n) {
				continue
			}
			var path []uint64
			for m := uint32(n); m != rootParent; m = t.nodes.at(m).parent {
				path = append(path, t.nodes.at(m).local())
			}
			slices.Reverse(path)
			path = append(path, rng.Uint64N(4))
			qs = append(qs, blockhash.SequenceHashes(path))
		}
	}
	for range 20 {
		path := make([]uint64, 1+rng.IntN(8))
		for i := range path {
			path[i] = rng.Uint64N(4)
		}
		qs = append(qs, blockhash.SequenceHashes(path))
	}
	return qs
}

func TestIndexAgreesWithReferenceModel(t *testing.T) {
	for seed := uint64(1); seed <= 12; seed++ {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			g := newGen(seed)
			ix := New(Config{Shards: 1 + int(seed%4)})
			ref := newRef()
			var m Matcher
			for step := 0; step < 3000; step++ {
				ev := g.next()
				if step%500 == 499 {
					id := uint64(1 + g.rng.IntN(3))
					ix.RemoveWorker(id)
					ref.removeWorker(id)
					continue
				}
				wantErr := ref.apply(&ev)
				if err := ix.Apply(&ev); err != wantErr {
					t.Fatalf("step %d %v: Apply = %v, reference %v", step, ev.Kind, err, wantErr)
				}
				if step%50 != 0 {
					continue
				}
				agreesWithModel(t, step, ix, ref, g.rng, &m)
				for _, w := range g.workers {
					if got, want := ix.Blocks(w), len(ref.ids[w]); got != want {
						t.Fatalf("step %d: Blocks(%v) = %d, reference %d", step, w, got, want)
					}
				}
			}
			st := ix.Stats()
			if st.UnknownParent == 0 || st.UnknownBlocks == 0 || st.DuplicateBlocks == 0 || st.EmptyStored == 0 {
				t.Fatalf("stream did not exercise every rejection: %+v", st)
			}
		})
	}
}

func TestDumpReplaysToEqualIndex(t *testing.T) {
	for seed := uint64(1); seed <= 8; seed++ {
		g := newGen(seed)
		ix := New(Config{Shards: 3})
		for range 2000 {
			ev := g.next()
			_ = ix.Apply(&ev)
		}
		dump := ix.Dump()
		replay := New(Config{Shards: 2})
		for i := range dump {
			if dump[i].Kind == kv.KindStored && len(dump[i].Stored.Blocks) != 1 {
				t.Fatalf("dump event %d has %d blocks", i, len(dump[i].Stored.Blocks))
			}
			if err := replay.Apply(&dump[i]); err != nil {
				t.Fatalf("seed %d: replaying dump event %d: %v", seed, i, err)
			}
		}
		sameAfterReplay(t, seed, g, ix, replay)
		// Removals by engine id must keep working after a replay.
		for _, w := range g.workers {
			if a, b := ix.Blocks(w), replay.Blocks(w); a != b {
				t.Fatalf("Blocks(%v): %d before, %d after replay", w, a, b)
			}
		}
	}
}

func TestDumpBridgesOrphans(t *testing.T) {
	w := kv.Worker{ID: 1}
	ix := New(Config{Shards: 1})
	evs := []kv.Event{
		kv.StoredEvent(w, 0, nil, kv.Block{EngineHash: 10, LocalHash: 1}, kv.Block{EngineHash: 11, LocalHash: 2}, kv.Block{EngineHash: 12, LocalHash: 3}),
		kv.RemovedEvent(w, 1, 10, 11), // keeps the deepest block only
	}
	for i := range evs {
		if err := ix.Apply(&evs[i]); err != nil {
			t.Fatal(err)
		}
	}
	dump := ix.Dump()
	replay := New(Config{Shards: 1})
	for i := range dump {
		if err := replay.Apply(&dump[i]); err != nil {
			t.Fatal(err)
		}
	}
	path := blockhash.SequenceHashes([]uint64{1, 2, 3})
	var m Matcher
	if got := replay.FindMatches(&m, path); len(got) != 0 {
		t.Fatalf("orphan must not match from the root: %v", got)
	}
	if !replay.held()[w][path[2]] || len(replay.held()[w]) != 1 {
		t.Fatalf("replay holds %v, want only the orphan", replay.held())
	}
	rm := kv.RemovedEvent(w, 9, 12)
	if err := replay.Apply(&rm); err != nil || replay.Pairs() != 0 {
		t.Fatalf("orphan must stay removable by its engine id: pairs %d", replay.Pairs())
	}
}

func TestApplyRejectionsLeaveIndexUnchanged(t *testing.T) {
	w := kv.Worker{ID: 7, DPRank: 1}
	tests := []struct {
		name string
		ev   kv.Event
		err  error
		stat func(Stats) uint64
	}{
		{"unknown parent", kv.StoredEvent(w, 1, kv.Ptr(99), kv.Block{EngineHash: 1, LocalHash: 1}), ErrUnknownParent, func(s Stats) uint64 { return s.UnknownParent }},
		{"empty stored", kv.StoredEvent(w, 1, nil), ErrEmptyStored, func(s Stats) uint64 { return s.EmptyStored }},
		{"unknown kind", kv.Event{Worker: w, Kind: 42}, ErrUnknownKind, func(s Stats) uint64 { return s.UnknownKind }},
		{"removal of unknown block", kv.RemovedEvent(w, 1, 5), nil, func(s Stats) uint64 { return s.UnknownBlocks }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ix := New(Config{})
			if err := ix.Apply(&tc.ev); err != tc.err {
				t.Fatalf("err = %v, want %v", err, tc.err)
			}
			if tc.stat(ix.Stats()) != 1 {
				t.Fatalf("not counted: %+v", ix.Stats())
			}
			if ix.Pairs() != 0 || len(ix.Dump()) != 0 {
				t.Fatal("rejected event changed the index")
			}
			if err := ix.check(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestDuplicateEngineIDRebindsToNewContent(t *testing.T) {
	w := kv.Worker{ID: 1}
	ix := New(Config{Shards: 1})
	a := kv.StoredEvent(w, 0, nil, kv.Block{EngineHash: 5, LocalHash: 100})
	b := kv.StoredEvent(w, 1, nil, kv.Block{EngineHash: 5, LocalHash: 200})
	_ = ix.Apply(&a)
	_ = ix.Apply(&b)
	var m Matcher
	if got := ix.FindMatches(&m, []uint64{100}); len(got) != 0 {
		t.Fatalf("old content still matches: %v", got)
	}
	if got := ix.FindMatches(&m, []uint64{200}); len(got) != 1 {
		t.Fatalf("new content does not match: %v", got)
	}
	if ix.Stats().DuplicateBlocks != 1 || ix.Pairs() != 1 {
		t.Fatalf("stats %+v pairs %d", ix.Stats(), ix.Pairs())
	}
}

func TestMemoryCapEvictsLeastRecentlyMatchedLeaves(t *testing.T) {
	w := kv.Worker{ID: 1}
	ix := New(Config{Shards: 1, MaxPairs: 10, PruneRatio: 0.5})
	// Two chains of four blocks each: A = 1,2,3,4 and B = 5,6,7,8.
	store := func(base uint64, locals ...uint64) {
		var parent *uint64
		for i, l := range locals {
			ev := kv.StoredEvent(w, 0, parent, kv.Block{EngineHash: base + uint64(i), LocalHash: l})
			if err := ix.Apply(&ev); err != nil {
				t.Fatal(err)
			}
			parent = kv.Ptr(base + uint64(i))
		}
	}
	store(100, 1, 2, 3, 4)
	store(200, 5, 6, 7, 8)
	var m Matcher
	chainA := blockhash.SequenceHashes([]uint64{1, 2, 3, 4})
	if got := ix.FindMatches(&m, chainA); len(got) != 1 || got[0].Blocks != 4 {
		t.Fatalf("chain A: %v", got)
	}
	// Three more blocks push the index past 10 pairs; the pass prunes to 5.
	store(300, 9, 10, 11)
	if p := ix.Pairs(); p > 5 {
		t.Fatalf("pairs %d after pruning to 5", p)
	}
	if ev := ix.Stats().PairsEvicted; ev != 6 {
		t.Fatalf("evicted %d pairs, want 6", ev)
	}
	if got := ix.FindMatches(&m, chainA); len(got) != 1 || got[0].Blocks != 4 {
		t.Fatalf("recently matched chain A was evicted: %v", got)
	}
	chainB := blockhash.SequenceHashes([]uint64{5, 6, 7, 8})
	if got := ix.FindMatches(&m, chainB); len(got) != 0 {
		t.Fatalf("least recently used chain B survived: %v", got)
	}
	if err := ix.check(); err != nil {
		t.Fatal(err)
	}
	// Evicted ids are forgotten: removing them is an unknown-block skip.
	before := ix.Stats().UnknownBlocks
	rm := kv.RemovedEvent(w, 0, 200)
	_ = ix.Apply(&rm)
	if ix.Stats().UnknownBlocks != before+1 {
		t.Fatal("evicted engine id still known")
	}
}

func TestMemoryCapHoldsUnderRandomStreams(t *testing.T) {
	// A capped index forgets ids, so it rejects events hanging below evicted
	// blocks; with engines that never reuse an id that can only make it
	// know less than the truth.
	g := newGen(99)
	g.freshIDs = true
	ix := New(Config{Shards: 2, MaxPairs: 40})
	ref := newRef()
	var m Matcher
	for step := 0; step < 5000; step++ {
		ev := g.next()
		_ = ref.apply(&ev)
		_ = ix.Apply(&ev)
		if ix.Pairs() > 40 {
			t.Fatalf("step %d: %d pairs above the cap", step, ix.Pairs())
		}
		if step%100 == 0 {
			if err := ix.check(); err != nil {
				t.Fatalf("step %d: %v", step, err)
			}
			for w, set := range ix.held() {
				for seq := range set {
					if ref.holds[w][seq] == 0 {
						t.Fatalf("step %d: capped index holds a block of %v the worker dropped", step, w)
					}
				}
			}
			for _, q := range queries(g.rng, ix) {
				want := ref.find(q)
				for w, d := range asMap(t, ix.FindMatches(&m, q)) {
					if d > want[w] {
						t.Fatalf("step %d: capped index claims %d blocks on %v, truth %d", step, d, w, want[w])
					}
				}
			}
		}
	}
	if ix.Stats().PairsEvicted == 0 {
		t.Fatal("cap never evicted")
	}
}

func TestConcurrentReadersAndWriters(t *testing.T) {
	ix := New(Config{Shards: 4, MaxPairs: 5000})
	var wg sync.WaitGroup
	paths := make([][]uint64, 64)
	for i := range paths {
		local := []uint64{0, uint64(i % 8), uint64(i), 3, 4, 5}
		paths[i] = blockhash.SequenceHashes(local)
	}
	for wi := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			w := kv.Worker{ID: uint64(wi), DPRank: uint32(wi % 2)}
			for i := range 2000 {
				p := paths[(i*7+wi)%len(paths)]
				_ = p
				local := []uint64{0, uint64(i % 8), uint64(i % 64), 3, 4, 5}
				var parent *uint64
				for j, l := range local {
					h := uint64(i%64)<<8 | uint64(j)
					ev := kv.StoredEvent(w, uint64(i), parent, kv.Block{EngineHash: h, LocalHash: l})
					_ = ix.Apply(&ev)
					parent = kv.Ptr(h)
				}
				if i%5 == 0 {
					rm := kv.RemovedEvent(w, uint64(i), uint64((i+32)%64)<<8|5)
					_ = ix.Apply(&rm)
				}
				if i%700 == 0 {
					cl := kv.ClearedEvent(w, uint64(i))
					_ = ix.Apply(&cl)
				}
			}
		}()
	}
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var m Matcher
			for i := range 3000 {
				for _, o := range ix.FindMatches(&m, paths[i%len(paths)]) {
					if o.Blocks == 0 || o.Blocks > 6 {
						t.Errorf("impossible overlap %v", o)
						return
					}
				}
				_ = ix.Pairs()
			}
		}()
	}
	wg.Wait()
	if err := ix.check(); err != nil {
		t.Fatal(err)
	}
}

func TestLongEventsAreAppliedInChunksExactly(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 5))
	ix := New(Config{Shards: 2})
	ref := newRef()
	w := kv.Worker{ID: 9}
	var stored []uint64
	id := uint64(1)
	var m Matcher
	for round := range 30 {
		n := 1 + rng.IntN(5*applyChunk)
		blocks := make([]kv.Block, n)
		local := make([]uint64, n)
		for i := range blocks {
			local[i] = rng.Uint64N(3) // shared paths across rounds
			blocks[i] = kv.Block{EngineHash: id, LocalHash: local[i]}
			stored = append(stored, id)
			id++
		}
		ev := kv.StoredEvent(w, 0, nil, blocks...)
		if err, want := ix.Apply(&ev), ref.apply(&ev); err != want {
			t.Fatalf("round %d: %v vs %v", round, err, want)
		}
		rng.Shuffle(len(stored), func(i, j int) { stored[i], stored[j] = stored[j], stored[i] })
		k := rng.IntN(len(stored)/2 + 1)
		rm := kv.RemovedEvent(w, 0, stored[:k]...)
		_ = ix.Apply(&rm)
		_ = ref.apply(&rm)
		stored = stored[k:]
		if err := ix.check(); err != nil {
			t.Fatal(err)
		}
		q := blockhash.SequenceHashes(local)
		if got, want := asMap(t, ix.FindMatches(&m, q)), ref.find(q); fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("round %d: %v, reference %v", round, got, want)
		}
	}
}

func TestChunkedStoreRacingRemovalStaysConsistent(t *testing.T) {
	ix := New(Config{Shards: 1})
	w := kv.Worker{ID: 1}
	var wg sync.WaitGroup
	wg.Add(2)
	go func() {
		defer wg.Done()
		for i := range 200 {
			blocks := make([]kv.Block, 4*applyChunk)
			for j := range blocks {
				blocks[j] = kv.Block{EngineHash: uint64(i<<16 | j), LocalHash: uint64(j)}
			}
			ev := kv.StoredEvent(w, 0, nil, blocks...)
			if err := ix.Apply(&ev); err != nil && err != ErrUnknownParent {
				t.Error(err)
				return
			}
		}
	}()
	go func() {
		defer wg.Done()
		for range 400 {
			ix.RemoveRank(w)
		}
	}()
	wg.Wait()
	if err := ix.check(); err != nil {
		t.Fatal(err)
	}
}

// A stored event below an unknown parent is placed where the Locator says;
// the blocks above the parent are held on inference until the engine names
// them or the last block hanging from them goes.
func TestReanchoredBlocksLiveAsLongAsTheirDescendants(t *testing.T) {
	w := kv.Worker{ID: 3}
	a, b, c, d, e := uint64(0xa), uint64(0xb), uint64(0xc), uint64(0xd), uint64(0xe)
	var path []uint64
	ix := New(Config{Shards: 1, Locate: func(got kv.Worker, _ []kv.Block) []uint64 {
		if got != w {
			t.Errorf("Locate asked about %v", got)
		}
		return path
	}})
	seqs := blockhash.AppendSequenceHashes(nil, []uint64{a, b, c, d})
	seqE := blockhash.Chain(seqs[1], e)
	step := func(what string, ev kv.Event, wantErr error, wantHeld []uint64, wantInferred int) {
		t.Helper()
		if err := ix.Apply(&ev); err != wantErr {
			t.Fatalf("%s: Apply = %v, want %v", what, err, wantErr)
		}
		if err := ix.check(); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		held := ix.held()[w]
		if len(held) != len(wantHeld) {
			t.Fatalf("%s: holds %d blocks, want %d", what, len(held), len(wantHeld))
		}
		for _, s := range wantHeld {
			if !held[s] {
				t.Fatalf("%s: block %x not held", what, s)
			}
		}
		if got := ix.Inferred(w); got != wantInferred {
			t.Fatalf("%s: %d inferred blocks, want %d", what, got, wantInferred)
		}
	}
	p1, p2 := uint64(101), uint64(102)

	step("nothing to place it by", kv.StoredEvent(w, 0, &p1, kv.Block{EngineHash: 104, LocalHash: d}), ErrUnknownParent, nil, 0)
	path = []uint64{a, b, c}
	step("placed below c", kv.StoredEvent(w, 1, &p1, kv.Block{EngineHash: 104, LocalHash: d}), nil, seqs, 2)
	path = []uint64{a, b}
	step("b named by the engine", kv.StoredEvent(w, 2, &p2, kv.Block{EngineHash: 105, LocalHash: e}), nil, append(slices.Clone(seqs), seqE), 1)
	step("tail removed", kv.RemovedEvent(w, 3, 104, p1), nil, []uint64{seqs[0], seqs[1], seqE}, 1)
	step("e removed: b still holds a", kv.RemovedEvent(w, 4, 105), nil, seqs[:2], 1)
	step("b removed: a goes with it", kv.RemovedEvent(w, 5, p2), nil, nil, 0)
	if st := ix.Stats(); st.Reanchored != 2 || st.UnknownParent != 1 || st.BlocksInferred != 2 {
		t.Fatalf("stats %+v: want 2 re-anchored, 1 refused, 2 inferred", st)
	}
}

// FuzzIndexAgreesWithReferenceModel drives TestIndexAgreesWithReferenceModel's
// streams from fuzzed seeds: tombstones, table purges and holder sets
// replaced on write must leave every lookup equal to the model's.
func FuzzIndexAgreesWithReferenceModel(f *testing.F) {
	f.Add(uint64(1), uint8(1), false)
	f.Add(uint64(2), uint8(4), true)
	f.Fuzz(func(t *testing.T, seed uint64, shards uint8, fresh bool) {
		g := newGen(seed)
		g.freshIDs = fresh
		ix := New(Config{Shards: 1 + int(shards%4)})
		ref := newRef()
		var m Matcher
		for step := range 400 {
			ev := g.next()
			wantErr := ref.apply(&ev)
			if err := ix.Apply(&ev); err != wantErr {
				t.Fatalf("step %d %v: Apply = %v, reference %v", step, ev.Kind, err, wantErr)
			}
			if step%20 != 19 {
				continue
			}
			agreesWithModel(t, step, ix, ref, g.rng, &m)
		}
	})
}

// agreesWithModel checks the index's invariants and that random lookups
// answer as the reference model does.
func agreesWithModel(t *testing.T, step int, ix *Index, ref *refModel, rng *rand.Rand, m *Matcher) {
	t.Helper()
	if err := ix.check(); err != nil {
		t.Fatalf("step %d: %v", step, err)
	}
	for _, q := range queries(rng, ix) {
		got, want := asMap(t, ix.FindMatches(m, q)), ref.find(q)
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("step %d: FindMatches = %v, reference %v", step, got, want)
		}
	}
}
