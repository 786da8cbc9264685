package router

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/mocker/engine"
)

// recoverySim runs a simulated engine (the mocker's, whose cache is the
// reference) behind a router that may have missed its early events.
type recoverySim struct {
	t      *testing.T
	eng    *engine.Engine
	rng    *rand.Rand
	w      kv.Worker
	n      int
	shared int // prefixes requests draw from
}

func newRecoverySim(t *testing.T) *recoverySim {
	cfg := engine.DefaultConfig()
	cfg.NumGPUBlocks, cfg.MaxNumSeqs, cfg.MaxNumBatchedTokens = 384, 8, 2048
	eng, err := engine.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return &recoverySim{t: t, eng: eng, rng: rand.New(rand.NewPCG(7, 11)), w: kv.Worker{ID: 1}, shared: 8}
}

// run sends a wave of requests: each shares a 4-block prefix with others and
// ends with unique blocks, so the engine keeps hot prefixes and churns
// tails. With r nil the events are lost (nobody listens).
func (s *recoverySim) run(r *Router, requests int) {
	for range requests / 4 {
		var ids []string
		for range 4 {
			s.n++
			id := fmt.Sprint("req-", s.n)
			toks := tokens(s.rng.IntN(s.shared), 4, 1000+s.n, 7)
			toks = append(toks, 1, 2, 3, 4, 5)
			if r != nil {
				if _, err := r.BestWorker(context.Background(), &Request{ID: id, Tokens: toks}); err != nil {
					s.t.Fatal(err)
				}
				ids = append(ids, id)
			}
			if err := s.eng.Add(engine.Request{ID: id, Tokens: toks, MaxTokens: 20}); err != nil {
				s.t.Fatal(err)
			}
		}
		for !s.eng.Idle() {
			res := s.eng.Step()
			if r != nil {
				s.apply(r, res.Events)
			}
		}
		for _, id := range ids {
			r.Free(id)
		}
	}
}

func (s *recoverySim) apply(r *Router, events []engine.BlockEvent) {
	for _, ev := range events {
		switch ev.Kind {
		case engine.Stored:
			_ = r.ApplyEngineStored(&EngineStored{Worker: s.w, Parent: ev.Parent, EngineHashes: ev.BlockHashes, Tokens: ev.TokenIDs, BlockSize: bs})
		case engine.Removed:
			e := kv.RemovedEvent(s.w, 0, ev.BlockHashes...)
			_ = r.ApplyEvent(&e)
		}
	}
}

// engineBlocks is the engine's cache as sequence hashes (the reference).
func (s *recoverySim) engineBlocks() map[uint64]bool {
	h := blockhash.New(bs, "")
	seqOf := map[uint64]uint64{}
	out := map[uint64]bool{}
	for _, b := range s.eng.CachedBlocks() {
		seq := h.LocalHash(b.Tokens)
		if b.Parent != nil {
			seq = blockhash.Chain(seqOf[*b.Parent], seq)
		}
		seqOf[b.Hash] = seq
		out[seq] = true
	}
	return out
}

// routerBlocks is what the router's index says the worker holds.
func routerBlocks(r *Router, w kv.Worker) map[uint64]bool {
	out := map[uint64]bool{}
	for _, seq := range r.HeldBlocks(w) {
		out[seq] = true
	}
	return out
}

func diff(a, b map[uint64]bool) (onlyA, onlyB int) {
	for k := range a {
		if !b[k] {
			onlyA++
		}
	}
	for k := range b {
		if !a[k] {
			onlyB++
		}
	}
	return onlyA, onlyB
}

// A router that starts after the engine's early events are gone sees every
// new chain hang below a hot prefix it never saw stored. It must converge
// to the engine's cache from the traffic it routes, and say it is
// recovering meanwhile. The same holds for a router started with another
// block size than the engine's: it places the engine's events with the
// prompts hashed in the engine's block size.
func TestRecoveryConvergesAfterLostHistory(t *testing.T) {
	for _, routerBlockSize := range []int{bs, 4 * bs} {
		t.Run(fmt.Sprint("router-block-size-", routerBlockSize), func(t *testing.T) { testRecoveryConverges(t, routerBlockSize) })
	}
}

func testRecoveryConverges(t *testing.T, routerBlockSize int) {
	sim := newRecoverySim(t)
	sim.run(nil, 200)

	clk := &clock{t: time.Unix(1000, 0)}
	cfg := DefaultConfig()
	cfg.BlockSize = routerBlockSize
	cfg.Now = clk.now
	cfg.RecoveryWindow = 10 * time.Second
	r, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	r.AddWorker(WorkerInfo{ID: sim.w.ID})

	converged := -1
	for wave := range 60 {
		sim.run(r, 4)
		clk.advance(100 * time.Millisecond)
		onlyEngine, onlyRouter := diff(sim.engineBlocks(), routerBlocks(r, sim.w))
		if onlyRouter > 0 {
			t.Fatalf("wave %d: the router claims %d blocks the engine does not hold", wave, onlyRouter)
		}
		if onlyEngine == 0 {
			converged = wave
			break
		}
	}
	st := r.Stats().Index
	t.Logf("converged after %d waves of 4 requests; events re-anchored %d, refused %d, blocks inferred %d",
		converged+1, st.Reanchored, st.UnknownParent, st.BlocksInferred)
	if converged < 0 {
		onlyEngine, _ := diff(sim.engineBlocks(), routerBlocks(r, sim.w))
		t.Fatalf("router still misses %d of the engine's %d blocks after 240 requests (unknown_parent %d)",
			onlyEngine, len(sim.engineBlocks()), st.UnknownParent)
	}
	rec := r.Recovering()
	if len(rec) != 1 || rec[0].Worker != sim.w || rec[0].Reanchored == 0 {
		t.Fatalf("Recovering() = %+v, want worker %v re-anchoring", rec, sim.w)
	}

	// Once anchored, events name known parents: the index follows the
	// engine exactly, and the episode ends after the window.
	for wave := range 20 {
		sim.run(r, 4)
		clk.advance(time.Second)
		if onlyEngine, onlyRouter := diff(sim.engineBlocks(), routerBlocks(r, sim.w)); onlyEngine+onlyRouter > 0 {
			t.Fatalf("wave %d after convergence: engine-only %d, router-only %d blocks", wave, onlyEngine, onlyRouter)
		}
	}
	if rec := r.Recovering(); len(rec) != 0 {
		t.Fatalf("Recovering() = %+v after the window, want none", rec)
	}
}
