package prefixtree

import (
	"flag"
	"math/rand/v2"
	"os"
	"runtime"
	"testing"
	"unsafe"
)

// TestMain poisons every slab handed to the spare ones, so that a label
// still lying in one fails the tests that compare trees with the
// reference; benchmarks run without.
func TestMain(m *testing.M) {
	flag.Parse()
	poisonFreed = flag.Lookup("test.bench").Value.String() == ""
	os.Exit(m.Run())
}

// spareSet is the spare slabs now, by their arrays.
func spareSet() map[*uint32]bool {
	spareSlabs.Lock()
	defer spareSlabs.Unlock()
	set := map[*uint32]bool{}
	for _, s := range spareSlabs.slabs {
		set[unsafe.SliceData(s)] = true
	}
	return set
}

// collectTrees runs the collector until one of slabs, those of trees
// dropped, is a spare one (cleanups run after a cycle, on their own).
func collectTrees(t *testing.T, slabs []*uint32) {
	t.Helper()
	for range 1000 {
		runtime.GC()
		spare := spareSet()
		for _, s := range slabs {
			if spare[s] {
				return
			}
		}
		runtime.Gosched()
	}
	t.Fatal("no slab of a collected tree was kept")
}

// TestSpareSlabsAgainstReference fills trees, lets them be collected, and
// then drives new trees, capped and not, which carve their labels from
// the poisoned slabs the first ones left, against the reference: what a
// slab held before must never show.
func TestSpareSlabsAgainstReference(t *testing.T) {
	var dropped []*uint32
	for seed := range uint64(3) {
		w := newWorkload(seed, 10, 3000)
		tr := New(0)
		for range 60 {
			tr.Insert(w.seq(3000), 1)
		}
		if len(tr.slabs.slabs) < 2 {
			t.Fatalf("a tree of %d tokens filled %d slabs, want several", tr.Size(), len(tr.slabs.slabs))
		}
		for _, s := range tr.slabs.slabs {
			dropped = append(dropped, unsafe.SliceData(s))
		}
	}
	collectTrees(t, dropped)
	for _, limit := range []int{0, 3000, 200} {
		spare := spareSet()
		w := newWorkload(uint64(limit)+7, 10, 150)
		tr, ref := New(limit), newRef(limit)
		took := false
		rng := rand.New(rand.NewPCG(uint64(limit), 1))
		for step := range 500 {
			s := w.seq(120)
			tr.Insert(s, int64(step))
			ref.insert(s, int64(step))
			for _, s := range tr.slabs.slabs {
				took = took || spare[unsafe.SliceData(s)]
			}
			if tr.Size() != ref.size || tr.Evicted() != ref.evicted {
				t.Fatalf("cap %d step %d: size %d evicted %d, reference %d, %d", limit, step, tr.Size(), tr.Evicted(), ref.size, ref.evicted)
			}
			for range 4 {
				q := w.seq(120)
				if rng.IntN(2) == 0 {
					q = s
				}
				if got, want := tr.Match(q), ref.match(q); got != want {
					t.Fatalf("cap %d step %d: Match = %d, reference %d", limit, step, got, want)
				}
			}
			if step%100 == 0 {
				checkInvariants(t, tr)
				checkSurvivors(t, tr)
			}
		}
		// A tree capped below its first insert leaves its slab within it.
		if !took && limit != 200 {
			t.Fatalf("cap %d: the tree took no spare slab", limit)
		}
	}
}

// BenchmarkFillAfterCollect fills a tree with 4 M tokens of conversations
// (uncapped, as the simulator's trees are), drops it and collects it, as
// a sweep's runs build one fleet's trees after another's.
func BenchmarkFillAfterCollect(b *testing.B) {
	rng := rand.New(rand.NewPCG(7, 8))
	convs := conversations(rng, 256)
	b.ReportAllocs()
	for b.Loop() {
		tr := New(0)
		for _, c := range convs {
			tr.Insert(c, int64(tr.tick))
		}
		tr = nil
		runtime.GC()
	}
	b.ReportMetric(float64(len(convs)*benchMaxConv), "tokens/op")
}

// TestSpareSlabsDroppedWhenUnused: the spare slabs stay while a tree
// carves labels from slabs, however many collections pass, and go once
// none does and a collection has passed without any taken.
func TestSpareSlabsDroppedWhenUnused(t *testing.T) {
	w := newWorkload(1, 10, 3000)
	old := New(0)
	for range 30 {
		old.Insert(w.seq(3000), 1)
	}
	var dropped []*uint32
	for _, s := range old.slabs.slabs {
		dropped = append(dropped, unsafe.SliceData(s))
	}
	old = nil
	growing := New(0)
	growing.Insert([]uint32{1, 2, 3}, 1)
	collectTrees(t, dropped)
	for range 5 {
		runtime.GC()
	}
	if len(spareSet()) == 0 {
		t.Fatal("the spare slabs went while a tree carves labels from slabs")
	}
	runtime.KeepAlive(growing)
	for range 1000 {
		runtime.GC()
		if len(spareSet()) == 0 {
			return
		}
		runtime.Gosched()
	}
	t.Fatal("the spare slabs stay with no tree left to take them")
}
