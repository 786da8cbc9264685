package router

import (
	"errors"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/sched"
)

func randomTokens(rng *rand.Rand, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = rng.Uint32N(50000)
	}
	return out
}

// storeEngine feeds the router what an engine of block size size emits
// after caching toks (its full blocks), as one Stored event.
func storeEngine(t *testing.T, r *Router, w kv.Worker, size int, toks []uint32) {
	t.Helper()
	n := len(toks) / size
	es := EngineStored{Worker: w, Tokens: toks[:n*size], BlockSize: size}
	for i := range n {
		es.EngineHashes = append(es.EngineHashes, w.ID<<32|uint64(i+1))
	}
	if err := r.ApplyEngineStored(&es); err != nil {
		t.Fatal(err)
	}
}

// Engines of three block sizes behind a router of a fourth: each must be
// matched by its own block size, its overlap counted in whole router
// blocks. The reference is the arithmetic: an engine of block size s
// caching the first c tokens of a prompt holds floor(c/s) blocks of it,
// which is floor(floor(c/s)·s/B) router blocks of B tokens.
func TestEnginesOfOtherBlockSizesAreMatchedInTheirOwn(t *testing.T) {
	const routerSize = 64
	sizes := []int{16, 32, 64, 128}
	r, _ := newRouter(t, 0, func(c *Config) { c.BlockSize = routerSize })
	rng := rand.New(rand.NewPCG(5, 6))
	convs := make([][]uint32, len(sizes))
	for id, size := range sizes {
		r.AddWorker(WorkerInfo{ID: uint64(id)})
		convs[id] = randomTokens(rng, 1000)
		storeEngine(t, r, w(uint64(id)), size, convs[id])
	}
	for range 200 {
		owner := rng.IntN(len(sizes))
		cached := rng.IntN(len(convs[owner]) + 1)
		prompt := append(append([]uint32{}, convs[owner][:cached]...), randomTokens(rng, rng.IntN(300))...)
		for _, l := range r.PotentialLoads(prompt, "") {
			want := 0
			if int(l.Worker.ID) == owner {
				size := sizes[owner]
				want = cached / size * size / routerSize
			}
			if l.OverlapBlocks != want {
				t.Fatalf("engine %d (block size %d), prompt of %d tokens with %d of engine %d's cached: overlap %d router blocks, want %d",
					l.Worker.ID, sizes[l.Worker.ID], len(prompt), cached, owner, l.OverlapBlocks, want)
			}
		}
	}
	// A repeated prompt goes back to the engine that caches it.
	for id, conv := range convs {
		d, err := route(r, "", conv)
		if err != nil {
			t.Fatal(err)
		}
		if d.Worker != w(uint64(id)) || d.OverlapBlocks == 0 {
			t.Fatalf("conversation of engine %d (block size %d) routed to %v with overlap %d", id, sizes[id], d.Worker, d.OverlapBlocks)
		}
	}
}

func TestLearntBlockSizeIsReportedOnceAndForgottenWithTheEngine(t *testing.T) {
	r, _ := newRouter(t, 2, func(c *Config) { c.BlockSize = 64 })
	var changes []BlockSizeChange
	r.SetBlockSizeObserver(func(c BlockSizeChange) { changes = append(changes, c) })
	rng := rand.New(rand.NewPCG(1, 1))
	for range 3 {
		storeEngine(t, r, w(1), 16, randomTokens(rng, 256))
		storeEngine(t, r, w(0), 64, randomTokens(rng, 256))
	}
	want := BlockSizeChange{ID: 1, BlockSize: 16, Previous: 64, RouterBlockSize: 64}
	if len(changes) != 1 || changes[0] != want {
		t.Fatalf("changes %+v, want only %+v", changes, want)
	}
	got := r.WorkerBlockSizes()
	if len(got) != 2 || got[0] != (WorkerBlockSize{ID: 0, BlockSize: 64, Learned: true}) || got[1] != (WorkerBlockSize{ID: 1, BlockSize: 16, Learned: true}) ||
		got[0].Mismatched(64) || !got[1].Mismatched(64) {
		t.Fatalf("WorkerBlockSizes() = %+v", got)
	}
	r.RemoveWorker(1)
	r.AddWorker(WorkerInfo{ID: 1})
	if got := r.WorkerBlockSizes(); got[1] != (WorkerBlockSize{ID: 1, BlockSize: 64}) {
		t.Fatalf("after the engine left and came back: %+v, want the router's block size until its events say", got[1])
	}
}

// On the NATS plane routers receive events an agent already hashed in the
// engine's block size, and know that size from discovery.
func TestAnnouncedBlockSizeMatchesPrehashedEvents(t *testing.T) {
	r, _ := newRouter(t, 0, func(c *Config) { c.BlockSize = 64 })
	r.AddWorker(WorkerInfo{ID: 0})
	r.AddWorker(WorkerInfo{ID: 1, BlockSize: 16})
	toks := randomTokens(rand.New(rand.NewPCG(2, 2)), 512)
	local := blockhash.New(16, "").LocalHashes(toks)
	blocks := make([]kv.Block, len(local))
	for i, l := range local {
		blocks[i] = kv.Block{EngineHash: uint64(i + 1), LocalHash: l}
	}
	ev := kv.StoredEvent(w(1), 0, nil, blocks...)
	if err := r.ApplyEvent(&ev); err != nil {
		t.Fatal(err)
	}
	d, err := route(r, "", toks)
	if err != nil {
		t.Fatal(err)
	}
	if d.Worker != w(1) || d.OverlapBlocks != 8 || d.PromptBlocks != 8 {
		t.Fatalf("decision %+v, want engine 1 with all 8 router blocks cached", d)
	}
}

// The approximate index records the router's own decisions, in router
// blocks, whatever the engines' block size; predict-on-route adds to an
// exact overlap converted to router blocks.
func TestApproximateIndexesStayInRouterBlocks(t *testing.T) {
	rng := rand.New(rand.NewPCG(4, 4))
	for _, tc := range []struct {
		name string
		edit func(*Config)
	}{
		{"approximate", func(c *Config) { c.KVEvents = false }},
		{"predict-on-route", func(c *Config) { c.PredictedTTL = time.Minute }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, _ := newRouter(t, 0, func(c *Config) { c.BlockSize = 64; tc.edit(c) })
			r.AddWorker(WorkerInfo{ID: 0, BlockSize: 16})
			r.AddWorker(WorkerInfo{ID: 1, BlockSize: 16})
			toks := randomTokens(rng, 64*5+10)
			first, err := route(r, "a", toks)
			if err != nil {
				t.Fatal(err)
			}
			r.Free("a")
			again, err := route(r, "", toks)
			if err != nil {
				t.Fatal(err)
			}
			if again.Worker != first.Worker || again.OverlapBlocks != 5 {
				t.Fatalf("repeated prompt: %+v, want %v with 5 router blocks predicted", again, first.Worker)
			}
		})
	}
}

// Busy detection compares booked blocks (router blocks) with the engine's
// capacity, which it reports in its own blocks.
func TestDecodeBusyThresholdCountsCapacityInRouterBlocks(t *testing.T) {
	r, _ := newRouter(t, 0, func(c *Config) { c.BlockSize = 64 })
	// 64 blocks of 16 tokens hold 1,024 tokens: 16 router blocks.
	r.AddWorker(WorkerInfo{ID: 0, BlockSize: 16, TotalKVBlocks: 64})
	half := 0.5
	if _, err := r.Thresholds().Set("m", sched.BusyThreshold{ActiveDecodeBlocks: &half}); err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(8, 8))
	if _, err := r.BestWorker(ctx(), &Request{ID: "a", Model: "m", Tokens: randomTokens(rng, 64*9)}); err != nil {
		t.Fatal(err)
	}
	if _, err := r.BestWorker(ctx(), &Request{ID: "b", Model: "m", Tokens: randomTokens(rng, 64)}); !errors.Is(err, sched.ErrAllBusy) {
		t.Fatalf("9 router blocks booked of the engine's 16: want busy above half, got %v", err)
	}
}

// A Stored event whose tokens do not fill its blocks says nothing reliable
// about the engine's block size; nor does an absurd one.
func TestMalformedEventsDoNotChangeAnEnginesBlockSize(t *testing.T) {
	r, _ := newRouter(t, 1, func(c *Config) { c.BlockSize = 64 })
	rng := rand.New(rand.NewPCG(9, 9))
	storeEngine(t, r, w(0), 16, randomTokens(rng, 256))
	for _, es := range []EngineStored{
		{Worker: w(0), EngineHashes: []uint64{100, 101}, Tokens: randomTokens(rng, 40), BlockSize: 32},
		{Worker: w(0), EngineHashes: []uint64{102}, Tokens: randomTokens(rng, 8), BlockSize: 1 << 40},
		{Worker: w(0), EngineHashes: []uint64{103}, Tokens: randomTokens(rng, 8), BlockSize: -8},
	} {
		_ = r.ApplyEngineStored(&es)
	}
	if got := r.WorkerBlockSize(0); got != 16 {
		t.Fatalf("block size %d after malformed events, want 16", got)
	}
	// Nor does an absurd announced one.
	r.AddWorker(WorkerInfo{ID: 1, BlockSize: 1 << 50, TotalKVBlocks: 1 << 20})
	if got := r.WorkerBlockSize(1); got != 64 {
		t.Fatalf("announced block size 2^50 taken as %d, want the router's 64", got)
	}
}
