package router

import (
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/index"
	"github.com/kvrouter/kvrouter/core/kv"
)

// seen checks the overlap the router sees on worker wk for each prompt,
// whatever the source: events or predictions.
func seen(wk uint64, overlaps map[*[]uint32]int) evStep {
	return evStep{"seen", func(s *evSim) {
		s.t.Helper()
		for toks, n := range overlaps {
			for _, l := range s.r.PotentialLoads(*toks, "") {
				if l.Worker == (kv.Worker{ID: wk}) && l.OverlapBlocks != n {
					s.t.Fatalf("worker %d: overlap %d with a %d-block prompt, want %d", wk, l.OverlapBlocks, len(*toks)/bs, n)
				}
			}
		}
	}}
}

// Predict-on-route bridges a decision until the engine's events can have
// answered it, and no longer: after that the events are the only truth.
func TestPredictionLastsUntilEventsCanConfirm(t *testing.T) {
	A, B := &promptA, &promptB
	ttl := DefaultPredictedTTL
	cases := []struct {
		name  string
		steps []evStep
	}{
		{"predicted from the decision, through a prefill longer than the window", []evStep{
			stored(1, promptB), bookOn("a", 1, promptA), seen(1, map[*[]uint32]int{A: 6, B: 4}),
			advance(ttl - time.Millisecond), seen(1, map[*[]uint32]int{A: 6}),
		}},
		{"a prefill that outlasts the TTL loses its prediction", []evStep{
			stored(1, promptB), bookOn("a", 1, promptA), advance(ttl), seen(1, map[*[]uint32]int{A: 0, B: 4}),
		}},
		{"after the prefill, the window, then only what the events stored", []evStep{
			stored(1, promptB), bookOn("a", 1, promptA), advance(5 * time.Second), prefilled("a"),
			advance(predictionConfirmWindow - time.Millisecond), seen(1, map[*[]uint32]int{A: 6}),
			advance(time.Millisecond), seen(1, map[*[]uint32]int{A: 0, B: 4}),
		}},
		{"confirmed by the events: the exact index carries on", []evStep{
			stored(1, promptB), bookOn("a", 1, promptA), prefilled("a"), stored(1, promptA),
			advance(time.Hour), seen(1, map[*[]uint32]int{A: 6, B: 4}),
		}},
		{"a request freed before its prefill: the window, then nothing", []evStep{
			stored(1, promptB), bookOn("a", 1, promptA), freed("a"),
			advance(predictionConfirmWindow), seen(1, map[*[]uint32]int{A: 0}),
		}},
		{"a later decision on the same prompt predicts it again", []evStep{
			stored(1, promptB), bookOn("a", 1, promptA), prefilled("a"), advance(predictionConfirmWindow),
			seen(1, map[*[]uint32]int{A: 0}),
			bookOn("a2", 1, promptA), seen(1, map[*[]uint32]int{A: 6}),
		}},
		{"an engine that leaves takes its predictions", []evStep{
			stored(1, promptB), bookOn("a", 1, promptA), reregister(1), seen(1, map[*[]uint32]int{A: 0, B: 0}),
			prefilled("a"), advance(time.Hour), seen(1, map[*[]uint32]int{A: 0}),
		}},
		{"only the chosen worker is predicted", []evStep{
			stored(0, promptB), stored(1, promptB), bookOn("a", 1, promptA), seen(0, map[*[]uint32]int{A: 0, B: 4}),
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r, c := newRouter(t, 2, nil)
			s := &evSim{t: t, r: r, c: c, exact: map[uint64]map[uint64]bool{}}
			for i, st := range tc.steps {
				t.Logf("step %d: %s", i, st.name)
				st.do(s)
			}
		})
	}
}

// The predicted lookup skips the depth every rank holds by its events
// (heldByEvery): over random fleets, caches and bookings, every overlap
// the router sees and every decision it makes are those of a router that
// looks every prediction up.
func TestPredictedSkipLeavesDecisionsUnchanged(t *testing.T) {
	skipped := 0
	for seed := range uint64(16) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(seed, 34))
			var ranks []kv.Worker
			var infos []WorkerInfo
			for id := range uint64(1 + rng.IntN(9)) {
				info := WorkerInfo{ID: id, DPSize: 1 + rng.IntN(2), TotalKVBlocks: 16384, MaxNumBatchedTokens: 8192}
				infos = append(infos, info)
				for rank := range info.DPSize {
					ranks = append(ranks, kv.Worker{ID: id, DPRank: uint32(rank)})
				}
			}
			build := func(every bool) (*Router, *clock) {
				r, c := newRouter(t, 0, func(cfg *Config) { cfg.Rand = rand.New(rand.NewPCG(seed, 7)) })
				r.predictEveryDepth = every
				for _, info := range infos {
					r.AddWorker(info)
				}
				return r, c
			}
			skip, cs := build(false)
			every, ce := build(true)
			system := 1 + rng.IntN(20)
			// A prompt: the system prompt, one of a few conversations, then
			// its own blocks.
			prompt := func() []uint32 {
				conv, own, salt := rng.IntN(6), rng.IntN(30), rng.IntN(1<<20)
				var toks []uint32
				for b := range system + 10 + own {
					src := 1
					switch {
					case b >= system+10:
						src = 1000 + salt
					case b >= system:
						src = 10 + conv
					}
					for i := range bs {
						toks = append(toks, uint32(src*100003+b*bs+i))
					}
				}
				return toks[:len(toks)-rng.IntN(bs)]
			}
			for _, w := range ranks {
				if rng.IntN(8) != 0 {
					toks := prompt()
					for _, r := range []*Router{skip, every} {
						store(t, r, w, toks[:system*bs])
					}
				}
			}
			var booked []string
			for step := range 600 {
				switch op := rng.IntN(100); {
				case op < 15:
					w, toks := ranks[rng.IntN(len(ranks))], prompt()
					toks = toks[:bs*rng.IntN(len(toks)/bs+1)]
					if len(toks) > 0 {
						for _, r := range []*Router{skip, every} {
							store(t, r, w, toks)
						}
					}
				case op < 60:
					toks, id := prompt(), fmt.Sprint("q", step)
					want := every.PotentialLoads(toks, "")
					if got := skip.PotentialLoads(toks, ""); !reflect.DeepEqual(got, want) {
						t.Fatalf("step %d: loads %+v, want %+v", step, got, want)
					}
					if depthOf(skip, toks) > 0 {
						skipped++
					}
					got, err1 := route(skip, id, toks)
					want2, err2 := route(every, id, toks)
					if err1 != nil || err2 != nil {
						t.Fatalf("step %d: %v, %v", step, err1, err2)
					}
					if got.Worker != want2.Worker || got.OverlapBlocks != want2.OverlapBlocks {
						t.Fatalf("step %d: routed to %v with %d blocks, want %v with %d", step, got.Worker, got.OverlapBlocks, want2.Worker, want2.OverlapBlocks)
					}
					booked = append(booked, id)
				case op < 75 && len(booked) > 0:
					id := booked[rng.IntN(len(booked))]
					skip.MarkPrefillCompleted(id)
					every.MarkPrefillCompleted(id)
				case op < 85 && len(booked) > 0:
					i := rng.IntN(len(booked))
					skip.Free(booked[i])
					every.Free(booked[i])
					booked = slices.Delete(booked, i, i+1)
				default:
					d := time.Duration(rng.IntN(1500)) * time.Millisecond
					cs.advance(d)
					ce.advance(d)
				}
			}
		})
	}
	if skipped == 0 {
		t.Fatal("no lookup skipped anything: the test exercises nothing")
	}
}

// depthOf is the depth every rank of r holds of toks by its events.
func depthOf(r *Router, toks []uint32) int {
	seq := blockhash.SequenceHashes(blockhash.New(bs, "").LocalHashes(toks))
	var m index.Matcher
	return r.heldByEvery(&prepared{overlaps: r.exact.FindMatches(&m, seq)}, &scratch{})
}
