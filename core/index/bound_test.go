package index

import (
	"testing"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/kv"
)

// blockChain is n blocks with engine ids from first, local hashes from first.
func blockChain(first uint64, n int) []kv.Block {
	bs := make([]kv.Block, n)
	for i := range bs {
		bs[i] = kv.Block{EngineHash: first + uint64(i), LocalHash: first + uint64(i)}
	}
	return bs
}

// An engine announcing 1,000 blocks that claims ten times as many keeps
// at most its bound in the index, and what stays is exactly a prefix of
// what it announced.
func TestRankClaimingTenTimesItsCapacityStaysBounded(t *testing.T) {
	const capacity = 1000
	w, other := kv.Worker{ID: 1}, kv.Worker{ID: 2}
	ix := New(Config{Shards: 2})
	ix.Reserve(w, capacity)
	ix.Reserve(other, capacity)
	bound := RankBound(capacity)

	// One event of the whole claim, then chains of 100 below it.
	big := blockChain(1, 10*capacity)
	ev := kv.StoredEvent(w, 0, nil, big...)
	if err := ix.Apply(&ev); err != nil {
		t.Fatal(err)
	}
	for i := range 50 {
		ev := kv.StoredEvent(w, uint64(i+1), kv.Ptr(uint64(i+1)), blockChain(1<<32+uint64(i)*1000, 100)...)
		_ = ix.Apply(&ev)
	}
	if got := ix.Blocks(w); got != bound {
		t.Fatalf("the rank holds %d blocks, want its bound %d", got, bound)
	}
	if err := ix.check(); err != nil {
		t.Fatal(err)
	}
	// What stays is the chain's head: matched from the root, unbroken.
	var m Matcher
	seq := blockhash.SequenceHashes(localsOf(big))
	if got := asMap(t, ix.FindMatches(&m, seq))[w]; got != uint32(bound) {
		t.Fatalf("the rank matches %d leading blocks, want %d", got, bound)
	}
	st := ix.Stats()
	if want := uint64(10*capacity + 50*100 - bound); st.BlocksOverBound != want {
		t.Fatalf("BlocksOverBound %d, want %d", st.BlocksOverBound, want)
	}
	ob := ix.OverBound()
	if len(ob) != 1 || ob[0].Worker != w || ob[0].Bound != bound || ob[0].Blocks != bound || ob[0].Refused != st.BlocksOverBound {
		t.Fatalf("OverBound = %+v", ob)
	}
	// Its removals of refused blocks are skipped; of held ones, applied,
	// which makes room again.
	rm := kv.RemovedEvent(w, 99, big[len(big)-1].EngineHash, big[bound-1].EngineHash)
	if err := ix.Apply(&rm); err != nil {
		t.Fatal(err)
	}
	if got := ix.Blocks(w); got != bound-1 {
		t.Fatalf("after removals the rank holds %d, want %d", got, bound-1)
	}
	// Another rank of the same shard is untouched by the first's excess.
	ok := kv.StoredEvent(other, 0, nil, blockChain(1<<40, capacity)...)
	if err := ix.Apply(&ok); err != nil || ix.Blocks(other) != capacity {
		t.Fatalf("the other rank holds %d (%v)", ix.Blocks(other), err)
	}
	// A rank forgotten and announced again starts its count afresh.
	ix.RemoveWorker(w.ID)
	if ob := ix.OverBound(); len(ob) != 0 {
		t.Fatalf("OverBound after the rank left: %+v", ob)
	}
}

func localsOf(bs []kv.Block) []uint64 {
	out := make([]uint64, len(bs))
	for i, b := range bs {
		out[i] = b.LocalHash
	}
	return out
}

// An engine that stores and evicts as a full cache does, at its capacity,
// never reaches its bound.
func TestRankAtItsCapacityNeverTripsTheBound(t *testing.T) {
	const capacity, step = 4096, 64
	w := kv.Worker{ID: 7}
	ix := New(Config{})
	ix.Reserve(w, capacity)
	var live []uint64
	next := uint64(1)
	for i := range 2000 {
		// A batch stores its request's blocks before it removes those
		// they evicted: the rank is briefly a chain over its capacity.
		bs := blockChain(next, step)
		next += step
		ev := kv.StoredEvent(w, uint64(i), nil, bs...)
		if err := ix.Apply(&ev); err != nil {
			t.Fatal(err)
		}
		for _, b := range bs {
			live = append(live, b.EngineHash)
		}
		if over := len(live) - capacity; over > 0 {
			rm := kv.RemovedEvent(w, uint64(i), live[:over]...)
			if err := ix.Apply(&rm); err != nil {
				t.Fatal(err)
			}
			live = live[over:]
		}
	}
	if st := ix.Stats(); st.BlocksOverBound != 0 || ix.Blocks(w) != capacity || len(ix.OverBound()) != 0 {
		t.Fatalf("a well-behaved engine tripped its bound: %d refused, %d held", st.BlocksOverBound, ix.Blocks(w))
	}
}

// A budget bounds the whole index without stamping lookups.
func TestBudgetBoundsTheIndexWithoutStamps(t *testing.T) {
	ix := New(Config{Shards: 2, BudgetPairs: 10_000})
	for r := range 40 {
		w := kv.Worker{ID: uint64(r)}
		for c := range 10 {
			ev := kv.StoredEvent(w, uint64(c), nil, blockChain(uint64(r)<<32|uint64(c)<<16, 100)...)
			if err := ix.Apply(&ev); err != nil {
				t.Fatal(err)
			}
		}
	}
	if p := ix.Pairs(); p > 10_000 {
		t.Fatalf("%d pairs under a budget of 10,000", p)
	}
	if st := ix.Stats(); st.PairsEvicted == 0 {
		t.Fatal("nothing evicted")
	}
	for i := range ix.shards {
		if ix.shards[i].t.lru {
			t.Fatal("a budget must not stamp lookups")
		}
	}
	if err := ix.check(); err != nil {
		t.Fatal(err)
	}
}
