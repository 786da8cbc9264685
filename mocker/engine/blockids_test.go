package engine

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/blockhash"
)

// Every step's duration is StepTime at its KV usage, divided by the
// engine's speed, although the decode part is reused while the blocks
// held stay the same.
func TestReusedDecodeTimeMatchesStepTime(t *testing.T) {
	for _, speed := range []float64{1, 0.7} {
		cfg := Config{BlockSize: 4, NumGPUBlocks: 64, MaxNumSeqs: 8, MaxNumBatchedTokens: 64, EnablePrefixCaching: true, Seed: 3, Speed: speed}
		a, b := mustNew(t, cfg), mustNew(t, cfg)
		reused := 0
		stepTwins(t, a, b, 5, func(step int, r, _ StepResult) {
			want := StepTime(r.PrefillTokens, r.DecodeSeqs, r.KVUsage)
			if speed != 1 {
				want = time.Duration(math.Round(float64(want) / speed))
			}
			if r.Duration != want && !r.LoadWait {
				t.Fatalf("speed %v, step %d: duration %v, want %v", speed, step, r.Duration, want)
			}
			if r.DecodeSeqs > 0 && a.decodeUsed == a.bm.used() {
				reused++
			}
		})
		if reused == 0 {
			t.Fatal("no step decoded")
		}
	}
}

// BenchmarkStepDecodes512: steps of 32 requests decoding at 512-token
// blocks, the simulator's trace runs at the trace's own block size, with
// the requests that hold their blocks skipping allocate (holds) and
// without.
func BenchmarkStepDecodes512(b *testing.B) {
	const seqs, prompt, maxOut = 32, 4000, 4096
	cfg := DefaultConfig()
	cfg.BlockSize = 512
	cfg.NumGPUBlocks = seqs * (prompt + maxOut) / cfg.BlockSize * 2
	for _, all := range []bool{false, true} {
		b.Run(map[bool]string{false: "holds", true: "allocate"}[all], func(b *testing.B) {
			benchDecodeSteps(b, cfg, seqs, prompt, maxOut, 10000, func(e *Engine) { e.bm.allocateAll = all }, false)
		})
	}
}

// BenchmarkAddBlockIDs: Add and prefill a prompt of 16 blocks of 512
// tokens whose blocks are cached, on an engine of sequence-hash ids,
// hashing them (own) or taking their hashes (supplied).
func BenchmarkAddBlockIDs(b *testing.B) {
	cfg := DefaultConfig()
	cfg.BlockSize = 512
	cfg.NumGPUBlocks = 256
	cfg.SequenceHashIDs = true
	toks := append(make([]uint32, 0, 16*512+101), seqTokens(7, 16*512+100)...)
	local, seq := blockhash.New(cfg.BlockSize, "").Hashes(toks)
	for _, supplied := range []bool{false, true} {
		b.Run(map[bool]string{false: "own", true: "supplied"}[supplied], func(b *testing.B) {
			e, err := New(cfg)
			if err != nil {
				b.Fatal(err)
			}
			r := Request{ID: "r", Tokens: toks, MaxTokens: 1, Owned: true}
			if supplied {
				r.BlockIDs, r.LocalHashes = seq, local
			}
			b.ReportAllocs()
			for b.Loop() {
				if err := e.Add(r); err != nil {
					b.Fatal(err)
				}
				for !e.Idle() {
					e.Step()
				}
			}
		})
	}
}

// Every Stored event names the request whose blocks it stores (Tag) and
// where they start among its blocks (First): the event's tokens are that
// request's, prompt and generated, from that block on; through
// preemptions on a small cache.
func TestStoredEventsNameTheirRequest(t *testing.T) {
	const bs = 4
	e := mustNew(t, Config{BlockSize: bs, NumGPUBlocks: 24, MaxNumSeqs: 8, MaxNumBatchedTokens: 64, EnablePrefixCaching: true, Seed: 5})
	rng := rand.New(rand.NewPCG(13, 14))
	seqs := map[int32][]uint32{}
	stored := 0
	for step := 0; step < 3000; step++ {
		if step < 400 && rng.IntN(4) == 0 {
			tag := int32(len(seqs) + 1)
			toks := randTokens(rng, 5+rng.IntN(30), 50)
			seqs[tag] = slices.Clone(toks)
			if err := e.Add(Request{ID: fmt.Sprint(tag), Tokens: toks, MaxTokens: 1 + rng.IntN(30), Tag: tag}); err != nil {
				t.Fatal(err)
			}
		}
		res := e.Step()
		for _, ev := range res.Events {
			if ev.Kind != Stored {
				continue
			}
			stored++
			toks, ok := seqs[ev.Tag]
			from := int(ev.First) * bs
			if !ok || from+len(ev.TokenIDs) > len(toks) || !slices.Equal(ev.TokenIDs, toks[from:from+len(ev.TokenIDs)]) {
				t.Fatalf("step %d: event of %d blocks names request %d from block %d, whose tokens differ", step, len(ev.BlockHashes), ev.Tag, ev.First)
			}
		}
		for _, o := range res.Outputs {
			if !o.Finished {
				seqs[o.Tag] = append(seqs[o.Tag], o.Token)
			}
		}
		if step > 400 && e.Idle() {
			break
		}
	}
	if stored == 0 || e.Metrics().Preemptions == 0 {
		t.Fatalf("%d stored events, %d preemptions", stored, e.Metrics().Preemptions)
	}
}

// Steps that skip allocate for requests holding their blocks already
// (holds) are the steps of an engine that allocates for every request,
// with a host tier, with caching off, through preemptions; and holds is
// never true where allocate would change something.
func TestHoldsSkipsOnlyWhatAllocateLeaves(t *testing.T) {
	for _, cfg := range []Config{
		{BlockSize: 4, NumGPUBlocks: 64, MaxNumSeqs: 8, MaxNumBatchedTokens: 64, EnablePrefixCaching: true, Seed: 3},
		{BlockSize: 4, NumGPUBlocks: 56, MaxNumSeqs: 16, MaxNumBatchedTokens: 64, EnablePrefixCaching: true, Seed: 3},
		{BlockSize: 4, NumGPUBlocks: 64, NumCPUBlocks: 48, MaxNumSeqs: 8, MaxNumBatchedTokens: 64, EnablePrefixCaching: true, Seed: 3},
		{BlockSize: 4, NumGPUBlocks: 64, MaxNumSeqs: 8, MaxNumBatchedTokens: 64, Seed: 3},
	} {
		a, b := mustNew(t, cfg), mustNew(t, cfg)
		b.bm.allocateAll = true
		held := 0
		stepTwins(t, a, b, 17, func(int, StepResult, StepResult) {
			for _, s := range a.running {
				upTo := s.numTokens()
				if !a.bm.holds(&s.seqBlocks, upTo) {
					continue
				}
				held++
				before := *a.bm
				blocks, partial := len(s.blocks), s.partial
				if !a.bm.allocate(&s.seqBlocks, upTo) || len(s.blocks) != blocks || s.partial != partial ||
					a.bm.numActive != before.numActive || a.bm.numPartial != before.numPartial || len(a.bm.events) != len(before.events) {
					t.Fatalf("holds(%d tokens) with %d blocks (partial %v), but allocate changed them", upTo, blocks, partial)
				}
			}
		})
		if held == 0 && cfg.EnablePrefixCaching {
			t.Fatal("no request held its blocks")
		}
		if m := a.Metrics(); cfg.NumGPUBlocks == 56 && m.Preemptions == 0 {
			t.Fatal("no preemption")
		}
	}
}
