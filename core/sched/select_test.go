package sched

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/core/kv"
)

// costOnly makes Cost equal PotentialDecodeBlocks, so tests can state
// costs directly.
var costOnly = Params{PrefillLoadScale: 0}

func withCosts(costs ...float64) []Candidate {
	out := make([]Candidate, len(costs))
	for i, c := range costs {
		out[i] = Candidate{Worker: worker(uint64(i + 1)), PotentialDecodeBlocks: c}
	}
	return out
}

func mustNew(t testing.TB, m Mode, s *Sessions) *Scheduler {
	t.Helper()
	sc, err := New(m, s)
	if err != nil {
		t.Fatal(err)
	}
	return sc
}

func counts(t *testing.T, s *Scheduler, req *Request, cands []Candidate, rng Rand, n int) []int {
	t.Helper()
	got := make([]int, len(cands))
	for range n {
		c, err := s.Select(req, cands, rng)
		if err != nil {
			t.Fatal(err)
		}
		got[c.Index]++
	}
	return got
}

func TestTemperatureZeroPicksMin(t *testing.T) {
	s := mustNew(t, ModeKV, nil)
	rng := rand.New(rand.NewPCG(3, 4))
	for trial := range 200 {
		costs := make([]float64, 1+rng.IntN(50))
		for i := range costs {
			costs[i] = float64(rng.IntN(1000))
		}
		want := 0
		for i, c := range costs {
			if c < costs[want] {
				want = i
			}
		}
		// Make the minimum unique so the answer is deterministic.
		costs[want] -= 0.5
		c, err := s.Select(&Request{BlockSize: 16, Params: costOnly}, withCosts(costs...), rng)
		if err != nil {
			t.Fatal(err)
		}
		if c.Index != want {
			t.Fatalf("trial %d: chose %d (cost %v), want %d (cost %v)", trial, c.Index, costs[c.Index], want, costs[want])
		}
	}
}

// kv mode's inline search chooses as pickMin over Cost does, draw for draw,
// with every cost term in play and with ties.
func TestKVPickMatchesPickMinOverCost(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	p := DefaultParams()
	for trial := range 2000 {
		cands := make([]Candidate, 1+rng.IntN(40))
		for i := range cands {
			cands[i] = Candidate{
				Worker:                worker(uint64(i + 1)),
				OverlapBlocks:         rng.IntN(4) * 8,
				ActivePrefillTokens:   rng.IntN(3) * 512,
				ActiveRequests:        rng.IntN(12),
				PotentialDecodeBlocks: float64(rng.IntN(3) * 64),
			}
		}
		req := &Request{ISL: 1024, BlockSize: 16, Params: p}
		seed := uint64(trial)
		got, err := kvPolicy{}.pick(req, cands, rand.New(rand.NewPCG(seed, 1)))
		if err != nil {
			t.Fatal(err)
		}
		lightest := LightestOf(cands)
		want := pickMin(len(cands), func(i int) float64 {
			return p.Cost(&cands[i], req.ISL, req.BlockSize, lightest)
		}, rand.New(rand.NewPCG(seed, 1)))
		if got != want {
			t.Fatalf("trial %d: picked %d, pickMin over Cost picks %d", trial, got, want)
		}
	}
}

func TestTieBreakIsUniform(t *testing.T) {
	for _, m := range []Mode{ModeKV, ModeLeastLoaded} {
		t.Run(string(m), func(t *testing.T) {
			s := mustNew(t, m, nil)
			// Workers 1, 2, 4 and 5 tie for the lowest cost and load.
			cands := withCosts(5, 5, 9, 5, 5, 7)
			for i := range cands {
				cands[i].ActiveDecodeBlocks = cands[i].PotentialDecodeBlocks
			}
			const n = 40000
			got := counts(t, s, &Request{BlockSize: 16, Params: costOnly}, cands, rand.New(rand.NewPCG(5, 6)), n)
			for i, g := range got {
				want := 0
				if cands[i].PotentialDecodeBlocks == 5 {
					want = n / 4
				}
				if math.Abs(float64(g-want)) > 0.05*n/4 {
					t.Errorf("worker %d chosen %d times, want about %d (all: %v)", i, g, want, got)
				}
			}
		})
	}
}

func TestTemperatureSampling(t *testing.T) {
	for _, tc := range []struct {
		costs []float64
		temp  float64
	}{
		{[]float64{10, 20, 30}, 0.5},
		{[]float64{10, 20, 30}, 2},
		{[]float64{1, 1, 4, 100}, 0.3},
		{[]float64{7, 7, 7}, 0.5}, // uniform
	} {
		t.Run(fmt.Sprint(tc.costs, tc.temp), func(t *testing.T) {
			lo, hi := tc.costs[0], tc.costs[0]
			for _, c := range tc.costs {
				lo, hi = min(lo, c), max(hi, c)
			}
			want := make([]float64, len(tc.costs))
			var sum float64
			for i, c := range tc.costs {
				want[i] = 1
				if hi > lo {
					want[i] = math.Exp(-(c / (hi - lo)) / tc.temp)
				}
				sum += want[i]
			}
			s := mustNew(t, ModeKV, nil)
			p := costOnly
			p.Temperature = tc.temp
			const n = 100000
			got := counts(t, s, &Request{BlockSize: 16, Params: p}, withCosts(tc.costs...), rand.New(rand.NewPCG(7, 8)), n)
			for i := range got {
				if freq, exact := float64(got[i])/n, want[i]/sum; math.Abs(freq-exact) > 0.01 {
					t.Errorf("worker %d: frequency %.4f, exact probability %.4f", i, freq, exact)
				}
			}
		})
	}
}

func TestSoftmaxExtremes(t *testing.T) {
	rng := rand.New(rand.NewPCG(9, 10))
	// Temperatures or spans so small every weight but the minimum's
	// underflows, and spans so large they would overflow a product.
	for _, tc := range []struct {
		costs []float64
		temp  float64
	}{
		{[]float64{3, 5, 2, 1}, 1e-9},
		{[]float64{3e-300, 5e-300, 2e-300, 1e-300}, 5e-324},
		{[]float64{3e300, math.MaxFloat64, 2e300, 1e300}, 1e-300},
	} {
		for range 1000 {
			buf := append([]float64(nil), tc.costs...)
			if i := sampleSoftmax(buf, tc.temp, rng); i != 3 {
				t.Fatalf("%v at T=%v: chose %d, want 3", tc.costs, tc.temp, i)
			}
		}
	}
	// A temperature so high the choice is nearly uniform; nothing overflows.
	hits := make([]int, 2)
	for range 10000 {
		hits[sampleSoftmax([]float64{0, math.MaxFloat64}, 1e300, rng)]++
	}
	if hits[0] < 4000 || hits[1] < 4000 {
		t.Errorf("hits = %v, want about even", hits)
	}
}

func TestParseMode(t *testing.T) {
	for _, s := range []string{"kv", "round-robin", "random", "direct", "least-loaded", "power-of-two", "sglang-cache-aware", "llm-d-precise", "gie-approx-prefix", "device-aware-weighted", " KV "} {
		m, err := ParseMode(s)
		if err != nil {
			t.Errorf("ParseMode(%q): %v", s, err)
			continue
		}
		if s, err := New(m, nil); err != nil || s.Mode() != m {
			t.Errorf("New(%q): %v", m, err)
		}
	}
	_, err := ParseMode("kv-aware")
	if err == nil {
		t.Fatal("ParseMode accepted kv-aware")
	}
	for _, m := range Modes() {
		if !strings.Contains(err.Error(), string(m)) {
			t.Errorf("error %q does not list %q", err, m)
		}
	}
	if _, err := New("fastest", nil); err == nil {
		t.Error("New accepted an unknown mode")
	}
	if got := len(Modes()); got != 10 {
		t.Errorf("%d modes, want 10", got)
	}
}

func TestRoundRobin(t *testing.T) {
	s := mustNew(t, ModeRoundRobin, nil)
	cands := withCosts(1, 1, 1)
	book := &Request{BlockSize: 16, Commit: true}
	query := &Request{BlockSize: 16}
	prefill := &Request{BlockSize: 16, Commit: true, Pool: PoolPrefill}
	pick := func(req *Request) int {
		t.Helper()
		c, err := s.Select(req, cands, nil)
		if err != nil {
			t.Fatal(err)
		}
		return c.Index
	}
	for i := range 10 {
		// Queries and the other pool's bookings do not move the cycle.
		if q := pick(query); q != i%3 {
			t.Fatalf("query before pick %d answered %d, want %d", i, q, i%3)
		}
		if i%2 == 0 {
			if p := pick(prefill); p != (i/2)%3 {
				t.Fatalf("prefill pick %d went to %d, want %d", i/2, p, (i/2)%3)
			}
		}
		if got := pick(book); got != i%3 {
			t.Fatalf("pick %d went to %d, want %d", i, got, i%3)
		}
	}
}

func TestRandomCoversAll(t *testing.T) {
	s := mustNew(t, ModeRandom, nil)
	got := counts(t, s, &Request{BlockSize: 16}, withCosts(0, 0, 0, 0), rand.New(rand.NewPCG(1, 1)), 4000)
	for i, g := range got {
		if g < 800 {
			t.Errorf("worker %d chosen %d/4000 times", i, g)
		}
	}
}

func TestDirectAndTarget(t *testing.T) {
	cands := withCosts(1, 2, 3)
	cands[2].ActivePrefillTokens = 100 // busy
	busy := BusyThreshold{ActivePrefillTokens: new(int)}
	named := func(id uint64) *kv.Worker { w := worker(id); return &w }
	for _, tc := range []struct {
		mode Mode
		req  *Request
		want int
		err  error
	}{
		{ModeDirect, &Request{BlockSize: 16, Target: named(3), Busy: busy, OverrideBusy: true}, 2, nil},
		{ModeKV, &Request{BlockSize: 16, Target: named(3), Busy: busy, OverrideBusy: true}, 2, nil},
		{ModeDirect, &Request{BlockSize: 16, Target: named(3), Busy: busy}, 0, ErrAllBusy},
		{ModeKV, &Request{BlockSize: 16, Target: named(3), Busy: busy}, 0, ErrAllBusy},
		{ModeKV, &Request{BlockSize: 16, Target: named(2), Busy: busy}, 1, nil},
		{ModeKV, &Request{BlockSize: 16, Target: named(3), Session: &SessionControl{ID: "s", Action: SessionBind}}, 2, nil},
		{ModeDirect, &Request{BlockSize: 16}, 0, ErrNoTarget},
		{ModeDirect, &Request{BlockSize: 16, Target: named(9)}, 0, ErrUnknownWorker},
		{ModeRoundRobin, &Request{BlockSize: 16, Target: named(9)}, 0, ErrUnknownWorker},
	} {
		c, err := mustNew(t, tc.mode, NewSessions(SessionLimits{})).Select(tc.req, cands, rand.New(rand.NewPCG(1, 1)))
		if !errors.Is(err, tc.err) {
			t.Errorf("%s %+v: err = %v, want %v", tc.mode, tc.req, err, tc.err)
			continue
		}
		if err == nil && (c.Index != tc.want || c.Via.String() != "target") {
			t.Errorf("%s: chose %+v, want index %d via target", tc.mode, c, tc.want)
		}
	}
}

func TestLeastLoaded(t *testing.T) {
	s := mustNew(t, ModeLeastLoaded, nil)
	// Loads: 10+32/16=12, 5+128/16=13, 11+0=11. Potential loads and the
	// cache are ignored.
	cands := []Candidate{
		{Worker: worker(1), ActiveDecodeBlocks: 10, ActivePrefillTokens: 32},
		{Worker: worker(2), ActiveDecodeBlocks: 5, ActivePrefillTokens: 128, OverlapBlocks: 100},
		{Worker: worker(3), ActiveDecodeBlocks: 11, PotentialDecodeBlocks: 1000},
	}
	c, err := s.Select(&Request{BlockSize: 16, ISL: 1000}, cands, rand.New(rand.NewPCG(1, 1)))
	if err != nil || c.Index != 2 {
		t.Errorf("chose %+v, %v; want index 2", c, err)
	}
}

// recordingRand remembers the values IntN returned.
type recordingRand struct {
	*rand.Rand
	drawn []int
}

func (r *recordingRand) IntN(n int) int {
	v := r.Rand.IntN(n)
	r.drawn = append(r.drawn, v)
	return v
}

func TestPowerOfTwo(t *testing.T) {
	s := mustNew(t, ModePowerOfTwo, nil)
	loads := []float64{4, 9, 1, 7, 3, 8}
	cands := make([]Candidate, len(loads))
	for i, l := range loads {
		cands[i] = Candidate{Worker: worker(uint64(i)), ActiveDecodeBlocks: l}
	}
	rng := &recordingRand{Rand: rand.New(rand.NewPCG(11, 12))}
	chosen := make([]int, len(cands))
	for range 10000 {
		rng.drawn = rng.drawn[:0]
		c, err := s.Select(&Request{BlockSize: 16}, cands, rng)
		if err != nil {
			t.Fatal(err)
		}
		if len(rng.drawn) != 2 {
			t.Fatalf("drew %v, want two values", rng.drawn)
		}
		a, b := rng.drawn[0], rng.drawn[1]
		if b >= a {
			b++
		}
		if a == b {
			t.Fatalf("sampled %d twice", a)
		}
		if c.Index != a && c.Index != b {
			t.Fatalf("chose %d, not one of the samples %d, %d", c.Index, a, b)
		}
		if other := a + b - c.Index; loads[other] < loads[c.Index] {
			t.Fatalf("chose %d (load %v) over %d (load %v)", c.Index, loads[c.Index], other, loads[other])
		}
		chosen[c.Index]++
	}
	if chosen[1] != 0 {
		t.Errorf("the most loaded worker was chosen %d times", chosen[1])
	}
	if chosen[2] < chosen[0] {
		t.Errorf("least loaded chosen %d times, less than a busier one (%v)", chosen[2], chosen)
	}

	c, err := s.Select(&Request{BlockSize: 16}, cands[:1], rng)
	if err != nil || c.Index != 0 {
		t.Errorf("single candidate: %+v, %v", c, err)
	}
}

func TestSelectRejects(t *testing.T) {
	s := mustNew(t, ModeKV, NewSessions(SessionLimits{}))
	rng := rand.New(rand.NewPCG(1, 1))
	for _, tc := range []struct {
		name  string
		req   *Request
		cands []Candidate
		err   error
	}{
		{"block size 0", &Request{}, withCosts(1), ErrInvalidRequest},
		{"negative isl", &Request{BlockSize: 16, ISL: -1}, withCosts(1), ErrInvalidRequest},
		{"no candidates", &Request{BlockSize: 16}, nil, ErrNoCandidates},
		{"bad session action", &Request{BlockSize: 16, Session: &SessionControl{ID: "x", Action: "pin"}}, withCosts(1), ErrInvalidRequest},
		{"session without id", &Request{BlockSize: 16, Session: &SessionControl{Action: SessionBind}}, withCosts(1), ErrInvalidRequest},
	} {
		if _, err := s.Select(tc.req, tc.cands, rng); !errors.Is(err, tc.err) {
			t.Errorf("%s: err = %v, want %v", tc.name, err, tc.err)
		}
	}
}

func benchCands(n int) []Candidate {
	rng := rand.New(rand.NewPCG(42, 42))
	out := make([]Candidate, n)
	for i := range out {
		out[i] = Candidate{
			Worker:                worker(uint64(i)),
			OverlapBlocks:         rng.IntN(64),
			ActiveDecodeBlocks:    float64(rng.IntN(5000)),
			ActivePrefillTokens:   rng.IntN(8192),
			PotentialDecodeBlocks: float64(rng.IntN(5000)),
			TotalKVBlocks:         16384,
			MaxNumBatchedTokens:   8192,
		}
	}
	return out
}

func BenchmarkSelect(b *testing.B) {
	for _, n := range []int{64, 1000} {
		for _, temp := range []float64{0, 0.5} {
			b.Run(fmt.Sprintf("n=%d/T=%v", n, temp), func(b *testing.B) {
				benchSelect(b, n, temp, true, false)
			})
		}
		// The router's decisions: no busy threshold, and the lightest
		// loads summarised by the caller (lightest=caller) or by kv mode.
		for _, caller := range []bool{false, true} {
			b.Run(fmt.Sprintf("n=%d/T=0/busy=none/lightest=%s", n, map[bool]string{false: "policy", true: "caller"}[caller]), func(b *testing.B) {
				benchSelect(b, n, 0, false, caller)
			})
		}
	}
}

func benchSelect(b *testing.B, n int, temp float64, busy, caller bool) {
	s := mustNew(b, ModeKV, nil)
	cands := benchCands(n)
	p := DefaultParams()
	p.Temperature = temp
	req := &Request{ISL: 1024, BlockSize: 16, Params: p}
	if busy {
		req.Busy = BusyThreshold{ActiveDecodeBlocks: f(0.9)}
	}
	if caller {
		l := LightestOf(cands)
		req.Lightest = &l
	}
	rng := rand.New(rand.NewPCG(1, 2))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := s.Select(req, cands, rng); err != nil {
			b.Fatal(err)
		}
	}
}

// A caller's Lightest of every candidate chooses as LightestOf does, and
// Select does not hand it to the policy when busy workers are left out:
// the lightest of the rest may be heavier.
func TestCallersLightestChoosesAsLightestOf(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	s := mustNew(t, ModeKV, nil)
	p := DefaultParams()
	differ := 0
	for trial := range 3000 {
		cands := make([]Candidate, 2+rng.IntN(30))
		for i := range cands {
			cands[i] = Candidate{
				Worker:                 worker(uint64(i + 1)),
				OverlapBlocks:          rng.IntN(4) * 8,
				ActivePrefillTokens:    rng.IntN(4) * 512,
				ActiveDecodeBlocks:     float64(rng.IntN(4) * 32),
				ActiveRequests:         rng.IntN(12),
				PotentialDecodeBlocks:  float64(rng.IntN(3) * 64),
				PotentialPrefillTokens: rng.IntN(3) * 1024,
				TotalKVBlocks:          1024,
				MaxNumBatchedTokens:    2048,
			}
		}
		req := func() *Request {
			r := &Request{ISL: 1024, BlockSize: 16, Params: p}
			if trial%2 == 1 {
				limit := 1024
				r.Busy.ActivePrefillTokens = &limit
			}
			return r
		}
		want, errWant := s.Select(req(), cands, rand.New(rand.NewPCG(uint64(trial), 1)))
		all := LightestOf(cands)
		withSummary := req()
		withSummary.Lightest = &all
		got, errGot := s.Select(withSummary, cands, rand.New(rand.NewPCG(uint64(trial), 1)))
		if got != want || (errGot == nil) != (errWant == nil) {
			t.Fatalf("trial %d: chose %+v (%v) with the caller's summary, %+v (%v) without", trial, got, errGot, want, errWant)
		}
		if withSummary.Lightest != &all {
			t.Fatalf("trial %d: Select did not give the caller's summary back", trial)
		}
		if l := withoutBusy(req(), cands); errWant == nil && l != all {
			differ++
		}
	}
	if differ == 0 {
		t.Fatal("no trial left out a busy lightest worker: the test cannot tell")
	}
}

// withoutBusy is LightestOf the candidates req's thresholds leave.
func withoutBusy(req *Request, cands []Candidate) Lightest {
	var free []Candidate
	for i := range cands {
		if !req.Busy.Busy(&cands[i]) {
			free = append(free, cands[i])
		}
	}
	return LightestOf(free)
}
