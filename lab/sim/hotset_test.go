package sim

import (
	"math/rand/v2"
	"strconv"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/lab/workload"
	"github.com/kvrouter/kvrouter/mocker/engine"
)

// hotSet is a hot set of conversations on two engines, the mocker's size:
// convs conversations of history tokens are cached on the first engine
// only, then clients closed-loop sessions each continue them, request
// after request, with 16 new tokens and 32 output tokens.
type hotSet struct {
	convs, history, clients, turns int
}

func (h hotSet) workload() (Requests, [][]uint32) {
	rng := rand.New(rand.NewPCG(29, 1))
	random := func(n int) []uint32 {
		out := make([]uint32, n)
		for i := range out {
			out[i] = uint32(rng.IntN(128000))
		}
		return out
	}
	histories := make([][]uint32, h.convs)
	for c := range histories {
		histories[c] = random(h.history)
	}
	var reqs Requests
	for c := range h.clients {
		for k := range h.turns {
			toks := append(append([]uint32(nil), histories[(c+k)%h.convs]...), random(16)...)
			r := workload.Request{Tokens: toks, OSL: 32, Session: "client-" + strconv.Itoa(c)}
			if k > 0 {
				r.Think = time.Microsecond // the client sends again once answered
			}
			reqs = append(reqs, r)
		}
	}
	return reqs, histories
}

// run simulates the hot set in mode and returns what it measured and the
// requests each engine served.
func (h hotSet) run(t *testing.T, mode string) (Point, [2]uint64) {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Workers = 2
	cfg.Engine = engine.DefaultConfig()
	reqs, histories := h.workload()
	s, err := newSim(cfg, mode, reqs, 1)
	if err != nil {
		t.Fatal(err)
	}
	// The first engine prefills every history before the clients start;
	// the router learns it from the engine's KV events.
	warm := &s.engines[0]
	for c, toks := range histories {
		if err := warm.eng.Add(engine.Request{ID: "warm-" + strconv.Itoa(c), Tokens: toks, MaxTokens: 1}); err != nil {
			t.Fatal(err)
		}
	}
	for steps := 0; !warm.eng.Idle(); steps++ {
		if steps > 1000 {
			t.Fatal("the warm-up does not finish")
		}
		res := warm.eng.Step()
		s.applyKV(warm, res.Events)
	}
	if err := s.run(); err != nil {
		t.Fatal(err)
	}
	p := s.point()
	served := [2]uint64{s.engines[0].eng.Metrics().RequestsFinished - uint64(h.convs), s.engines[1].eng.Metrics().RequestsFinished}
	if p.Errors > 0 || served[0]+served[1] != uint64(len(reqs)) {
		t.Fatalf("%s: %d errors (%s), served %v of %d", mode, p.Errors, p.FirstError, served, len(reqs))
	}
	return p, served
}

// Eight conversations of 4,000 tokens cached on one of two engines, twelve
// clients continuing them with 16 new tokens each. Every request on the
// first engine prefills only its turn, but all of them decode there, on an
// engine reading every conversation's KV at each step, while the second
// idles. The second engine must get a fair share, and time to first token
// must be no worse than Dynamo's cost (no cache affinity), which splits.
func TestHotSetDoesNotStarveAnIdleEngine(t *testing.T) {
	for _, clients := range []int{12, 48} {
		h := hotSet{convs: 8, history: 4000, clients: clients, turns: 40}
		kv, kvServed := h.run(t, "kv")
		dyn, dynServed := h.run(t, "dynamo-kv")
		t.Logf("%d clients, kv: served %v, TTFT p50 %.1f p90 %.1f ms, hit rate %.3f, %.1f s", clients, kvServed, kv.TTFT.P50, kv.TTFT.P90, kv.HitRate, kv.ModelS)
		t.Logf("%d clients, dynamo-kv: served %v, TTFT p50 %.1f p90 %.1f ms, hit rate %.3f, %.1f s", clients, dynServed, dyn.TTFT.P50, dyn.TTFT.P90, dyn.HitRate, dyn.ModelS)
		if share := float64(kvServed[1]) / float64(kvServed[0]+kvServed[1]); share < 1.0/3 {
			t.Errorf("%d clients, kv: the idle engine served %.0f %% of the requests (%v)", clients, 100*share, kvServed)
		}
		if kv.TTFT.P50 > dyn.TTFT.P50 {
			t.Errorf("%d clients, kv: TTFT p50 %.1f ms, Dynamo's cost %.1f ms", clients, kv.TTFT.P50, dyn.TTFT.P50)
		}
	}
}
