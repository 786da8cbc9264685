package engine

import (
	"fmt"
	"testing"
)

// BenchmarkStep256Decodes: one step of 256 running requests, all decoding
// (a block fills, and is Stored, every 16 steps of each).
func BenchmarkStep256Decodes(b *testing.B) {
	const seqs, prompt, maxOut = 256, 128, 4096
	cfg := DefaultConfig()
	cfg.NumGPUBlocks = seqs * (prompt + maxOut) / cfg.BlockSize
	var e *Engine
	left := 0
	setup := func() {
		var err error
		if e, err = New(cfg); err != nil {
			b.Fatal(err)
		}
		for i := range seqs {
			toks := seqTokens(uint32(i)*1000, prompt)
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
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if left == 0 {
			b.StopTimer()
			setup()
			b.StartTimer()
		}
		res := e.Step()
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

// BenchmarkBlockMapFill fills an engine's block map from empty to 131,072
// blocks (the simulator's engines' default), through every growth.
func BenchmarkBlockMapFill(b *testing.B) {
	keys := make([]uint64, 131072)
	for i := range keys {
		keys[i] = splitmixKey(uint64(i))
	}
	b.ReportAllocs()
	for b.Loop() {
		m := newBlockMap()
		for i, k := range keys {
			m.put(k, int32(i))
		}
	}
}

func splitmixKey(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}
