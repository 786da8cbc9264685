package engine

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// BenchmarkStep256Decodes: one step of 256 running requests, all decoding
// (a block fills, and is Stored, every 16 steps of each).
func BenchmarkStep256Decodes(b *testing.B) {
	const seqs, prompt, maxOut = 256, 128, 4096
	cfg := DefaultConfig()
	cfg.NumGPUBlocks = seqs * (prompt + maxOut) / cfg.BlockSize
	benchDecodeSteps(b, cfg, seqs, prompt, maxOut, 1000, nil, false)
}

// BenchmarkStepTwoDecodes512: steps of 2 requests decoding at 512-token
// blocks, the simulator's usual step on a trace at the trace's block size
// (1.4 requests a step on 8 engines), its result returned (Step) or
// written where the caller keeps it (StepTo), as the simulator does.
func BenchmarkStepTwoDecodes512(b *testing.B) {
	const seqs, prompt, maxOut = 2, 4000, 4096
	cfg := DefaultConfig()
	cfg.BlockSize = 512
	cfg.NumGPUBlocks = 64
	for _, into := range []bool{false, true} {
		b.Run(map[bool]string{false: "Step", true: "StepTo"}[into], func(b *testing.B) {
			benchDecodeSteps(b, cfg, seqs, prompt, maxOut, 10000, nil, into)
		})
	}
}

// benchDecodeSteps times single steps of seqs requests (prompts of prompt
// tokens, stride apart in token space, maxOut tokens to generate), all
// decoding; a fresh engine, set up by edit when not nil, takes over when
// the requests near their end. into steps with StepTo, into a result on
// the heap.
func benchDecodeSteps(b *testing.B, cfg Config, seqs, prompt, maxOut int, stride uint32, edit func(*Engine), into bool) {
	var e *Engine
	left := 0
	setup := func() {
		var err error
		if e, err = New(cfg); err != nil {
			b.Fatal(err)
		}
		if edit != nil {
			edit(e)
		}
		for i := range seqs {
			toks := seqTokens(uint32(i)*stride, prompt)
			if err := e.Add(Request{ID: fmt.Sprint(i), Tokens: toks, MaxTokens: maxOut}); err != nil {
				b.Fatal(err)
			}
		}
		steps := 0
		for e.Step().DecodeSeqs < seqs {
			steps++
		}
		left = maxOut - steps - 2
	}
	setup()
	res := new(StepResult)
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if left == 0 {
			b.StopTimer()
			setup()
			b.StartTimer()
		}
		if into {
			e.StepTo(res)
		} else {
			*res = e.Step()
		}
		if res.DecodeSeqs != seqs {
			b.Fatalf("%d decodes", res.DecodeSeqs)
		}
		left--
	}
}

// BenchmarkPrefill8k: Add an 8192-token prompt (unique, so the cache keeps
// evicting) and run its one prefill step to the first and only token;
// recycled hands each step's events back (Engine.Recycle), as the
// simulator does.
func BenchmarkPrefill8k(b *testing.B) {
	for _, recycle := range []bool{false, true} {
		b.Run(map[bool]string{false: "kept", true: "recycled"}[recycle], func(b *testing.B) {
			e, err := New(DefaultConfig())
			if err != nil {
				b.Fatal(err)
			}
			toks := make([]uint32, 8192)
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				for j := range toks {
					toks[j] = uint32(i*7919 + j)
				}
				if err := e.Add(Request{ID: "r", Tokens: toks, MaxTokens: 1}); err != nil {
					b.Fatal(err)
				}
				res := e.Step()
				if res.PrefillTokens != 8192 || len(res.Outputs) != 1 {
					b.Fatalf("%d prefill tokens, %d outputs", res.PrefillTokens, len(res.Outputs))
				}
				if recycle {
					e.Recycle(res.Events)
				}
			}
		})
	}
}

// BenchmarkQueuedPrompts: an overloaded engine, its waiting queue 256
// prompts of 2 K to 32 K tokens deep and growing; each op adds one more
// and runs one step, its events recycled, as the simulator does. What
// the queue holds of each request costs memory for nothing until it runs.
func BenchmarkQueuedPrompts(b *testing.B) {
	cfg := DefaultConfig()
	cfg.NumGPUBlocks = 8192
	cfg.MaxNumSeqs = 8
	e, err := New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	n := 0
	prompt := func() []uint32 {
		l := 2048 + rng.IntN(30*1024)
		toks := make([]uint32, l, l+16)
		for j := range toks {
			toks[j] = uint32(n)<<16 + uint32(j)
		}
		return toks
	}
	add := func(toks []uint32) {
		if err := e.Add(Request{ID: fmt.Sprint(n), Tokens: toks, MaxTokens: 16, Owned: true}); err != nil {
			b.Fatal(err)
		}
		n++
	}
	for range 256 {
		add(prompt())
	}
	var res StepResult
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		b.StopTimer()
		toks := prompt()
		b.StartTimer()
		add(toks)
		e.StepTo(&res)
		e.Recycle(res.Events)
	}
}
