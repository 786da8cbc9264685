package engine

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
)

// drain steps e until it is idle, checking it and feeding idx after every
// step, and returns the step results (their Outputs copied).
func drain(t *testing.T, e *Engine, idx *eventIndex) []StepResult {
	t.Helper()
	var out []StepResult
	for steps := 0; !e.Idle(); steps++ {
		if steps > 100000 {
			t.Fatal("the engine does not drain")
		}
		res := e.Step()
		res.Outputs = slices.Clone(res.Outputs)
		idx.apply(t, res.Events)
		idx.check(t, e)
		checkEngine(t, e)
		out = append(out, res)
	}
	return out
}

// TestHeldBlocksSurvivePressureAndAreCachedAfterRelease: a finished request
// asked to hold keeps exactly its full prompt blocks active (counted in KV
// usage) while a stream of other requests evicts everything evictable;
// after Release they are cached and reusable, and releasing publishes
// nothing.
func TestHeldBlocksSurvivePressureAndAreCachedAfterRelease(t *testing.T) {
	for _, tc := range []struct {
		name      string
		prompt    int
		maxTokens int
		wantHeld  int
	}{
		{"prompt with a partial block", 22, 1, 5},
		{"prompt of whole blocks", 24, 1, 6},
		{"generated blocks are not held", 10, 12, 2},
		{"shorter than a block holds nothing", 3, 1, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := Config{BlockSize: 4, NumGPUBlocks: 16, MaxNumSeqs: 4, MaxNumBatchedTokens: 64, EnablePrefixCaching: true, Seed: 5}
			e := mustNew(t, cfg)
			idx := newEventIndex(cfg)
			prompt := seqTokens(7, tc.prompt)
			if err := e.Add(Request{ID: "p", Tokens: prompt, MaxTokens: tc.maxTokens, HoldBlocks: true}); err != nil {
				t.Fatal(err)
			}
			drain(t, e, idx)
			held := e.HeldBlocks("p")
			if len(held) != tc.wantHeld {
				t.Fatalf("holds %d blocks %v, want %d", len(held), held, tc.wantHeld)
			}
			if m := e.Metrics(); m.HeldBlocks != tc.wantHeld || m.ActiveBlocks != tc.wantHeld || m.Running+m.Waiting != 0 {
				t.Fatalf("metrics while holding: %+v", m)
			}
			if err := e.Add(Request{ID: "p", Tokens: prompt, MaxTokens: 1}); tc.wantHeld > 0 && err == nil {
				t.Fatal("a held request's id was accepted again")
			}
			heldHash := map[uint64]bool{}
			for _, b := range held {
				heldHash[e.bm.blocks[b].hash] = true
			}

			// Pressure: 40 distinct requests of 3 blocks each through the
			// remaining slots.
			evicted := 0
			for i := range 40 {
				mustAdd(t, e, fmt.Sprint("q", i), seqTokens(uint32(1000+100*i), 8), 4)
				for _, res := range drain(t, e, idx) {
					for _, h := range removed(res.Events) {
						evicted++
						if heldHash[h] {
							t.Fatalf("held block %x evicted", h)
						}
					}
				}
			}
			if evicted == 0 {
				t.Fatal("no eviction: the test exerts no pressure")
			}
			if got := e.HeldBlocks("p"); !slices.Equal(got, held) {
				t.Fatalf("held blocks changed under pressure: %v, were %v", got, held)
			}

			if e.Release("p") != (tc.wantHeld > 0) || e.Release("p") {
				t.Fatal("Release must report a hold once")
			}
			checkEngine(t, e)
			if m := e.Metrics(); m.HeldBlocks != 0 || m.ActiveBlocks != 0 || m.KVUsage != 0 {
				t.Fatalf("metrics after release: %+v", m)
			}
			idx.check(t, e) // released to the cache: nothing to publish
			if got := e.CachedPrefixBlocks(prompt); got != tc.wantHeld {
				t.Fatalf("%d leading blocks cached after release, want %d", got, tc.wantHeld)
			}
			mustAdd(t, e, "again", slices.Concat(prompt, seqTokens(90000, 3)), 1)
			res := drain(t, e, idx)
			if got := res[0].Outputs[0].CachedTokens; got != tc.wantHeld*cfg.BlockSize {
				t.Fatalf("the released prompt hit %d cached tokens, want %d", got, tc.wantHeld*cfg.BlockSize)
			}
		})
	}
}

// TestAbortHoldsNothing: only a request that finished holds its blocks.
func TestAbortHoldsNothing(t *testing.T) {
	e := mustNew(t, DefaultConfig())
	if err := e.Add(Request{ID: "p", Tokens: seqTokens(0, 100), MaxTokens: 5, HoldBlocks: true}); err != nil {
		t.Fatal(err)
	}
	e.Step()
	if !e.Abort("p") || e.HeldBlocks("p") != nil || e.Release("p") || e.KVUsage() != 0 {
		t.Fatal("an aborted request kept blocks")
	}
	checkEngine(t, e)
}

// TestKVLoadedRequestSkipsPrefill: the loaded blocks cost no prefill time
// (the first step is the timing model's for the rest of the prompt alone),
// the ones the engine did not cache are Stored, the last prompt token is
// always computed, and usage reports the loaded tokens as cached while the
// prefix-cache metrics count local hits only.
func TestKVLoadedRequestSkipsPrefill(t *testing.T) {
	for _, tc := range []struct {
		name         string
		prompt       int // tokens, block size 16
		cachedBefore int // leading tokens of the prompt cached before
		loaded       int // KVLoadedBlocks
		wantPrefill  int
		wantStored   int // blocks Stored by the first step
	}{
		{"all full blocks loaded", 1000, 0, 62, 8, 62},
		{"whole-block prompt computes its last token", 1024, 0, 64, 1, 64},
		{"some blocks loaded", 1000, 0, 10, 840, 62},
		{"nothing loaded", 1000, 0, 0, 1000, 62},
		{"cached prefix, rest loaded", 1000, 320, 62, 8, 42},
		{"loaded fewer than cached", 1000, 640, 10, 360, 22},
		{"shorter than a block", 10, 0, 0, 10, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := DefaultConfig()
			e := mustNew(t, cfg)
			idx := newEventIndex(cfg)
			prompt := seqTokens(3, tc.prompt)
			if tc.cachedBefore > 0 {
				mustAdd(t, e, "warm", slices.Concat(prompt[:tc.cachedBefore], seqTokens(70000, 5)), 1)
				drain(t, e, idx)
			}
			hitsBefore, before := e.Metrics().PrefixHits, e.Metrics()
			if got := e.CachedPrefixBlocks(prompt); got != tc.cachedBefore/16 {
				t.Fatalf("CachedPrefixBlocks %d, want %d", got, tc.cachedBefore/16)
			}
			if err := e.Add(Request{ID: "d", Tokens: prompt, MaxTokens: 3, KVLoadedBlocks: tc.loaded}); err != nil {
				t.Fatal(err)
			}
			res := e.Step()
			idx.apply(t, res.Events)
			idx.check(t, e)
			checkEngine(t, e)
			if res.PrefillTokens != tc.wantPrefill || res.DecodeSeqs != 0 {
				t.Fatalf("first step prefilled %d tokens (%d decodes), want %d", res.PrefillTokens, res.DecodeSeqs, tc.wantPrefill)
			}
			if want := PrefillTime(tc.wantPrefill); res.Duration != want {
				t.Fatalf("first step took %v, the timing model says %v for %d tokens", res.Duration, want, tc.wantPrefill)
			}
			stored := 0
			for _, ev := range res.Events {
				if ev.Kind == Stored {
					stored += len(ev.BlockHashes)
				}
			}
			if stored != tc.wantStored {
				t.Fatalf("%d blocks Stored, want %d", stored, tc.wantStored)
			}
			if len(res.Outputs) != 1 || res.Outputs[0].CachedTokens != tc.prompt-tc.wantPrefill {
				t.Fatalf("outputs %+v, want CachedTokens %d", res.Outputs, tc.prompt-tc.wantPrefill)
			}
			if hits := e.Metrics().PrefixHits - hitsBefore; hits != uint64(tc.cachedBefore/16*16) {
				t.Fatalf("prefix hits %d, want the local %d only", hits, tc.cachedBefore/16*16)
			}
			m, wantQ, wantH := e.Metrics(), uint64(0), uint64(0)
			if tc.loaded > 0 {
				wantQ, wantH = uint64(tc.prompt), uint64(tc.cachedBefore/16*16)
			}
			if m.LoadedQueries-before.LoadedQueries != wantQ || m.LoadedHits-before.LoadedHits != wantH {
				t.Fatalf("loaded lookups %d, hits %d; want %d, %d", m.LoadedQueries-before.LoadedQueries, m.LoadedHits-before.LoadedHits, wantQ, wantH)
			}
			drain(t, e, idx)
		})
	}
	e := mustNew(t, DefaultConfig())
	for _, n := range []int{-1, 7} {
		if err := e.Add(Request{ID: "x", Tokens: seqTokens(0, 100), MaxTokens: 1, KVLoadedBlocks: n}); err == nil {
			t.Fatalf("KVLoadedBlocks %d of a 6-block prompt accepted", n)
		}
	}
}

// TestPreemptedKVLoadedRequestRecomputes: a loaded request that is
// preempted and loses its blocks computes its whole prompt again when it
// restarts: the pulled copy counts once.
func TestPreemptedKVLoadedRequestRecomputes(t *testing.T) {
	cfg := Config{BlockSize: 4, NumGPUBlocks: 8, MaxNumSeqs: 2, MaxNumBatchedTokens: 64, EnablePrefixCaching: true, Seed: 1}
	e := mustNew(t, cfg)
	idx := newEventIndex(cfg)
	// b alone ends up holding all 8 blocks; a, started after it, is the
	// one preempted, and b's growth evicts everything a released.
	mustAdd(t, e, "b", seqTokens(0, 4), 28)
	first := e.Step()
	idx.apply(t, first.Events)
	if err := e.Add(Request{ID: "a", Tokens: seqTokens(500, 12), MaxTokens: 16, KVLoadedBlocks: 3}); err != nil {
		t.Fatal(err)
	}
	outs := map[string]int{"b": len(first.Outputs)}
	preempted := false
	prefillAfter := 0
	for i, res := range drain(t, e, idx) {
		if i == 0 && res.PrefillTokens != 1 {
			t.Fatalf("a's first step prefilled %d tokens, want 1 (its 3 blocks were loaded)", res.PrefillTokens)
		}
		if preempted {
			prefillAfter += res.PrefillTokens
		}
		preempted = preempted || res.Preempted > 0
		for _, o := range res.Outputs {
			if o.Index != outs[o.ID] {
				t.Fatalf("%s: output %d, want %d", o.ID, o.Index, outs[o.ID])
			}
			outs[o.ID]++
		}
	}
	if !preempted {
		t.Fatal("no preemption: the test does not exercise it")
	}
	if prefillAfter < 12 {
		t.Fatalf("the restart prefilled %d tokens: it reused the pulled KV instead of recomputing the 12-token prompt", prefillAfter)
	}
	if outs["a"] != 16 || outs["b"] != 28 {
		t.Fatalf("outputs %v", outs)
	}
}

// TestHoldAndLoadConservation runs random streams of holding, loaded and
// plain requests with random releases and aborts through small engines,
// checking after every step that every block has exactly as many references
// as holders (running or held) and that the events add up to the cache;
// once drained and released, no block is in use: each was released exactly
// once.
func TestHoldAndLoadConservation(t *testing.T) {
	for _, seed := range []uint64{1, 2, 3} {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			cfg := Config{BlockSize: 4, NumGPUBlocks: 48, MaxNumSeqs: 6, MaxNumBatchedTokens: 48, EnablePrefixCaching: true, Seed: seed}
			e := mustNew(t, cfg)
			idx := newEventIndex(cfg)
			rng := rand.New(rand.NewPCG(seed, 7))
			prefix := randTokens(rng, 40, 500)
			var held, live []string
			releases, holds := 0, 0
			for step := 0; step < 3000 || !e.Idle(); step++ {
				if step > 60000 {
					t.Fatalf("no progress: %+v", e.Metrics())
				}
				if step < 3000 && rng.IntN(3) == 0 {
					toks := slices.Concat(prefix[:rng.IntN(len(prefix))], randTokens(rng, 1+rng.IntN(30), 500))
					id := fmt.Sprint("r", step)
					r := Request{ID: id, Tokens: toks, MaxTokens: 1 + rng.IntN(20), HoldBlocks: rng.IntN(2) == 0}
					if rng.IntN(2) == 0 {
						r.KVLoadedBlocks = rng.IntN(len(toks)/cfg.BlockSize + 1)
					}
					if err := e.Add(r); err != nil {
						t.Fatal(err)
					}
					live = append(live, id)
				}
				if len(live) > 0 && rng.IntN(30) == 0 {
					i := rng.IntN(len(live))
					e.Abort(live[i])
					live = slices.Delete(live, i, i+1)
				}
				if len(held) > 0 && rng.IntN(4) == 0 {
					i := rng.IntN(len(held))
					if !e.Release(held[i]) {
						t.Fatalf("release of held %s failed", held[i])
					}
					releases++
					held = slices.Delete(held, i, i+1)
				}
				res := e.Step()
				for _, o := range res.Outputs {
					if o.Finished {
						live = slices.DeleteFunc(live, func(id string) bool { return id == o.ID })
						if e.HeldBlocks(o.ID) != nil {
							held = append(held, o.ID)
							holds++
						}
					}
				}
				idx.apply(t, res.Events)
				idx.check(t, e)
				checkEngine(t, e)
			}
			for _, id := range held {
				if !e.Release(id) || e.Release(id) {
					t.Fatalf("release of %s", id)
				}
				releases++
			}
			checkEngine(t, e)
			if m := e.Metrics(); m.ActiveBlocks != 0 || m.HeldBlocks != 0 || e.bm.numActive != 0 {
				t.Fatalf("drained and released, yet blocks are in use: %+v", m)
			}
			if holds == 0 || releases != holds || e.Metrics().Preemptions == 0 {
				t.Fatalf("%d holds, %d releases, %d preemptions: the test does not exercise them", holds, releases, e.Metrics().Preemptions)
			}
		})
	}
}
