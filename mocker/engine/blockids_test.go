package engine

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"reflect"
	"slices"
	"testing"
	"time"
)

// chainIDs is the reference for Request.BlockIDs: BlockID over the
// prompt's first n full blocks.
func chainIDs(seed uint64, bs int, toks []uint32, n int) []uint64 {
	ids := make([]uint64, n)
	var parent uint64
	for i := range ids {
		parent = BlockID(seed, parent, toks[i*bs:(i+1)*bs])
		ids[i] = parent
	}
	return ids
}

// An engine handed its prompts' block ids steps exactly as one that hashes
// them itself (every output, event, duration), whether it gets all of a
// prompt's ids or the first few; and a wrong id shows in its events, so
// the comparison would see ids it took without checking.
func TestSuppliedBlockIDsChangeNothing(t *testing.T) {
	for _, cpu := range []int{0, 48} {
		cfg := Config{BlockSize: 4, NumGPUBlocks: 64, NumCPUBlocks: cpu, MaxNumSeqs: 8, MaxNumBatchedTokens: 64, EnablePrefixCaching: true, Seed: 3}
		for _, wrong := range []bool{false, true} {
			a, b := mustNew(t, cfg), mustNew(t, cfg)
			rng := rand.New(rand.NewPCG(21+uint64(cpu), 0))
			prefix := randTokens(rng, 120, 500)
			differ := false
			for step := 0; step < 600 || !a.Idle() || !b.Idle(); step++ {
				if step > 5000 {
					t.Fatal("engines never idle")
				}
				if step < 600 && rng.IntN(3) == 0 {
					toks := slices.Concat(prefix[:rng.IntN(120)], randTokens(rng, 1+rng.IntN(60), 500))
					n := 1 + rng.IntN(30)
					ids := chainIDs(cfg.Seed, cfg.BlockSize, toks, rng.IntN(len(toks)/cfg.BlockSize+1))
					if wrong && len(ids) > 0 {
						ids[len(ids)-1]++
					}
					id := fmt.Sprint(step)
					if err := a.Add(Request{ID: id, Tokens: slices.Clone(toks), MaxTokens: n, BlockIDs: ids}); err != nil {
						t.Fatal(err)
					}
					mustAdd(t, b, id, toks, n)
				}
				if ra, rb := a.Step(), b.Step(); !reflect.DeepEqual(ra, rb) {
					if !wrong {
						t.Fatalf("cpu %d, step %d: supplied block ids changed the step", cpu, step)
					}
					differ = true
				}
			}
			if wrong && !differ {
				t.Fatalf("cpu %d: wrong block ids changed nothing", cpu)
			}
		}
	}
}

func TestBlockIDsValidation(t *testing.T) {
	e := mustNew(t, Config{BlockSize: 4, NumGPUBlocks: 64, MaxNumSeqs: 8, MaxNumBatchedTokens: 64, EnablePrefixCaching: true})
	toks := seqTokens(0, 9) // two full blocks
	for _, r := range []Request{
		{ID: "long", Tokens: toks, MaxTokens: 1, BlockIDs: make([]uint64, 3)},
		{ID: "salt", Tokens: toks, MaxTokens: 1, BlockIDs: make([]uint64, 1), CacheSalt: "s"},
		{ID: "lora", Tokens: toks, MaxTokens: 1, BlockIDs: make([]uint64, 1), LoRA: "a"},
	} {
		if err := e.Add(r); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: %v, want ErrInvalid", r.ID, err)
		}
	}
	if err := e.Add(Request{ID: "ok", Tokens: toks, MaxTokens: 1, BlockIDs: chainIDs(0, 4, toks, 2)}); err != nil {
		t.Fatal(err)
	}
}

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
// tokens whose blocks are cached, hashing them (own) or taking their ids
// (supplied).
func BenchmarkAddBlockIDs(b *testing.B) {
	cfg := DefaultConfig()
	cfg.BlockSize = 512
	cfg.NumGPUBlocks = 256
	toks := append(make([]uint32, 0, 16*512+101), seqTokens(7, 16*512+100)...)
	ids := chainIDs(cfg.Seed, cfg.BlockSize, toks, 16)
	for _, supplied := range []bool{false, true} {
		b.Run(map[bool]string{false: "own", true: "supplied"}[supplied], func(b *testing.B) {
			e, err := New(cfg)
			if err != nil {
				b.Fatal(err)
			}
			r := Request{ID: "r", Tokens: toks, MaxTokens: 1, Owned: true}
			if supplied {
				r.BlockIDs = ids
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
