package demo

import (
	"context"
	"errors"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/core/sched"
	"github.com/kvrouter/kvrouter/lab/trace"
)

func TestKVBeatsRoundRobinOnSynthetic(t *testing.T) {
	cfg := Config{Workers: 4, Seed: 1}
	wl := SyntheticWorkload(600, 16, 1)
	res, err := Compare(context.Background(), cfg, wl, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(res) != 2 || res[0].Mode != sched.ModeKV || res[1].Mode != sched.ModeRoundRobin {
		t.Fatalf("modes: %+v", res)
	}
	kvr, rr := res[0], res[1]
	for _, r := range res {
		t.Logf("%-12s hit %.3f prefill %d ttft %v/%v per worker %v events %d sim %v",
			r.Mode, r.HitRate, r.PrefillTokens, r.TTFTMean, r.TTFTP99, r.PerWorker, r.Events, r.SimDuration)
		if r.Requests != 600 || r.EventErrors != 0 || r.Events == 0 {
			t.Errorf("%s: requests %d, events %d, event errors %d", r.Mode, r.Requests, r.Events, r.EventErrors)
		}
		// The index is fed only by the engines' events, and every event is
		// applied before the next decision: the router must know exactly
		// what the chosen engine holds.
		if r.OverlapMismatches != 0 {
			t.Errorf("%s: %d requests where the router's overlap differed from the engine's cache", r.Mode, r.OverlapMismatches)
		}
	}
	// Round robin finds a conversation's latest history only when the
	// previous turn happened to land on the same engine (1 in 4), and
	// otherwise an older turn or just the system prompt; kv mode follows
	// the history. (With seed 1: kv ≈ 0.66, round robin ≈ 0.52, one engine
	// holding everything 0.77.)
	if c := wl.HitCeiling(); kvr.HitRate > c || c > 0.8 {
		t.Errorf("kv hit rate %.3f, ceiling %.3f", kvr.HitRate, c)
	}
	if kvr.HitRate < rr.HitRate+0.10 {
		t.Errorf("kv hit rate %.3f does not beat round robin's %.3f by 0.10", kvr.HitRate, rr.HitRate)
	}
	if float64(kvr.PrefillTokens) > 0.8*float64(rr.PrefillTokens) {
		t.Errorf("kv mode prefilled %d tokens, more than 80 %% of round robin's %d", kvr.PrefillTokens, rr.PrefillTokens)
	}
	// Load matters: kv mode must not pile the fleet onto few engines.
	for i := range cfg.Workers {
		if s := kvr.Share(i); s < 0.10 || s > 0.45 {
			t.Errorf("kv mode: worker %d took %.0f %% of requests", i, 100*s)
		}
		if s := rr.Share(i); s != 0.25 {
			t.Errorf("round robin: worker %d took %.1f %% of requests", i, 100*s)
		}
	}
}

func TestDeterministic(t *testing.T) {
	wl := SyntheticWorkload(200, 16, 3)
	a, err := Run(context.Background(), Config{Seed: 5}, wl, sched.ModeKV)
	if err != nil {
		t.Fatal(err)
	}
	b, err := Run(context.Background(), Config{Seed: 5}, wl, sched.ModeKV)
	if err != nil {
		t.Fatal(err)
	}
	if a.CachedBlocks != b.CachedBlocks || a.TTFTMean != b.TTFTMean || a.SimDuration != b.SimDuration {
		t.Fatalf("two runs differ: %+v\n%+v", a, b)
	}
}

func TestSmallCacheEvicts(t *testing.T) {
	// 64-block engines cannot hold the conversations: Removed events flow
	// and the index must stay exact through them.
	wl := SyntheticWorkload(300, 16, 2)
	res, err := Run(context.Background(), Config{Workers: 2, CapacityBlocks: 64}, wl, sched.ModeKV)
	if err != nil {
		t.Fatal(err)
	}
	if res.EventErrors != 0 || res.OverlapMismatches != 0 {
		t.Fatalf("event errors %d, mismatches %d", res.EventErrors, res.OverlapMismatches)
	}
	if res.HitRate <= 0 || res.HitRate >= 0.5 {
		t.Fatalf("hit rate %.3f with tiny caches", res.HitRate)
	}
}

func TestTraceWorkload(t *testing.T) {
	tr := &trace.Trace{Requests: []trace.Request{
		{InputLength: 1000, OutputLength: 10, HashIDs: []uint64{0, 1}},
		{InputLength: 1500, OutputLength: 10, HashIDs: []uint64{0, 1, 2}},
	}}
	wl := TraceWorkload("t", tr, 5, 16)
	if len(wl.Requests) != 2 || len(wl.Requests[1].Tokens) != 1500 || len(wl.Requests[1].seq) != 1500/16 {
		t.Fatalf("workload: %d requests", len(wl.Requests))
	}
	res, err := Run(context.Background(), Config{Workers: 1}, wl, sched.ModeKV)
	if err != nil {
		t.Fatal(err)
	}
	// The second prompt's first 1000 tokens (62 full blocks) are cached.
	if res.CachedBlocks != 62 || res.PromptBlocks != 62+93 {
		t.Fatalf("cached %d of %d blocks", res.CachedBlocks, res.PromptBlocks)
	}
}

func TestCancelled(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := Run(ctx, Config{}, SyntheticWorkload(100, 16, 1), sched.ModeKV)
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
}

// conversationTrace is shaped like the Mooncake conversation trace: every
// prompt starts with the shared block 0, a conversation's next turn repeats
// its whole previous prompt and adds a little, and a conversation comes back
// only after many other conversations' turns, each bringing a long new
// document of its own.
func conversationTrace(n int, seed uint64) *trace.Trace {
	rng := rand.New(rand.NewPCG(seed, 0xc0))
	next := uint64(1)
	fresh := func(k int) []uint64 {
		ids := make([]uint64, k)
		for i := range ids {
			ids[i], next = next, next+1
		}
		return ids
	}
	const active = 160
	newConv := func() []uint64 { return append([]uint64{0}, fresh(10+rng.IntN(8))...) }
	convs := make([][]uint64, active)
	turnsLeft := make([]int, active)
	for i := range convs {
		convs[i], turnsLeft[i] = newConv(), 2+rng.IntN(4)
	}
	tr := &trace.Trace{}
	for range n {
		k := rng.IntN(active)
		ids := slices.Clone(convs[k])
		tr.Requests = append(tr.Requests, trace.Request{
			InputLength: len(ids)*trace.BlockTokens - rng.IntN(trace.BlockTokens), OutputLength: 100 + rng.IntN(400), HashIDs: ids,
		})
		convs[k] = append(ids, fresh(1+rng.IntN(2))...)
		if turnsLeft[k]--; turnsLeft[k] == 0 {
			convs[k], turnsLeft[k] = newConv(), 2+rng.IntN(4)
		}
	}
	return tr
}

// With the demo's defaults a trace of returning conversations shows what
// the full replay shows: kv routing keeps nearly all the reuse one
// unlimited cache would find, round-robin a fraction, and kv's time to
// first token is lower.
func TestDefaultsShowKVRoutingOnConversations(t *testing.T) {
	wl := TraceWorkload("conversations", conversationTrace(800, 1), 0, DefaultConfig().BlockSize)
	res, err := Compare(context.Background(), Config{}, wl, nil)
	if err != nil {
		t.Fatal(err)
	}
	kvr, rr, ceiling := res[0], res[1], wl.HitCeiling()
	t.Logf("ceiling %.3f; kv hit %.3f TTFT %v/%v; round-robin hit %.3f TTFT %v/%v",
		ceiling, kvr.HitRate, kvr.TTFTMean, kvr.TTFTP99, rr.HitRate, rr.TTFTMean, rr.TTFTP99)
	if kvr.HitRate < 0.85*ceiling {
		t.Errorf("kv hit rate %.3f is below 85 %% of the ceiling %.3f", kvr.HitRate, ceiling)
	}
	if kvr.HitRate < rr.HitRate+0.25 {
		t.Errorf("kv hit rate %.3f does not beat round-robin's %.3f by 0.25", kvr.HitRate, rr.HitRate)
	}
	if kvr.TTFTMean >= rr.TTFTMean {
		t.Errorf("kv mean TTFT %v is not below round-robin's %v", kvr.TTFTMean, rr.TTFTMean)
	}
}
