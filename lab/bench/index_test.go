package bench

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/index"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/lab/trace"
)

func TestHistogram(t *testing.T) {
	for _, tc := range []struct {
		name   string
		values func(i int) uint64
		n      int
	}{
		{"small exact", func(i int) uint64 { return uint64(i % 100) }, 1000},
		{"linear", func(i int) uint64 { return uint64(i) * 997 }, 10000},
		{"heavy tail", func(i int) uint64 { return uint64(math.Exp(float64(i%500) / 25)) }, 5000},
		{"random", func(i int) uint64 { return rand.New(rand.NewPCG(uint64(i), 3)).Uint64N(1 << 40) }, 20000},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var h histogram
			vals := make([]uint64, tc.n)
			for i := range vals {
				vals[i] = tc.values(i)
				h.record(vals[i])
			}
			slices.Sort(vals)
			for _, q := range []float64{0, 0.5, 0.9, 0.99, 1} {
				rank := max(int(q*float64(tc.n)+0.5), 1)
				want := vals[rank-1]
				got := h.quantile(q)
				if diff := math.Abs(float64(got) - float64(want)); diff > float64(want)/64+1 {
					t.Errorf("q%.2f = %d, want %d ± 1.6%%", q, got, want)
				}
			}
		})
	}
	var a, b histogram
	a.record(10)
	b.record(1000)
	a.merge(&b)
	if a.n != 2 || a.quantile(1) != 1000 || a.quantile(0.5) != 10 {
		t.Errorf("merge: n %d, max %d, median %d", a.n, a.quantile(1), a.quantile(0.5))
	}
	var empty histogram
	if empty.quantile(0.5) != 0 {
		t.Error("empty histogram has a median")
	}
	for v := uint64(0); v < 1<<20; v = v*9/8 + 1 {
		b := bucketOf(v)
		if mid := bucketMid(b); bucketOf(mid) != b {
			t.Fatalf("mid %d of bucket %d (value %d) lies in bucket %d", mid, b, v, bucketOf(mid))
		}
	}
	if bucketOf(math.MaxUint64) >= len(a.counts) {
		t.Error("largest value overflows the buckets")
	}
}

// synthTrace makes a conversation-like trace: a shared system block, then
// conversations that come back with their history and a new turn.
func synthTrace(t *testing.T, requests int) *trace.Trace {
	rng := rand.New(rand.NewPCG(11, 12))
	var convs [][]uint64
	next := uint64(1)
	var sb strings.Builder
	for i := range requests {
		var ids []uint64
		if len(convs) > 0 && rng.IntN(3) > 0 {
			c := rng.IntN(len(convs))
			ids = append(convs[c], next)
			convs[c] = ids
		} else {
			ids = []uint64{0, next}
			convs = append(convs, ids)
		}
		next++
		input := (len(ids)-1)*512 + 1 + rng.IntN(512)
		fmt.Fprintf(&sb, `{"timestamp": %d, "input_length": %d, "output_length": 10, "hash_ids": [`, i, input)
		for j, id := range ids {
			if j > 0 {
				sb.WriteString(",")
			}
			fmt.Fprint(&sb, id)
		}
		sb.WriteString("]}\n")
	}
	tr, err := trace.Parse(strings.NewReader(sb.String()))
	if err != nil {
		t.Fatal(err)
	}
	return tr
}

func TestIndexBench(t *testing.T) {
	tr := synthTrace(t, 300)
	for _, tc := range []struct {
		name string
		cfg  IndexConfig
	}{
		{"one group", IndexConfig{Workers: 4, GroupSize: 4, CapacityBlocks: 256, MaxRequests: 600, Threads: 1}},
		{"uneven groups", IndexConfig{Workers: 10, GroupSize: 4, CapacityBlocks: 512, MaxRequests: 2000, Threads: 2, Chunk: 7}},
		{"block size 64", IndexConfig{Workers: 6, GroupSize: 3, CapacityBlocks: 100, BlockSize: 64, MaxRequests: 900, Threads: 3}},
		{"big cache", IndexConfig{Workers: 8, CapacityBlocks: 1 << 16, MaxRequests: 1000, Shards: 1, Threads: 1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rep, err := IndexBench(context.Background(), tr, tc.cfg)
			if err != nil {
				t.Fatal(err)
			}
			if rep.Requests != uint64(tc.cfg.MaxRequests) {
				t.Errorf("%d requests, want %d", rep.Requests, tc.cfg.MaxRequests)
			}
			if rep.ApplyErrors != 0 || rep.OverlapMismatches != 0 || rep.CrossGroupMatches != 0 {
				t.Errorf("apply errors %d, overlap mismatches %d, cross-group matches %d",
					rep.ApplyErrors, rep.OverlapMismatches, rep.CrossGroupMatches)
			}
			if rep.BlocksStored-rep.BlocksRemoved != rep.IndexedPairs {
				t.Errorf("stored %d - removed %d != indexed pairs %d", rep.BlocksStored, rep.BlocksRemoved, rep.IndexedPairs)
			}
			if cap := uint64(rep.Workers * rep.CapacityBlocks); rep.IndexedPairs > cap {
				t.Errorf("%d pairs exceed the fleet's %d blocks", rep.IndexedPairs, cap)
			}
			if rep.HitRate <= 0 || rep.HitRate >= 1 {
				t.Errorf("hit rate %v", rep.HitRate)
			}
			if rep.FindMatches == 0 || rep.Events == 0 || rep.OpsPerSec <= 0 || rep.BlockOpsPerSec <= 0 {
				t.Errorf("no throughput: %+v", rep)
			}
			if rep.FindMatchesP50us <= 0 || rep.FindMatchesP99us < rep.FindMatchesP50us || rep.ApplyP99us < rep.ApplyP50us {
				t.Errorf("percentiles: %+v", rep)
			}
			if rep.IndexHeapBytes == 0 || rep.BytesPerPair <= 0 || rep.HeapInuseBytes == 0 {
				t.Errorf("memory: %+v", rep)
			}
		})
	}
}

// With one goroutine the replay is a pure function of the seed.
func TestIndexBenchDeterministic(t *testing.T) {
	tr := synthTrace(t, 200)
	run := func(seed uint64) *IndexReport {
		rep, err := IndexBench(context.Background(), tr, IndexConfig{Workers: 12, GroupSize: 4, CapacityBlocks: 300, MaxRequests: 1500, Threads: 1, Seed: seed})
		if err != nil {
			t.Fatal(err)
		}
		return rep
	}
	key := func(r *IndexReport) [5]uint64 {
		return [5]uint64{r.BlocksStored, r.BlocksRemoved, r.IndexedPairs, r.Events, uint64(r.HitRate * 1e9)}
	}
	a, b := run(1), run(1)
	if key(a) != key(b) {
		t.Errorf("same seed, different runs: %v vs %v", key(a), key(b))
	}
}

// Groups serve disjoint copies: a group's requests never match another
// group's engines, and every group fills its own engines.
func TestIndexBenchGroupsDisjoint(t *testing.T) {
	tr := synthTrace(t, 100)
	one, err := IndexBench(context.Background(), tr, IndexConfig{Workers: 2, GroupSize: 2, CapacityBlocks: 1 << 14, MaxRequests: 100, Threads: 1})
	if err != nil {
		t.Fatal(err)
	}
	// One goroutine gives each group exactly its 100 requests; with two,
	// how the 800 split between them depends on the scheduler.
	for _, threads := range []int{1, 2} {
		many, err := IndexBench(context.Background(), tr, IndexConfig{Workers: 16, GroupSize: 2, CapacityBlocks: 1 << 14, MaxRequests: 800, Threads: threads, Chunk: 100})
		if err != nil {
			t.Fatal(err)
		}
		if many.CrossGroupMatches != 0 {
			t.Errorf("%d threads: %d matches across groups", threads, many.CrossGroupMatches)
		}
		if lo := 8 * one.IndexedPairs * 9 / 10; threads == 1 && many.IndexedPairs < lo {
			t.Errorf("eight groups hold %d pairs, one holds %d", many.IndexedPairs, one.IndexedPairs)
		}
	}
}

func TestIndexBenchStops(t *testing.T) {
	tr := synthTrace(t, 50)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	rep, err := IndexBench(ctx, tr, IndexConfig{Workers: 2, Duration: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Requests != 0 && rep.DurationS > 5 {
		t.Errorf("cancelled run went on for %.1f s", rep.DurationS)
	}
	start := time.Now()
	rep, err = IndexBench(context.Background(), tr, IndexConfig{Workers: 4, Duration: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if el := time.Since(start); el > 5*time.Second || rep.Requests == 0 {
		t.Errorf("200ms run: %v, %d requests", el, rep.Requests)
	}
	if _, err := IndexBench(context.Background(), tr, IndexConfig{}); err == nil {
		t.Error("no error without a duration or a request count")
	}
	if _, err := IndexBench(context.Background(), tr, IndexConfig{MaxRequests: 1, BlockSize: 24}); err == nil {
		t.Error("block size 24 accepted")
	}
}

func TestGroupChooseBoundedLoad(t *testing.T) {
	engines := make([]*engineCache, 4)
	g := newGroup(0, nil, engines, 3)
	overlap := []uint32{5, 0, 0, 0} // engine 0 always looks best
	counts := make([]int, 4)
	for range 1000 {
		counts[g.choose(overlap)]++
	}
	// Engine 0 takes its bounded share, ⌈1.25 · 32 / 4⌉ = 10 of every 32.
	if counts[0] < 300 || counts[0] > 320 {
		t.Errorf("engine 0 took %d of 1000, want ≈ 312", counts[0])
	}
	// An engine no request favours is not starved: the others cannot fill
	// the window between them.
	engines = make([]*engineCache, 8)
	g = newGroup(0, nil, engines, 3)
	counts = make([]int, 8)
	for range 6400 {
		counts[g.choose([]uint32{5, 5, 5, 5, 5, 5, 5, 0})]++
	}
	if counts[7] < 100 {
		t.Errorf("cold engine took %d of 6400 requests: %v", counts[7], counts)
	}
	// Full ties rotate evenly.
	engines = make([]*engineCache, 4)
	counts = make([]int, 4)
	g = newGroup(0, nil, engines, 3)
	clear(counts)
	for range 1000 {
		counts[g.choose(make([]uint32, 4))]++
	}
	for i, c := range counts {
		if c != 250 {
			t.Errorf("engine %d took %d of 1000 ties, want 250", i, c)
		}
	}
	// A large group whose window fills with every engine at the bound
	// still finds one below it, favoured or not.
	for _, favour := range []bool{false, true} {
		engines = make([]*engineCache, 64)
		g = newGroup(0, nil, engines, 3)
		counts = make([]int, 64)
		overlap := make([]uint32, 64)
		if favour {
			overlap[5] = 9
		}
		for range 6400 {
			counts[g.choose(overlap)]++
		}
		if !favour && slices.Min(counts) != 100 {
			t.Errorf("64 engines, ties: %v", counts)
		}
		if favour && (counts[5] < 6400*g.bound/len(g.window)-g.bound || slices.Min(counts) == 0) {
			t.Errorf("64 engines, one favoured (bound %d of %d): %v", g.bound, len(g.window), counts)
		}
	}
}

// The Dynamo count is blocks offered to FindMatches plus blocks stored,
// removed blocks left out. Two requests sharing a two-id prefix, at one
// block per id, on one engine: every count is known by hand.
func TestIndexBenchDynamoCount(t *testing.T) {
	tr, err := trace.Parse(strings.NewReader(`{"timestamp":0,"input_length":1536,"output_length":1,"hash_ids":[0,1,2]}
{"timestamp":1,"input_length":2048,"output_length":1,"hash_ids":[0,1,3,4]}
`))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name                     string
		capacity, length, dup    int
		requests                 int64
		lookedUp, stored, remove uint64
	}{
		// 3 + 4 offered; 3 stored, then 2 more once 0 and 1 hit, and the
		// 4-block engine drops one block to make room.
		{"plain", 4, 1, 1, 2, 7, 5, 1},
		// Each id becomes two blocks: 6 + 8 offered, 6 + 4 stored, 2 evicted.
		{"length factor 2", 8, 2, 1, 2, 14, 10, 2},
		// Both requests in two disjoint copies: nothing of one copy hits
		// the other, so each copy stores what the plain run stores.
		{"duplication factor 2", 100, 1, 2, 4, 14, 10, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rep, err := IndexBench(context.Background(), tr, IndexConfig{
				Workers: 1, GroupSize: 1, CapacityBlocks: tc.capacity, BlockSize: trace.BlockTokens, Threads: 1,
				MaxRequests: tc.requests, TraceLengthFactor: tc.length, TraceDuplication: tc.dup,
			})
			if err != nil {
				t.Fatal(err)
			}
			if rep.Requests != uint64(tc.requests) || rep.BlocksLookedUp != tc.lookedUp || rep.BlocksStored != tc.stored || rep.BlocksRemoved != tc.remove {
				t.Fatalf("requests %d, looked up %d, stored %d, removed %d; want %d, %d, %d, %d",
					rep.Requests, rep.BlocksLookedUp, rep.BlocksStored, rep.BlocksRemoved, tc.requests, tc.lookedUp, tc.stored, tc.remove)
			}
			if want := tc.lookedUp + tc.stored; rep.DynamoBlockOps != want {
				t.Fatalf("dynamo block ops %d, want %d", rep.DynamoBlockOps, want)
			}
			if got := rep.DynamoBlockOpsPerSec * rep.DurationS; math.Abs(got-float64(rep.DynamoBlockOps)) > 1e-6*got {
				t.Errorf("dynamo block ops/s %.1f over %.6f s is not %d blocks", rep.DynamoBlockOpsPerSec, rep.DurationS, rep.DynamoBlockOps)
			}
			if rep.TraceLengthFactor != tc.length || rep.TraceDuplication != tc.dup {
				t.Errorf("report's factors %d, %d", rep.TraceLengthFactor, rep.TraceDuplication)
			}
		})
	}
}

// A pregenerated run plays the same operations as a live one: with one
// goroutine, the same seed and the same requests, it looks up, stores and
// removes the same blocks, and the index answers each lookup with the
// overlap the engine's own cache had when the run was recorded.
func TestIndexBenchPregenerated(t *testing.T) {
	tr := synthTrace(t, 300)
	cfg := IndexConfig{Workers: 12, GroupSize: 4, CapacityBlocks: 300, MaxRequests: 1500, Threads: 1, Seed: 3}
	live, err := IndexBench(context.Background(), tr, cfg)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Pregenerate = true
	pre, err := IndexBench(context.Background(), tr, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if !pre.Pregenerated || live.Pregenerated {
		t.Errorf("pregenerated flags: live %v, pregenerated %v", live.Pregenerated, pre.Pregenerated)
	}
	key := func(r *IndexReport) [7]uint64 {
		return [7]uint64{r.Requests, r.FindMatches, r.Events, r.BlocksLookedUp, r.BlocksStored, r.BlocksRemoved, uint64(r.HitRate * 1e9)}
	}
	if key(live) != key(pre) {
		t.Errorf("live %v, pregenerated %v", key(live), key(pre))
	}
	if pre.OverlapMismatches != 0 || pre.ApplyErrors != 0 || pre.IndexedPairs != live.IndexedPairs {
		t.Errorf("pregenerated: %d mismatches, %d apply errors, %d pairs (live %d)",
			pre.OverlapMismatches, pre.ApplyErrors, pre.IndexedPairs, live.IndexedPairs)
	}
	if pre.DynamoBlockOps != pre.BlocksLookedUp+pre.BlocksStored {
		t.Errorf("Dynamo count %d, want looked up %d + stored %d", pre.DynamoBlockOps, pre.BlocksLookedUp, pre.BlocksStored)
	}
}

// The check a pregenerated run makes is live: a lookup answered from an
// index that lost blocks is counted as a mismatch.
func TestIndexBenchPregeneratedCountsMismatches(t *testing.T) {
	tr := synthTrace(t, 300)
	rep, err := IndexBench(context.Background(), tr, IndexConfig{Workers: 4, GroupSize: 4, CapacityBlocks: 2000,
		MaxRequests: 600, Threads: 1, Pregenerate: true, MaxPairs: 500})
	if err != nil {
		t.Fatal(err)
	}
	if rep.OverlapMismatches == 0 {
		t.Error("an index capped below the engines' caches matched every lookup")
	}
}

func TestIndexBenchPregenerateNeedsRequests(t *testing.T) {
	_, err := IndexBench(context.Background(), synthTrace(t, 10), IndexConfig{Duration: time.Second, Pregenerate: true})
	if err == nil {
		t.Error("a pregenerated run without a request count started")
	}
}

// Engines announce a long prompt's blocks over several steps: cutting the
// events into steps changes how many there are, never what the index ends
// up holding or what a lookup finds.
func TestIndexBenchEventsPerStep(t *testing.T) {
	tr := synthTrace(t, 200)
	run := func(stepTokens int) *IndexReport {
		rep, err := IndexBench(context.Background(), tr, IndexConfig{Workers: 8, GroupSize: 4, CapacityBlocks: 300,
			MaxRequests: 1500, Threads: 1, StepTokens: stepTokens})
		if err != nil {
			t.Fatal(err)
		}
		if rep.ApplyErrors != 0 || rep.OverlapMismatches != 0 {
			t.Fatalf("step of %d tokens: apply errors %d, overlap mismatches %d", stepTokens, rep.ApplyErrors, rep.OverlapMismatches)
		}
		return rep
	}
	whole, steps := run(1<<20), run(64)
	if whole.BlocksStored != steps.BlocksStored || whole.BlocksRemoved != steps.BlocksRemoved ||
		whole.IndexedPairs != steps.IndexedPairs || whole.HitRate != steps.HitRate {
		t.Fatalf("per step %+v, whole requests %+v: the index should end the same", steps, whole)
	}
	// 64 tokens are 4 blocks of 16: at least a quarter as many events as blocks.
	if least := (steps.BlocksStored + steps.BlocksRemoved + 3) / 4; steps.Events < least {
		t.Fatalf("%d events for %d blocks stored and %d removed: some carried more than 4 blocks", steps.Events, steps.BlocksStored, steps.BlocksRemoved)
	}
	if whole.Events >= steps.Events {
		t.Fatalf("whole requests took %d events, steps %d", whole.Events, steps.Events)
	}
}

// Every shard takes events from one replay goroutine only, and every
// engine gets its own id.
func TestEngineIDsGiveEachShardOneWriter(t *testing.T) {
	for _, tc := range []struct {
		workers, groupSize, threads, shards int
		aligned                             bool
	}{
		{1000, 8, 2, 4, true},
		{10, 4, 2, 2, true},
		{64, 8, 4, 16, true},
		{9, 3, 3, 4, true},
		{16, 4, 1, 4, false},
		{32, 4, 8, 4, false}, // more goroutines than shards
	} {
		ix := index.New(index.Config{Shards: tc.shards})
		ids, aligned := engineIDs(ix, tc.workers, tc.groupSize, tc.threads)
		if aligned != tc.aligned {
			t.Errorf("%+v: aligned %v", tc, aligned)
		}
		seen := map[uint64]bool{}
		writer := map[int]int{} // shard → goroutine
		for g, group := range ids {
			if want := min(tc.groupSize, tc.workers-g*tc.groupSize); len(group) != want {
				t.Errorf("%+v: group %d has %d engines, want %d", tc, g, len(group), want)
			}
			for _, id := range group {
				if seen[id] {
					t.Errorf("%+v: id %d given twice", tc, id)
				}
				seen[id] = true
				sh := ix.ShardOf(kv.Worker{ID: id})
				if w, ok := writer[sh]; ok && w != g%tc.threads && aligned {
					t.Errorf("%+v: shard %d written by goroutines %d and %d", tc, sh, w, g%tc.threads)
				}
				writer[sh] = g % tc.threads
			}
		}
		if len(seen) != tc.workers {
			t.Errorf("%+v: %d engines, want %d", tc, len(seen), tc.workers)
		}
	}
}
