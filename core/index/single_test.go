package index

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/kv"
)

// agree fails t unless x answers as ix does: every lookup, every rank's
// blocks and held set, the counters and the pairs.
func agree(t *testing.T, step int, ix *Index, x *Single, qs [][]uint64, workers []kv.Worker) {
	t.Helper()
	var m, mx Matcher
	for _, q := range qs {
		got, want := asMap(t, x.FindMatches(&mx, q)), asMap(t, ix.FindMatches(&m, q))
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("step %d: FindMatches(%x) = %v, Index %v", step, q, got, want)
		}
	}
	for _, w := range workers {
		if got, want := x.Blocks(w), ix.Blocks(w); got != want {
			t.Fatalf("step %d: Blocks(%v) = %d, Index %d", step, w, got, want)
		}
		got, want := x.Held(w), ix.Held(w)
		slices.Sort(got)
		slices.Sort(want)
		if !slices.Equal(got, want) {
			t.Fatalf("step %d: Held(%v) = %x, Index %x", step, w, got, want)
		}
	}
	got, want := x.Stats(), ix.Stats()
	want.LookupWaits = 0
	if got != want {
		t.Fatalf("step %d: Stats = %+v, Index %+v", step, got, want)
	}
	if x.Pairs() != ix.Pairs() {
		t.Fatalf("step %d: Pairs = %d, Index %d", step, x.Pairs(), ix.Pairs())
	}
}

// Random streams that hit every path of Apply (unknown parents, reused
// and duplicate engine ids, unknown removals, clears, ranks removed),
// applied to both indexes: the single-goroutine index answers every
// lookup as the sharded one does.
func TestSingleAgreesWithIndex(t *testing.T) {
	for seed := uint64(1); seed <= 16; seed++ {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			g := newGen(seed)
			g.freshIDs = seed%2 == 0
			// Two ranks name every block by its sequence hash, two all
			// but a few (they turn to an id table at some point), the
			// rest never; seeds above 8 have every rank name its blocks
			// by sequence hashes, but for one in a thousand.
			g.seqIDs = func(w kv.Worker) float64 {
				switch {
				case seed > 8:
					return 0.999
				case w.ID == 1:
					return 1
				case w.ID == 2:
					return 0.995
				}
				return 0
			}
			ix, x := New(Config{Shards: 1 + int(seed%4)}), NewSingle()
			var named, unnamed bool
			for step := 0; step < 3000; step++ {
				switch step % 500 {
				case 499:
					id := uint64(1 + g.rng.IntN(3))
					ix.RemoveWorker(id)
					x.RemoveWorker(id)
					continue
				case 249:
					w := g.workers[g.rng.IntN(len(g.workers))]
					ix.RemoveRank(w)
					x.RemoveRank(w)
					continue
				}
				ev := g.next()
				if got, want := x.Apply(&ev), ix.Apply(&ev); got != want {
					t.Fatalf("step %d %v: Apply = %v, Index %v", step, ev.Kind, got, want)
				}
				if step%50 == 0 {
					agree(t, step, ix, x, queries(g.rng, ix), g.workers)
				}
				for b := range x.ranks {
					if r := &x.ranks[b]; x.used&(1<<b) != 0 && r.blocks() > 0 {
						named = named || r.named
						unnamed = unnamed || !r.named
					}
				}
			}
			if !named || !unnamed {
				t.Fatalf("ranks with id tables: %v, without: %v", named, unnamed)
			}
			st := x.Stats()
			if st.UnknownParent == 0 || st.UnknownBlocks == 0 || st.EmptyStored == 0 || (!g.freshIDs && st.DuplicateBlocks == 0) {
				t.Fatalf("stream did not exercise every rejection: %+v", st)
			}
		})
	}
}

// A rank past its bound has the same tail of a stored chain refused by
// both indexes, chunk by chunk, and both report it.
func TestSingleBoundsRanksAsIndexDoes(t *testing.T) {
	w := kv.Worker{ID: 1}
	ix, x := New(Config{}), NewSingle()
	for _, r := range []interface{ Reserve(kv.Worker, int) }{ix, x} {
		r.Reserve(w, 8)
	}
	rng := rand.New(rand.NewPCG(3, 4))
	var parent *uint64
	var local []uint64
	id := uint64(100)
	for range 40 {
		blocks := make([]kv.Block, 1+rng.IntN(60))
		for i := range blocks {
			id++
			blocks[i] = kv.Block{EngineHash: id, LocalHash: rng.Uint64N(1 << 20)}
			local = append(local, blocks[i].LocalHash)
		}
		ev := kv.StoredEvent(w, id, parent, blocks...)
		if got, want := x.Apply(&ev), ix.Apply(&ev); got != want {
			t.Fatalf("Apply = %v, Index %v", got, want)
		}
		parent = kv.Ptr(id)
		if x.Blocks(w) < len(local) {
			break
		}
	}
	if x.Stats().BlocksOverBound == 0 {
		t.Fatalf("the chain never reached the bound: %+v", x.Stats())
	}
	agree(t, 0, ix, x, [][]uint64{blockhash.SequenceHashes(local)}, []kv.Worker{w})
	if got, want := fmt.Sprint(x.OverBound()), fmt.Sprint(ix.OverBound()); got != want {
		t.Fatalf("OverBound = %s, Index %s", got, want)
	}
}

// The table keeps every key through growth and deletions that shift runs
// back, key 0 included.
func TestPairMapAgreesWithAMap(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	var p pairMap
	want := map[uint64]uint64{}
	for i := range 200000 {
		k := rng.Uint64N(3000)
		if i%3 == 0 {
			k <<= 50 // keys whose homes crowd
		}
		switch rng.IntN(3) {
		case 0, 1:
			old, had := p.put(k, uint64(i))
			if w, ok := want[k]; ok != had || (had && w != old) {
				t.Fatalf("put %d: %d %v, want %d %v", k, old, had, w, ok)
			}
			want[k] = uint64(i)
		default:
			v, ok := p.take(k)
			if w, wok := want[k]; ok != wok || v != w {
				t.Fatalf("take %d: %d %v, want %d %v", k, v, ok, w, wok)
			}
			delete(want, k)
		}
		if p.n != len(want) {
			t.Fatalf("%d keys, want %d", p.n, len(want))
		}
	}
	for k, v := range want {
		if got, ok := p.get(k); !ok || got != v {
			t.Fatalf("get %d = %d %v, want %d", k, got, ok, v)
		}
	}
}
