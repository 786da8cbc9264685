package sched

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// BenchmarkPeerSelect is one committed decision of a prompt-reading peer
// policy over 8 workers: 64 conversations of 12k-token prompts sharing a
// 1k-token system prompt, each turn its conversation's prompt so far.
func BenchmarkPeerSelect(b *testing.B) {
	for _, mode := range []Mode{ModeGIEApproxPrefix, ModeSGLangCacheAware} {
		b.Run(fmt.Sprint("mode=", mode), func(b *testing.B) {
			rng := rand.New(rand.NewPCG(1, 2))
			const convs, sys, full = 64, 1024, 12 << 10
			prompts := make([][]uint32, convs)
			for c := range prompts {
				p := make([]uint32, full)
				for i := range p {
					p[i] = rng.Uint32N(32000)
					if i < sys {
						p[i] = uint32(i)
					}
				}
				prompts[c] = p
			}
			s := mustNew(b, mode, nil)
			cands := benchCands(8)
			req := &Request{BlockSize: 16, Params: DefaultParams(), Commit: true}
			turn := 0
			b.ReportAllocs()
			for b.Loop() {
				p := prompts[turn%convs]
				req.Tokens = p[:sys+(turn/convs*512)%(full-sys)]
				req.ISL = len(req.Tokens)
				if _, err := s.Select(req, cands, rng); err != nil {
					b.Fatal(err)
				}
				turn++
			}
		})
	}
}
