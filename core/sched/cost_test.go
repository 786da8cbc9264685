package sched

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/kvrouter/kvrouter/core/kv"
)

func f(v float64) *float64 { return &v }
func b(v bool) *bool       { return &v }

func worker(id uint64) kv.Worker { return kv.Worker{ID: id} }

// The docs' worked example: a 10-block prompt, workers caching 2, 5 and 8
// of its blocks, with 10, 5 and 9 decode blocks.
func TestWorkedExample(t *testing.T) {
	const bs = 16
	cands := []Candidate{
		{Worker: worker(1), OverlapBlocks: 2, PotentialDecodeBlocks: 10},
		{Worker: worker(2), OverlapBlocks: 5, PotentialDecodeBlocks: 5},
		{Worker: worker(3), OverlapBlocks: 8, PotentialDecodeBlocks: 9},
	}
	dynamo, _, err := Resolve(DynamoDefaults(), Overrides{})
	if err != nil {
		t.Fatal(err)
	}
	req := &Request{ISL: 10 * bs, BlockSize: bs, Params: dynamo}
	for i, want := range []float64{18, 10, 11} {
		if got := req.Params.Cost(&cands[i], req.ISL, bs, LightestOf(cands)); got != want {
			t.Errorf("cost(worker %d) = %v, want %v", i+1, got, want)
		}
	}
	s, err := New(ModeKV, nil)
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for range 100 {
		c, err := s.Select(req, cands, rng)
		if err != nil {
			t.Fatal(err)
		}
		if c.Worker != worker(2) || c.Index != 1 || c.Via != ViaPolicy {
			t.Fatalf("chose %+v, want worker 2", c)
		}
	}
	// With kvrouter's cache affinity (7 here, prefill scale 3) the prefill
	// terms are 3 × (8 − 14), 3 × (5 − 35), 3 × (2 − 56): the worker caching
	// most of the prompt wins instead.
	req.Params = affinity7()
	for i, want := range []float64{-18 + 10, -90 + 5, -162 + 9} {
		if got := req.Params.Cost(&cands[i], req.ISL, bs, LightestOf(cands)); got != want {
			t.Errorf("with affinity: cost(worker %d) = %v, want %v", i+1, got, want)
		}
	}
	if c, err := s.Select(req, cands, rng); err != nil || c.Worker != worker(3) {
		t.Fatalf("with affinity chose %+v (%v), want worker 3", c, err)
	}
}

func TestCost(t *testing.T) {
	// 100 prefill tokens already active, a 60-token prompt, block size 16:
	// raw prefill = 10 blocks; 4 of them cached; 7.5 decode blocks.
	c := Candidate{ActivePrefillTokens: 100, OverlapBlocks: 4, PotentialDecodeBlocks: 7.5}
	for _, tc := range []struct {
		name string
		cfg  Overrides
		want float64
	}{
		{"defaults", Overrides{}, 1*(10-4) + 7.5},
		{"credit 0 ignores the cache", Overrides{OverlapCredit: f(0)}, 10 + 7.5},
		{"credit 0.5", Overrides{OverlapCredit: f(0.5)}, (10 - 2) + 7.5},
		{"scale 0 is decode only", Overrides{PrefillLoadScale: f(0)}, 7.5},
		{"scale 3", Overrides{PrefillLoadScale: f(3)}, 3*6 + 7.5},
		{"legacy 0 zeroes scale and credit", Overrides{LegacyOverlapWeight: f(0)}, 7.5},
		{"legacy 2 scales, keeps credit", Overrides{LegacyOverlapWeight: f(2)}, 2*6 + 7.5},
		{"legacy beats scale", Overrides{PrefillLoadScale: f(5), LegacyOverlapWeight: f(2)}, 2*6 + 7.5},
		{"affinity 2 is not clamped", Overrides{CacheAffinity: f(2)}, 6 + 7.5 - 2*4},
		{"affinity scales with the prefill", Overrides{CacheAffinity: f(2), PrefillLoadScale: f(3)}, 3*(6-2*4) + 7.5},
		{"affinity needs a credit", Overrides{CacheAffinity: f(5), OverlapCredit: f(0)}, 10 + 7.5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.cfg.CacheAffinity == nil {
				tc.cfg.CacheAffinity = f(0) // Dynamo's formula
			}
			if tc.cfg.PrefillLoadScale == nil {
				tc.cfg.PrefillLoadScale = f(1)
			}
			p, _, err := Resolve(tc.cfg, Overrides{})
			if err != nil {
				t.Fatal(err)
			}
			if got := p.Cost(&c, 60, 16, LightestOf([]Candidate{c})); math.Abs(got-tc.want) > 1e-12 {
				t.Errorf("cost = %v, want %v", got, tc.want)
			}
		})
	}

	t.Run("prefill is not rounded to blocks", func(t *testing.T) {
		c := Candidate{ActivePrefillTokens: 7}
		if got := DefaultParams().Cost(&c, 1, 16, Lightest{}); got != 0.5*DefaultPrefillLoadScale {
			t.Errorf("cost = %v, want 0.5", got)
		}
	})
	t.Run("credit beyond the prompt clamps at 0", func(t *testing.T) {
		c := Candidate{OverlapBlocks: 50, PotentialDecodeBlocks: 3}
		p, _, _ := Resolve(DynamoDefaults(), Overrides{})
		if got := p.Cost(&c, 160, 16, Lightest{}); got != 3 {
			t.Errorf("cost = %v, want 3", got)
		}
	})
}

// On a worker much busier than the lightest, the affinity credits only the
// prefill its cache actually saves: the cached prefix less its queue beyond
// the least-queued candidate's. Between workers of similar load it credits
// the whole prefix.
func TestAffinityIsBoundedByThePrefillSaved(t *testing.T) {
	// 100 tokens queued, a 60-token prompt, 4 of its blocks cached: raw
	// prefill 10 blocks, 6 after the cache; 7.5 decode blocks; 10 requests
	// running.
	c := Candidate{ActivePrefillTokens: 100, OverlapBlocks: 4, PotentialDecodeBlocks: 7.5, ActiveRequests: 10}
	p, _, err := Resolve(Overrides{CacheAffinity: f(2), PrefillLoadScale: f(1)}, Overrides{})
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name     string
		lightest Lightest
		want     float64
	}{
		{"the least queued saves its whole prefix", Lightest{PrefillTokens: 100}, 6 + 7.5 - 2*4},
		{"2 blocks more queue than another: 2 saved", Lightest{PrefillTokens: 68}, 6 + 7.5 - 2*2},
		{"exactly the prefix more: nothing saved", Lightest{PrefillTokens: 36}, 6 + 7.5},
		{"more still: no affinity, no penalty either", Lightest{PrefillTokens: 0}, 6 + 7.5},
		{"3 × 2 + 2 = 8 < 10 requests: still much busier", Lightest{Requests: 2}, 6 + 7.5},
		{"3 × 3 + 2 = 11 ≥ 10 requests: similar load, whole prefix", Lightest{Requests: 3}, 6 + 7.5 - 2*4},
	} {
		if got := p.Cost(&c, 60, 16, tc.lightest); math.Abs(got-tc.want) > 1e-12 {
			t.Errorf("%s: cost = %v, want %v", tc.name, got, tc.want)
		}
	}
}

// affinity7 is the default parameters with affinity 7, the value
// docs/routing-core.md's worked examples use.
func affinity7() Params {
	p := DefaultParams()
	p.CacheAffinity = 7
	return p
}

// docs/routing-core.md's worked example: an 80-block request whose 64-block
// history engine A caches, A running 12 requests, engine B none or 4, as
// A's queue and decode load grow.
func TestBoundedAffinityWorkedExample(t *testing.T) {
	const bs = 16
	s, err := New(ModeKV, nil)
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for _, tc := range []struct {
		queued       int     // blocks queued on A
		aDecode      float64 // A's active decode blocks
		bRequests    int
		bDecode      float64
		costA, costB float64
		want         uint64
	}{
		{0, 96, 0, 0, -512, 320, 1},
		{32, 96, 0, 0, 256, 320, 1},
		{96, 96, 0, 0, 448, 320, 2},
		{0, 584, 0, 0, 648, 320, 2},
		{0, 584, 4, 300, -696, 620, 1},
	} {
		cands := []Candidate{
			{Worker: worker(1), OverlapBlocks: 64, ActivePrefillTokens: tc.queued * bs, ActiveDecodeBlocks: tc.aDecode, PotentialDecodeBlocks: tc.aDecode + 16, ActiveRequests: 12},
			{Worker: worker(2), ActiveDecodeBlocks: tc.bDecode, PotentialDecodeBlocks: tc.bDecode + 80, ActiveRequests: tc.bRequests},
		}
		req := &Request{ISL: 80 * bs, BlockSize: bs, Params: affinity7()}
		name := fmt.Sprintf("queue %d, A decode %v, B running %d", tc.queued, tc.aDecode, tc.bRequests)
		if got := req.Params.Cost(&cands[0], req.ISL, bs, LightestOf(cands)); got != tc.costA {
			t.Errorf("%s: cost A = %v, want %v", name, got, tc.costA)
		}
		if got := req.Params.Cost(&cands[1], req.ISL, bs, LightestOf(cands)); got != tc.costB {
			t.Errorf("%s: cost B = %v, want %v", name, got, tc.costB)
		}
		if c, err := s.Select(req, cands, rng); err != nil || c.Worker != worker(tc.want) {
			t.Errorf("%s: chose %v (%v), want worker %d", name, c.Worker, err, tc.want)
		}
	}
}

// A hot set: eight conversations of 4,000 tokens (250 blocks) cached on
// engine A, twelve clients continuing them with 16 new tokens each. A's
// queue is a block or two, since each request prefills only its turn, but
// A decodes all twelve and reads every conversation's KV at each step,
// while B idles. The affinity must give way to B; once B runs a fair share
// of the clients (A's 12 are then no longer 3 × B's + 2), the whole prefix
// counts again and A keeps the conversations it caches.
func TestHotSetDecodeLoadBoundsTheAffinity(t *testing.T) {
	const bs = 16
	s, err := New(ModeKV, nil)
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(5, 6))
	req := &Request{ISL: 4016, BlockSize: bs, Params: DefaultParams()}
	for _, tc := range []struct {
		name      string
		bRequests int
		bDecode   float64
		want      uint64
	}{
		{"B idle", 0, 0, 2},
		{"B runs 4 requests of other conversations", 4, 1004, 1},
	} {
		cands := []Candidate{
			{Worker: worker(1), OverlapBlocks: 250, ActivePrefillTokens: 2 * bs, ActiveDecodeBlocks: 8*250 + 12, PotentialDecodeBlocks: 8*250 + 13, ActiveRequests: 12},
			{Worker: worker(2), ActiveDecodeBlocks: tc.bDecode, PotentialDecodeBlocks: tc.bDecode + 251, ActiveRequests: tc.bRequests},
		}
		if c, err := s.Select(req, cands, rng); err != nil || c.Worker != worker(tc.want) {
			t.Errorf("%s: chose %v (%v), want worker %d", tc.name, c.Worker, err, tc.want)
		}
	}
}

// Reference model: kv mode never sends a request to a worker much busier
// than the lightest (ImbalanceRatio, ImbalanceSlack) when another would
// give it an earlier first token (queued + own uncached prompt blocks)
// with no more decode load, whatever the caches; before the affinity was
// bounded, a cache behind a long queue won over an idle worker.
func TestKVNeverPicksADominatedWorker(t *testing.T) {
	const bs = 16
	rng := rand.New(rand.NewPCG(3, 4))
	s, err := New(ModeKV, nil)
	if err != nil {
		t.Fatal(err)
	}
	for round := range 20000 {
		isl := 1 + rng.IntN(4096)
		cands := make([]Candidate, 2+rng.IntN(6))
		for i := range cands {
			cands[i] = Candidate{
				Worker:                worker(uint64(i)),
				OverlapBlocks:         rng.IntN(isl/bs + 1),
				ActivePrefillTokens:   rng.IntN(3) * rng.IntN(16384),
				PotentialDecodeBlocks: float64(rng.IntN(4) * rng.IntN(2048)),
				ActiveRequests:        rng.IntN(2) * rng.IntN(32),
			}
		}
		ttft := func(c *Candidate) float64 {
			return max(float64(c.ActivePrefillTokens+isl)/bs-float64(c.OverlapBlocks), 0)
		}
		req := &Request{ISL: isl, BlockSize: bs, Params: DefaultParams()}
		choice, err := s.Select(req, cands, rng)
		if err != nil {
			t.Fatal(err)
		}
		got := &cands[choice.Index]
		if !LightestOf(cands).muchBusier(got) {
			continue
		}
		for i := range cands {
			o := &cands[i]
			if ttft(o) <= ttft(got) && o.PotentialDecodeBlocks <= got.PotentialDecodeBlocks &&
				(ttft(o) < ttft(got) || o.PotentialDecodeBlocks < got.PotentialDecodeBlocks) {
				t.Fatalf("round %d, isl %d: chose %+v (ttft %.1f blocks) over %+v (ttft %.1f blocks)", round, isl, *got, ttft(got), *o, ttft(o))
			}
		}
	}
}

func TestResolve(t *testing.T) {
	def := DefaultParams()
	with := func(mod func(*Params)) Params { p := def; mod(&p); return p }
	for _, tc := range []struct {
		name     string
		cfg, req Overrides
		want     Params
		warn     bool
	}{
		{"defaults", Overrides{}, Overrides{}, def, false},
		{"config values", Overrides{OverlapCredit: f(0.3), PrefillLoadScale: f(2), Temperature: f(0.7)}, Overrides{},
			with(func(p *Params) { p.OverlapCredit, p.PrefillLoadScale, p.Temperature = 0.3, 2, 0.7 }), false},
		{"config legacy 0", Overrides{OverlapCredit: f(0.8), LegacyOverlapWeight: f(0)}, Overrides{},
			with(func(p *Params) { p.OverlapCredit, p.PrefillLoadScale = 0, 0 }), true},
		{"config legacy 2", Overrides{OverlapCredit: f(0.8), PrefillLoadScale: f(4), LegacyOverlapWeight: f(2)}, Overrides{},
			with(func(p *Params) { p.OverlapCredit, p.PrefillLoadScale = 0.8, 2 }), true},
		{"request beats config", Overrides{OverlapCredit: f(0.8), Temperature: f(1)}, Overrides{OverlapCredit: f(0.2), Temperature: f(0)},
			with(func(p *Params) { p.OverlapCredit = 0.2 }), false},
		{"request scale beats config legacy", Overrides{LegacyOverlapWeight: f(2)}, Overrides{PrefillLoadScale: f(0.5)},
			with(func(p *Params) { p.PrefillLoadScale = 0.5 }), true},
		{"request legacy beats request scale", Overrides{}, Overrides{PrefillLoadScale: f(0.5), LegacyOverlapWeight: f(3)},
			with(func(p *Params) { p.PrefillLoadScale = 3 }), true},
		{"request legacy 0 beats request credit", Overrides{}, Overrides{OverlapCredit: f(1), LegacyOverlapWeight: f(0)},
			with(func(p *Params) { p.OverlapCredit, p.PrefillLoadScale = 0, 0 }), true},
		{"booleans", Overrides{AssumeKVReuse: b(false)}, Overrides{TrackPrefillTokens: b(false)},
			with(func(p *Params) { p.AssumeKVReuse, p.TrackPrefillTokens = false, false }), false},
		{"request re-enables reuse", Overrides{AssumeKVReuse: b(false)}, Overrides{AssumeKVReuse: b(true)}, def, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, warn, err := Resolve(tc.cfg, tc.req)
			if err != nil {
				t.Fatal(err)
			}
			if got != tc.want {
				t.Errorf("params = %+v, want %+v", got, tc.want)
			}
			if (warn != "") != tc.warn {
				t.Errorf("warning = %q, want warning: %v", warn, tc.warn)
			}
		})
	}
}

func TestResolveRejects(t *testing.T) {
	for _, tc := range []struct {
		name     string
		cfg, req Overrides
	}{
		{"credit above 1", Overrides{OverlapCredit: f(1.5)}, Overrides{}},
		{"negative credit", Overrides{}, Overrides{OverlapCredit: f(-0.1)}},
		{"NaN credit", Overrides{OverlapCredit: f(math.NaN())}, Overrides{}},
		{"negative scale", Overrides{PrefillLoadScale: f(-1)}, Overrides{}},
		{"negative affinity", Overrides{}, Overrides{CacheAffinity: f(-1)}},
		{"infinite legacy", Overrides{}, Overrides{LegacyOverlapWeight: f(math.Inf(1))}},
		{"negative legacy", Overrides{LegacyOverlapWeight: f(-2)}, Overrides{}},
		{"NaN temperature", Overrides{}, Overrides{Temperature: f(math.NaN())}},
		{"negative temperature", Overrides{Temperature: f(-1)}, Overrides{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if _, _, err := Resolve(tc.cfg, tc.req); !errors.Is(err, ErrInvalidParams) {
				t.Errorf("err = %v, want ErrInvalidParams", err)
			}
		})
	}
}

func TestLoadAware(t *testing.T) {
	cfg := LoadAware(Overrides{OverlapCredit: f(0.9), PrefillLoadScale: f(2.5), AssumeKVReuse: b(true), HostHitWeight: f(0.5), SharedCache: b(true)})
	p, warn, err := Resolve(cfg, Overrides{})
	if err != nil || warn != "" {
		t.Fatalf("Resolve: %v %q", err, warn)
	}
	want := Params{OverlapCredit: 0, PrefillLoadScale: 2.5, CacheAffinity: 0, AssumeKVReuse: false, TrackPrefillTokens: true,
		HostHitWeight: 0.5, DiskHitWeight: DefaultDiskHitWeight, SharedMultiplier: DefaultSharedMultiplier, SharedCache: false}
	if p != want {
		t.Errorf("params = %+v, want %+v", p, want)
	}
	if p.UsesOverlap() {
		t.Error("load-aware preset still needs an index")
	}
	if !DefaultParams().UsesOverlap() {
		t.Error("defaults do not use the index")
	}
}

func TestTermsAddUpToCost(t *testing.T) {
	p := DefaultParams()
	cands := []Candidate{
		{OverlapBlocks: 3, ActivePrefillTokens: 100, PotentialDecodeBlocks: 12, ActiveRequests: 1},
		{OverlapBlocks: 0, ActivePrefillTokens: 0, PotentialDecodeBlocks: 4, ActiveRequests: 0},
		{OverlapBlocks: 8, ActivePrefillTokens: 900, PotentialDecodeBlocks: 40, ActiveRequests: 9},
	}
	l := LightestOf(cands)
	for i := range cands {
		got := p.Terms(&cands[i], 160, 16, l)
		want := p.Cost(&cands[i], 160, 16, l)
		if math.Abs(got.Total-want) > 1e-9 {
			t.Fatalf("candidate %d: Terms total %v, Cost %v", i, got.Total, want)
		}
		if sum := got.Prefill - got.CacheCredit + got.Decode; math.Abs(sum-want) > 1e-9 {
			t.Fatalf("candidate %d: terms add up to %v, Cost is %v", i, sum, want)
		}
	}
	if got := p.Terms(&cands[0], 160, 16, l); got.CacheCredit <= 0 || got.Decode != 12 {
		t.Fatalf("a cached prefix earns no credit or decode is off: %+v", got)
	}
}
