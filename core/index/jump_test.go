package index

import (
	"cmp"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/kv"
)

// closureGen draws event streams shaped like real engines': long chains
// below a system prompt every worker shares, content that often coincides
// across workers (so nodes have several holders), and evictions leaf first,
// which keeps every worker prefix-closed and find jumping. Now and then it
// removes a block in the middle of a chain (a hole: find must stop jumping)
// or clears a worker (which may make the tree whole again).
type closureGen struct {
	rng     *rand.Rand
	workers []kv.Worker
	held    map[kv.Worker]map[uint64]*genBlock // engine id → block
	nextID  uint64
}

type genBlock struct {
	id, parent uint64 // parent 0: below the root
	kids       int    // blocks of the same worker below it
}

func newClosureGen(seed uint64) *closureGen {
	g := &closureGen{rng: rand.New(rand.NewPCG(seed, 11)), held: map[kv.Worker]map[uint64]*genBlock{}}
	for id := uint64(1); id <= 3; id++ {
		for r := uint32(0); r < 2; r++ {
			w := kv.Worker{ID: id, DPRank: r}
			g.workers = append(g.workers, w)
			g.held[w] = map[uint64]*genBlock{}
		}
	}
	return g
}

const genSystemBlocks = 16

func (g *closureGen) pick(w kv.Worker, leaf bool) *genBlock {
	var out *genBlock
	n := 0
	for _, b := range g.blocks(w) {
		if leaf && b.kids > 0 {
			continue
		}
		// Reservoir sampling over the blocks in id order: the stream must
		// not depend on map order, or the same seed tests other streams.
		if n++; g.rng.IntN(n) == 0 {
			out = b
		}
	}
	return out
}

// blocks are w's blocks in id order.
func (g *closureGen) blocks(w kv.Worker) []*genBlock {
	out := make([]*genBlock, 0, len(g.held[w]))
	for _, b := range g.held[w] {
		out = append(out, b)
	}
	slices.SortFunc(out, func(a, b *genBlock) int { return cmp.Compare(a.id, b.id) })
	return out
}

func (g *closureGen) store(w kv.Worker, parent *genBlock, locals []uint64) kv.Event {
	blocks := make([]kv.Block, len(locals))
	var pid *uint64
	prev := uint64(0)
	if parent != nil {
		pid, prev = kv.Ptr(parent.id), parent.id
	}
	for i, l := range locals {
		g.nextID++
		blocks[i] = kv.Block{EngineHash: g.nextID, LocalHash: l}
		if p := g.held[w][prev]; p != nil {
			p.kids++
		}
		g.held[w][g.nextID] = &genBlock{id: g.nextID, parent: prev}
		prev = g.nextID
	}
	return kv.StoredEvent(w, g.nextID, pid, blocks...)
}

func (g *closureGen) remove(w kv.Worker, b *genBlock) {
	delete(g.held[w], b.id)
	if p := g.held[w][b.parent]; p != nil {
		p.kids--
	}
	// A hole: the blocks below stay, now hanging from a block the worker
	// no longer holds; they count as roots of their own from now on.
	for _, c := range g.held[w] {
		if c.parent == b.id {
			c.parent = 0
		}
	}
}

// next returns the next event.
func (g *closureGen) next() kv.Event {
	w := g.workers[g.rng.IntN(len(g.workers))]
	ext := make([]uint64, 1+g.rng.IntN(24))
	for i := range ext {
		ext[i] = g.rng.Uint64N(3)
	}
	switch x := g.rng.IntN(100); {
	case x < 25:
		if leaf := g.pick(w, true); leaf != nil {
			return g.store(w, leaf, ext)
		}
		fallthrough
	case x < 55:
		sys := make([]uint64, 1+g.rng.IntN(genSystemBlocks))
		for i := range sys {
			sys[i] = 100 + uint64(i)
		}
		return g.store(w, nil, append(sys, ext...))
	case x < 65:
		if b := g.pick(w, false); b != nil {
			return g.store(w, b, ext)
		}
		return g.store(w, nil, ext)
	case x < 95:
		var ids []uint64
		for range 1 + g.rng.IntN(12) {
			leaf := g.pick(w, true)
			if leaf == nil {
				break
			}
			g.remove(w, leaf)
			ids = append(ids, leaf.id)
		}
		g.nextID++
		return kv.RemovedEvent(w, g.nextID, ids...)
	case x < 97:
		// An inner block anywhere in the chains, so that holes open
		// inside the ranges lookups jump over.
		var inner *genBlock
		n := 0
		for _, b := range g.blocks(w) {
			if b.kids > 0 {
				if n++; g.rng.IntN(n) == 0 {
					inner = b
				}
			}
		}
		if inner == nil {
			g.nextID++
			return kv.RemovedEvent(w, g.nextID)
		}
		g.remove(w, inner)
		g.nextID++
		return kv.RemovedEvent(w, g.nextID, inner.id)
	default:
		g.held[w] = map[uint64]*genBlock{}
		g.nextID++
		return kv.ClearedEvent(w, g.nextID)
	}
}

// FindMatches answers exactly whether it jumps (every worker prefix-closed)
// or walks level by level (a hole somewhere), on long shared chains where
// holder sets shrink inside jumped ranges and holes open in the middle of
// chains and close again when their worker is cleared.
func TestJumpSearchAgreesWithReferenceModel(t *testing.T) {
	var jumped, walked int
	for seed := uint64(1); seed <= 6; seed++ {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			g := newClosureGen(seed)
			ix := New(Config{Shards: 1 + int(seed%2)})
			ref := newRef()
			var m Matcher
			for step := range 1200 {
				ev := g.next()
				if len(ev.Removed.EngineHashes) == 0 && ev.Kind == kv.KindRemoved {
					continue
				}
				if err, want := ix.Apply(&ev), ref.apply(&ev); err != want {
					t.Fatalf("step %d %v: Apply = %v, reference %v", step, ev.Kind, err, want)
				}
				if step%40 != 0 {
					continue
				}
				if err := ix.check(); err != nil {
					t.Fatalf("step %d: %v", step, err)
				}
				whole := true
				for i := range ix.shards {
					whole = whole && ix.shards[i].t.holey == 0
				}
				for _, q := range queries(g.rng, ix) {
					got, want := asMap(t, ix.FindMatches(&m, q)), ref.find(q)
					if fmt.Sprint(got) != fmt.Sprint(want) {
						t.Fatalf("step %d (jumping %v): FindMatches = %v, reference %v", step, whole, got, want)
					}
					if len(q) > 2*jumpSpan {
						if whole {
							jumped++
						} else {
							walked++
						}
					}
				}
			}
		})
	}
	t.Logf("long lookups: %d while jumping, %d while walking", jumped, walked)
	if jumped < 1000 || walked < 1000 {
		t.Errorf("long lookups: %d while jumping, %d while walking; both paths need exercise", jumped, walked)
	}
}

// A hole marks its worker until the worker holds nothing again, and only
// then does find jump again.
func TestHoleStopsJumpingUntilCleared(t *testing.T) {
	ix := New(Config{Shards: 1})
	w := kv.Worker{ID: 1}
	blocks := make([]kv.Block, 40)
	for i := range blocks {
		blocks[i] = kv.Block{EngineHash: uint64(i + 1), LocalHash: uint64(i)}
	}
	st := kv.StoredEvent(w, 1, nil, blocks...)
	if err := ix.Apply(&st); err != nil {
		t.Fatal(err)
	}
	tr := ix.shards[0].t
	leaf := kv.RemovedEvent(w, 2, 40, 39)
	_ = ix.Apply(&leaf)
	if tr.holey != 0 {
		t.Fatalf("evicting leaves marked the worker holey")
	}
	hole := kv.RemovedEvent(w, 3, 20)
	_ = ix.Apply(&hole)
	if tr.holey != 1 {
		t.Fatalf("a hole at block 20 left holey = %d", tr.holey)
	}
	var m Matcher
	local := make([]uint64, 40)
	for i := range local {
		local[i] = uint64(i)
	}
	q := blockhash.SequenceHashes(local)
	if got := asMap(t, ix.FindMatches(&m, q)); got[w] != 19 {
		t.Fatalf("match across the hole: %v, want 19 blocks", got)
	}
	clear := kv.ClearedEvent(w, 4)
	_ = ix.Apply(&clear)
	if tr.holey != 0 {
		t.Fatalf("a cleared worker stays holey")
	}
	if err := ix.check(); err != nil {
		t.Fatal(err)
	}
}
