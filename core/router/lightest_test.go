package router

import (
	"fmt"
	"math/rand/v2"
	"strconv"
	"testing"

	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/sched"
)

// The summary candidates takes while it fills them is sched.LightestOf
// of what it returns, on fleets of mixed roles and models under random
// loads and filters, and decide hands it to the scheduler only for those
// candidates.
func TestCandidatesSummariseTheirLightest(t *testing.T) {
	for seed := range uint64(12) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(seed, 35))
			r, _ := newRouter(t, 0, func(cfg *Config) { cfg.Rand = rand.New(rand.NewPCG(seed, 8)) })
			engines := 1 + rng.IntN(12)
			for id := range uint64(engines) {
				info := WorkerInfo{ID: id, DPSize: 1 + rng.IntN(3), TotalKVBlocks: 1024 + rng.IntN(16384), MaxNumBatchedTokens: 8192}
				if rng.IntN(4) == 0 {
					info.Role = RolePrefill
				}
				if rng.IntN(4) == 0 {
					info.Model = "m" + strconv.Itoa(rng.IntN(2))
				}
				r.AddWorker(info)
			}
			var booked []string
			for step := range 300 {
				toks := tokens(rng.IntN(3), rng.IntN(20), 1000+step, 1+rng.IntN(40))
				req := &Request{ID: fmt.Sprint("q", step), Tokens: toks, Model: []string{"", "m0", "m1"}[rng.IntN(3)], Prefill: rng.IntN(5) == 0}
				switch rng.IntN(6) {
				case 0:
					req.Exclude = []uint64{uint64(rng.IntN(engines))}
				case 1:
					req.Only = []uint64{uint64(rng.IntN(engines)), uint64(rng.IntN(engines))}
				}
				if rng.IntN(3) == 0 {
					store(t, r, kv.Worker{ID: uint64(rng.IntN(engines))}, toks)
				}
				p, err := r.prepare(req)
				if err != nil {
					t.Fatal(err)
				}
				sc := r.scratch.Get().(*scratch)
				r.match(p, sc, p.arrival)
				cands := r.candidates(p, sc)
				if sc.lightestOK != (len(cands) > 0) {
					t.Fatalf("step %d: summary kept %v for %d candidates", step, sc.lightestOK, len(cands))
				}
				if want := sched.LightestOf(cands); len(cands) > 0 && sc.lightest != want {
					t.Fatalf("step %d: summary %+v, want %+v", step, sc.lightest, want)
				}
				r.scratch.Put(sc)
				release(p)
				if _, err := r.BestWorker(ctx(), req); err == nil {
					booked = append(booked, req.ID)
				}
				if len(booked) > 20 {
					r.Free(booked[0])
					booked = booked[1:]
				}
			}
		})
	}
}
