package index

import (
	"fmt"
	"testing"

	"github.com/kvrouter/kvrouter/core/kv"
)

// fillRanks gives each of ranks worker ranks a chain of blocks blocks and
// a few branches, so that every rank has parents to resolve.
func fillRanks(t testing.TB, ix *Index, ranks, blocks int) {
	for r := range ranks {
		w := kv.Worker{ID: uint64(r + 1)}
		bs := make([]kv.Block, blocks)
		for i := range bs {
			bs[i] = kv.Block{EngineHash: uint64(r)<<32 | uint64(i+1), LocalHash: uint64(i + 1)}
		}
		ev := kv.StoredEvent(w, 0, nil, bs...)
		if err := ix.Apply(&ev); err != nil {
			t.Fatal(err)
		}
		br := kv.StoredEvent(w, 1, kv.Ptr(bs[blocks/2].EngineHash), kv.Block{EngineHash: uint64(r)<<32 | 1<<31, LocalHash: 7})
		if err := ix.Apply(&br); err != nil {
			t.Fatal(err)
		}
	}
}

func TestDumpToStreamsBatchesThatReplayToTheIndex(t *testing.T) {
	for seed := uint64(1); seed <= 4; seed++ {
		g := newGen(seed)
		ix := New(Config{Shards: 3})
		for range 3000 {
			ev := g.next()
			_ = ix.Apply(&ev)
		}
		fillRanks(t, ix, 4, DumpBatch+100)
		replay := New(Config{Shards: 3})
		var d Dumper
		batches := 0
		err := ix.DumpTo(&d, func(evs []kv.Event) error {
			if len(evs) == 0 || len(evs) > DumpBatch {
				t.Fatalf("batch of %d events", len(evs))
			}
			batches++
			for i := range evs {
				if err := replay.Apply(&evs[i]); err != nil {
					return fmt.Errorf("replaying: %w", err)
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		if batches < 4 {
			t.Fatalf("%d batches for %d pairs", batches, ix.Pairs())
		}
		sameAfterReplay(t, seed, g, ix, replay)
	}
}

func TestDumpToStopsAtTheVisitorsError(t *testing.T) {
	ix := New(Config{Shards: 1})
	fillRanks(t, ix, 3, DumpBatch)
	calls := 0
	stop := fmt.Errorf("client gone")
	if err := ix.DumpTo(&Dumper{}, func([]kv.Event) error { calls++; return stop }); err != stop || calls != 1 {
		t.Fatalf("DumpTo = %v after %d calls, want the visitor's error after 1", err, calls)
	}
}

// A dump's memory follows the largest rank, not the index: a reused
// Dumper allocates nothing more for an index 16 times larger.
func TestDumpMemoryDoesNotGrowWithTheIndex(t *testing.T) {
	perDump := func(ranks int) float64 {
		ix := New(Config{Shards: 4})
		fillRanks(t, ix, ranks, 2000)
		var d Dumper
		visit := func([]kv.Event) error { return nil }
		_ = ix.DumpTo(&d, visit) // grows the scratch to the largest rank
		return testing.AllocsPerRun(3, func() { _ = ix.DumpTo(&d, visit) })
	}
	small, large := perDump(4), perDump(64)
	if large > small+4 || large > 16 {
		t.Fatalf("allocations per dump: %v for 4 ranks, %v for 64 (must not grow with the index)", small, large)
	}
}

// sameAfterReplay checks that replay, rebuilt from ix's dump, holds what
// ix holds and matches as it does.
func sameAfterReplay(t *testing.T, seed uint64, g *eventGen, ix, replay *Index) {
	t.Helper()
	if err := replay.check(); err != nil {
		t.Fatal(err)
	}
	if got, want := replay.held(), ix.held(); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("seed %d: replayed pairs differ\n got %v\nwant %v", seed, got, want)
	}
	var m1, m2 Matcher
	for _, q := range queries(g.rng, ix) {
		a, b := asMap(t, ix.FindMatches(&m1, q)), asMap(t, replay.FindMatches(&m2, q))
		if fmt.Sprint(a) != fmt.Sprint(b) {
			t.Fatalf("seed %d: FindMatches after replay %v, before %v", seed, b, a)
		}
	}
}

// Equal indexes dump alike, whatever order their blocks arrived in: the
// snapshot a new replica loads is compared event for event with the
// engine's own account, and a node numbering that follows arrival order
// would tell them apart.
func TestDumpIsTheSameForEqualIndexes(t *testing.T) {
	for seed := uint64(1); seed <= 4; seed++ {
		g := newGen(seed)
		ix := New(Config{Shards: 2})
		for range 3000 {
			ev := g.next()
			_ = ix.Apply(&ev)
		}
		want := ix.Dump()
		replay := New(Config{Shards: 2})
		for i := range want {
			ev := want[i]
			if err := replay.Apply(&ev); err != nil {
				t.Fatal(err)
			}
		}
		got := replay.Dump()
		if len(got) != len(want) {
			t.Fatalf("seed %d: %d events, want %d", seed, len(got), len(want))
		}
		for i := range got {
			if a, b := dumpLine(got[i]), dumpLine(want[i]); a != b {
				t.Fatalf("seed %d, event %d:\n got %s\nwant %s", seed, i, a, b)
			}
		}
	}
}

func dumpLine(ev kv.Event) string {
	parent := "root"
	if ev.Stored.Parent != nil {
		parent = fmt.Sprint(*ev.Stored.Parent)
	}
	return fmt.Sprintf("%v %d %v %v %v", ev.Worker, ev.EventID, parent, ev.Stored.Blocks, ev.Removed.EngineHashes)
}
