package index

import (
	"fmt"
	"maps"
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
			// Some seeds have more ranks than the 8-byte table's sets
			// hold: the index moves to the wide table once it has 9.
			wide := seed%4 == 3
			if wide {
				for id := uint64(4); id <= 5; id++ {
					g.workers = append(g.workers, kv.Worker{ID: id}, kv.Worker{ID: id, DPRank: 1})
				}
			}
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
			if x.wide != wide {
				t.Fatalf("wide table: %v, want %v", x.wide, wide)
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

// siblings returns k and keys whose mixed hashes differ from k's in their
// top 8 bits only: a setMap stores the same bits for them all, and tells
// them apart by where they lie.
func siblings(k uint64, n int) []uint64 {
	out := []uint64{k}
	for t := uint64(1); t <= uint64(n); t++ {
		out = append(out, (k*mixer^t<<56)*unmixer)
	}
	return out
}

// The 8-byte table keeps every key through growth and deletions, among
// keys that crowd a few lines and keys that share their stored bits and
// whose homes lie within reach of each other's runs: it never answers
// for one key with another's set, nor loses or moves a set wrongly when
// a run shifts back.
func TestSetMapAgreesWithAMap(t *testing.T) {
	if got := uint64(mixer) * unmixer; got != 1 {
		t.Fatalf("mixer·unmixer = %#x", got)
	}
	rng := rand.New(rand.NewPCG(7, 8))
	// Keys whose homes lie in the first 64th of the table, whatever its
	// size, each with 3 siblings, which at every size lie a multiple of
	// span slots from it: inside the crowded region, so a probe that
	// went on past span would meet them.
	var pool []uint64
	for range 150 {
		h := rng.Uint64() >> 6
		pool = append(pool, siblings(h*unmixer, 3)...)
	}
	pool = append(pool, 0)
	for range 100 {
		pool = append(pool, rng.Uint64())
	}
	var m setMap
	want := map[uint64]uint64{}
	var grew bool
	for i := range 300000 {
		k := pool[rng.IntN(len(pool))]
		bit := uint64(1) << rng.IntN(setMapRanks)
		size := len(m.slots)
		switch rng.IntN(5) {
		case 0, 1:
			if had := m.add(k, bit); had != (want[k]&bit != 0) {
				t.Fatalf("op %d: add(%#x, %#x) = %v, want %#x", i, k, bit, had, want[k])
			}
			want[k] |= bit
		case 2, 3:
			if had := m.remove(k, bit); had != (want[k]&bit != 0) {
				t.Fatalf("op %d: remove(%#x, %#x) = %v, want %#x", i, k, bit, had, want[k])
			}
			if want[k] &^= bit; want[k] == 0 {
				delete(want, k)
			}
		default:
			if got := m.get(k); got != want[k] {
				t.Fatalf("op %d: get(%#x) = %#x, want %#x", i, k, got, want[k])
			}
		}
		grew = grew || (size > 0 && len(m.slots) > size)
		if m.n != len(want) {
			t.Fatalf("op %d: %d keys, want %d", i, m.n, len(want))
		}
	}
	if !grew {
		t.Fatal("the table never grew")
	}
	got := map[uint64]uint64{}
	m.each(func(k, set uint64) { got[k] = set })
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("each = %v, want %v", got, want)
	}
	for k, set := range want {
		if m.get(k) != set {
			t.Fatalf("get(%#x) = %#x, want %#x", k, m.get(k), set)
		}
	}
}

// A key whose run from its home passes the slot of a sibling (the same
// stored bits, its home span slots before) is not taken for it: the probe
// stops short of span slots, and a key that would lie that far grows the
// table.
func TestSetMapProbeStopsShortOfSiblings(t *testing.T) {
	var m setMap
	m.reserve(1)
	span := m.span
	// homeKey returns a key of home line slot i, told apart by j.
	homeKey := func(i, j int) uint64 {
		return (uint64(i)<<m.shift | uint64(j)<<8 | 1) * unmixer
	}
	const at = 64
	// Fill from at-span to at+span-2: a run ending one short of span
	// slots past at.
	for i := at - span; i < at+span-1; i++ {
		if m.add(homeKey((i-at+span)/8*8+at-span, i), 1) {
			t.Fatal("fresh key found")
		}
	}
	a := homeKey(at, 1000)
	m.add(a, 2) // at at+span-1, span-1 from its home
	// b shares a's stored bits, its home span slots before a's.
	b := (a*mixer - uint64(span)<<m.shift) * unmixer
	if b*mixer<<8 != a*mixer<<8 {
		t.Fatal("b does not share a's stored bits")
	}
	size := len(m.slots)
	if got := m.get(b); got != 0 {
		t.Fatalf("get(b) = %#x: a's set", got)
	}
	if m.remove(b, 2) {
		t.Fatal("remove(b) took a's bit")
	}
	if m.add(b, 4) {
		t.Fatal("add(b) found a's bit")
	}
	if len(m.slots) == size {
		t.Fatal("b went span slots or more from its home without the table growing")
	}
	if m.get(a) != 2 || m.get(b) != 4 {
		t.Fatalf("get(a) = %#x, get(b) = %#x", m.get(a), m.get(b))
	}
}

// Removals from a run whose keys lie up to span-1 slots from their homes
// shift back every key that must move, and only those: each remaining key
// keeps its set, and no key answers for a sibling.
func TestSetMapDropShiftsRunsBack(t *testing.T) {
	for seed := range uint64(20) {
		var m setMap
		m.reserve(1)
		span := m.span
		key := func(home, j int) uint64 { return (uint64(home)<<m.shift | uint64(j)<<8 | 1) * unmixer }
		const at = 64
		want := map[uint64]uint64{}
		// Two spans of keys: the first's own lines full, the second's
		// all of the line at, so that they lie 0 to span-2 from it.
		for i := 0; i < 2*span-1; i++ {
			home := at - span + i/8*8
			if i >= span {
				home = at
			}
			k := key(home, i)
			m.add(k, 1<<(i%8))
			want[k] = 1 << (i % 8)
		}
		size := len(m.slots)
		rng := rand.New(rand.NewPCG(seed, 9))
		keys := slices.Sorted(maps.Keys(want))
		rng.Shuffle(len(keys), func(i, j int) { keys[i], keys[j] = keys[j], keys[i] })
		for _, k := range keys {
			if !m.remove(k, want[k]) {
				t.Fatalf("seed %d: remove(%#x) found nothing", seed, k)
			}
			delete(want, k)
			for k, set := range want {
				if got := m.get(k); got != set {
					t.Fatalf("seed %d: get(%#x) = %#x, want %#x", seed, k, got, set)
				}
				for _, s := range siblings(k, 255)[1:] {
					if got := m.get(s); got != 0 {
						t.Fatalf("seed %d: get(sibling of %#x) = %#x", seed, k, got)
					}
				}
			}
		}
		if m.n != 0 || len(m.slots) != size || slices.ContainsFunc(m.slots, func(w uint64) bool { return w != 0 }) {
			t.Fatalf("seed %d: %d keys left in %d slots (%d at the start)", seed, m.n, len(m.slots), size)
		}
	}
}
