package load

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/kv"
)

// A known step-time model: two workers, the second twice as fast, whose
// time to first token is a fixed cost, a cost per prompt token waiting or
// new, a smaller one per cached token and one per running request, with
// 5 % noise. The fit finds each worker's rate within 10 %.
func TestPrefillModelFitsAKnownStepTime(t *testing.T) {
	m := NewPrefillModel()
	rng := rand.New(rand.NewPCG(7, 8))
	slow, fast := kv.Worker{ID: 1}, kv.Worker{ID: 2}
	perToken := map[kv.Worker]float64{slow: 100e-6, fast: 50e-6} // s/token: 10,000 and 20,000 tokens/s
	now := time.Unix(0, 0)
	for i := range 400 {
		for _, w := range []kv.Worker{slow, fast} {
			s := PrefillSample{Uncached: 100 + rng.IntN(4000), Cached: rng.IntN(8000), Waiting: rng.IntN(6000), Running: rng.IntN(32)}
			b := perToken[w]
			ttft := 0.02 + b*float64(s.Uncached+s.Waiting) + b/20*float64(s.Cached) + 0.001*float64(s.Running)
			ttft *= 1 + 0.05*(2*rng.Float64()-1)
			id := string(rune('a'+w.ID)) + time.Duration(i).String()
			m.Start(id, w, now, s)
			if !m.Done(id, now.Add(time.Duration(ttft*float64(time.Second)))) {
				t.Fatal("first token of a started request unknown")
			}
			now = now.Add(time.Second)
		}
	}
	fits := m.Fits()
	if len(fits) != 2 || fits[0].Worker != slow {
		t.Fatalf("fits %+v", fits)
	}
	for _, f := range fits {
		want := 1 / perToken[f.Worker]
		if math.Abs(f.TokensPerSecond-want) > 0.1*want {
			t.Errorf("worker %d: learned %.0f tokens/s, want %.0f ± 10 %%", f.Worker.ID, f.TokensPerSecond, want)
		}
	}
	es, ef := m.Estimate(slow, now, 0, 0), m.Estimate(fast, now, 0, 0)
	if !es.Fitted || !ef.Fitted || math.Abs(es.SecondsPerToken/ef.SecondsPerToken-2) > 0.2 {
		t.Errorf("slow %+v, fast %+v: want the slow worker's token twice as dear", es, ef)
	}
}

// The backlog is the pending predictions, the oldest's decaying from when
// it became the oldest; an unfitted worker borrows the fitted ones' mean.
func TestPrefillBacklogDecaysTheOldest(t *testing.T) {
	m := NewPrefillModel()
	w, other := kv.Worker{ID: 1}, kv.Worker{ID: 2}
	t0 := time.Unix(100, 0)
	if e := m.Estimate(w, t0, 0, 0); e.Known {
		t.Fatalf("estimate before any sample: %+v", e)
	}
	// Train: exactly 1 ms per token, nothing else.
	for i := range 50 {
		s := PrefillSample{Uncached: 1000 + 37*i}
		id := "train" + time.Duration(i).String()
		m.Start(id, w, t0, s)
		m.Done(id, t0.Add(time.Duration(s.Uncached)*time.Millisecond))
	}
	e := m.Estimate(w, t0, 0, 0)
	if math.Abs(e.SecondsPerToken-1e-3) > 1e-5 || math.Abs(e.Fixed) > 1e-3 || e.Backlog != 0 {
		t.Fatalf("fit %+v", e)
	}
	m.Start("a", w, t0, PrefillSample{Uncached: 2000})                  // 2 s
	m.Start("b", w, t0.Add(time.Second), PrefillSample{Uncached: 3000}) // 3 s
	if got := m.Estimate(w, t0.Add(1500*time.Millisecond), 0, 0).Backlog; math.Abs(got-3.5) > 0.01 {
		t.Errorf("backlog 1.5 s in: %v s, want 0.5 + 3", got)
	}
	if got := m.Estimate(w, t0.Add(10*time.Second), 0, 0).Backlog; math.Abs(got-3) > 0.01 {
		t.Errorf("overdue oldest: backlog %v s, want 3 (the oldest's at 0, not below)", got)
	}
	m.Done("a", t0.Add(2*time.Second))
	if got := m.Estimate(w, t0.Add(3*time.Second), 0, 0).Backlog; math.Abs(got-2) > 0.01 {
		t.Errorf("next oldest 1 s after it became the oldest: %v s, want 2", got)
	}
	m.Drop("b", t0.Add(3*time.Second))
	if got := m.Estimate(w, t0.Add(3*time.Second), 0, 0); got.Backlog != 0 {
		t.Errorf("dropped: %+v", got)
	}
	if got := m.Estimate(other, t0, 0, 0); !got.Known || got.Fitted || math.Abs(got.SecondsPerToken-1e-3) > 1e-5 {
		t.Errorf("unfitted worker's estimate %+v, want the fleet's fit", got)
	}
	m.Start("c", w, t0, PrefillSample{Uncached: 10})
	m.RemoveWorker(w)
	if m.Done("c", t0) {
		t.Error("a removed worker's request still pending")
	}
}

// The backlog counts a pending request's uncached tokens at the learned
// rate, not its step's fixed cost nor the batch it ran beside: prompts
// queued together share those.
func TestPrefillBacklogLeavesOutFixedCosts(t *testing.T) {
	m := NewPrefillModel()
	w := kv.Worker{ID: 1}
	t0 := time.Unix(100, 0)
	// Train: 200 ms a prefill, 1 ms per token, 10 ms per running request.
	for i := range 60 {
		s := PrefillSample{Uncached: 1000 + 37*i, Running: i % 5}
		id := "train" + time.Duration(i).String()
		m.Start(id, w, t0, s)
		m.Done(id, t0.Add(time.Duration(200+s.Uncached+10*s.Running)*time.Millisecond))
	}
	if e := m.Estimate(w, t0, 0, 4); math.Abs(e.Fixed-0.24) > 0.005 {
		t.Fatalf("fit %+v, want fixed 0.24 s", e)
	}
	m.Start("a", w, t0, PrefillSample{Uncached: 2000, Running: 4})
	m.Start("b", w, t0, PrefillSample{Uncached: 3000, Running: 4})
	if got := m.Estimate(w, t0, 0, 4).Backlog; math.Abs(got-5) > 0.01 {
		t.Errorf("backlog %v s, want 2 + 3 (their tokens at 1 ms each)", got)
	}
}

// An unfitted worker's borrowed fit is the same at every call: the fitted
// workers' fits are summed in one order, so a float sum's rounding cannot
// move a decision from one run to the next.
func TestBorrowedFitIsTheSameAtEveryCall(t *testing.T) {
	m := NewPrefillModel()
	rng := rand.New(rand.NewPCG(9, 10))
	now := time.Unix(0, 0)
	for id := range uint64(12) {
		w := kv.Worker{ID: id}
		perToken := (1 + rng.Float64()) * 1e-4 / 3 // thirds: sums whose rounding depends on their order
		for i := range 3 * minFitSamples {
			s := PrefillSample{Uncached: 100 + rng.IntN(4000), Cached: rng.IntN(4000), Running: rng.IntN(8)}
			ttft := 0.01/3 + perToken*float64(s.Uncached) + perToken/7*float64(s.Cached) + 0.001/3*float64(s.Running)
			req := fmt.Sprint(id, "-", i)
			m.Start(req, w, now, s)
			m.Done(req, now.Add(time.Duration(ttft*float64(time.Second))))
			now = now.Add(time.Second)
		}
	}
	unfitted := kv.Worker{ID: 99}
	first := m.Estimate(unfitted, now, 1000, 3)
	if !first.Known || first.Fitted {
		t.Fatalf("estimate %+v: want a borrowed fit", first)
	}
	for range 200 {
		if e := m.Estimate(unfitted, now, 1000, 3); e != first {
			t.Fatalf("borrowed fit %+v, then %+v", first, e)
		}
	}
}
