package sched

import (
	"errors"
	"math"
	"math/rand/v2"
	"testing"
)

// dynamoWhole is Dynamo's cost with every term reachable: no cache
// affinity, prefill load scale 1, the shared cache on.
func dynamoWhole(mod func(*Params)) Params {
	p, _, err := Resolve(DynamoDefaults(), Overrides{SharedCache: b(true)})
	if err != nil {
		panic(err)
	}
	if mod != nil {
		mod(&p)
	}
	return p
}

// TestDynamoCostWorkedExamples holds the cost to Dynamo's formula
// (lib/kv-router's default scorer): the first case is the worked example
// of Dynamo's HiCache guide, the others are computed by hand from the
// formula, one term at a time.
func TestDynamoCostWorkedExamples(t *testing.T) {
	for _, tc := range []struct {
		name      string
		p         Params
		isl, bs   int
		cands     []Candidate
		wantCosts []float64
		wantPick  int
	}{
		{
			// Request of 4 blocks, block size 1, credit 1, multiplier 0.5,
			// the shared pool holding blocks 0–3: W0 (device 2, 2 beyond)
			// logit 1.0 wins over W1 (device 0, 4 beyond) at 2.0.
			name: "HiCache guide: device and shared beyond it",
			p:    dynamoWhole(nil), isl: 4, bs: 1,
			cands:     []Candidate{{OverlapBlocks: 2, SharedBlocks: 2}, {OverlapBlocks: 0, SharedBlocks: 4}},
			wantCosts: []float64{1, 2}, wantPick: 0,
		},
		{
			// 10 blocks; W0 holds 2 on the GPU and 6 more on the host
			// (cumulative host 8): 10 − 2 − 0.75×6 = 3.5. W1 holds 4 on the
			// GPU, 2 more on the host, 4 more on disk: 10 − 4 − 1.5 − 1 = 3.5,
			// plus 1 decode block.
			name: "host and disk beyond the device prefix, default weights",
			p:    dynamoWhole(nil), isl: 160, bs: 16,
			cands: []Candidate{
				{OverlapBlocks: 2, HostBlocks: 8, DiskBlocks: 8},
				{OverlapBlocks: 4, HostBlocks: 6, DiskBlocks: 10, PotentialDecodeBlocks: 1},
			},
			wantCosts: []float64{3.5, 4.5}, wantPick: 0,
		},
		{
			// A disk overlap with no host tier counts from the device prefix.
			name: "disk without host",
			p:    dynamoWhole(nil), isl: 8, bs: 1,
			cands:     []Candidate{{OverlapBlocks: 0, DiskBlocks: 8}, {OverlapBlocks: 1}},
			wantCosts: []float64{6, 7}, wantPick: 0,
		},
		{
			// λ = 1, 8-block request: W0's backlog is 16 blocks over W1's,
			// excess/request = 2, decay 1/3: credit 6 × 1/3 = 2, prefill
			// (16×16 + 128)/16 − 2 = 22. W1: 8 − 0 = 8. Without decay W0
			// costs 18 and still loses; with λ it loses by more.
			name: "credit decay on the busier worker's device credit",
			p:    dynamoWhole(func(p *Params) { p.CreditDecay = 1 }), isl: 128, bs: 16,
			cands:     []Candidate{{OverlapBlocks: 6, ActivePrefillTokens: 256}, {}},
			wantCosts: []float64{22, 8}, wantPick: 1,
		},
		{
			// The decay spares the host credit: W0's 4 host blocks still
			// count 0.75 each. decay = 1/(1 + 2×(32/16)/4) = 1/2.
			name: "decay leaves the lower tiers alone",
			p:    dynamoWhole(func(p *Params) { p.CreditDecay = 2 }), isl: 64, bs: 16,
			cands:     []Candidate{{OverlapBlocks: 4, HostBlocks: 8, ActivePrefillTokens: 32}, {ActivePrefillTokens: 0}},
			wantCosts: []float64{(32.0+64)/16 - 2 - 3, 4}, wantPick: 0,
		},
		{
			// Weight 2 per running request: W0 runs 3 (6 more), W1 none.
			name: "decode active request weight",
			p:    dynamoWhole(func(p *Params) { p.DecodeRequestWeight = 2 }), isl: 32, bs: 16,
			cands:     []Candidate{{ActiveRequests: 3, PotentialDecodeBlocks: 2}, {ActiveRequests: 0, PotentialDecodeBlocks: 5}},
			wantCosts: []float64{2 + 2 + 6, 2 + 5}, wantPick: 1,
		},
		{
			// Credits beyond the prompt clamp the prefill at 0, not below.
			name: "credit clamps at zero",
			p:    dynamoWhole(nil), isl: 2, bs: 1,
			cands:     []Candidate{{OverlapBlocks: 2, SharedBlocks: 6}, {OverlapBlocks: 1}},
			wantCosts: []float64{0, 1}, wantPick: 0,
		},
		{
			// --shared-cache-type none: shared blocks earn nothing.
			name: "shared cache off",
			p:    dynamoWhole(func(p *Params) { p.SharedCache = false }), isl: 4, bs: 1,
			cands:     []Candidate{{OverlapBlocks: 2, SharedBlocks: 2}, {OverlapBlocks: 0, SharedBlocks: 4}},
			wantCosts: []float64{2, 4}, wantPick: 0,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := LightestOf(tc.cands)
			for i := range tc.cands {
				if got := tc.p.Cost(&tc.cands[i], tc.isl, tc.bs, l); math.Abs(got-tc.wantCosts[i]) > 1e-12 {
					t.Errorf("worker %d: cost %v, want %v", i, got, tc.wantCosts[i])
				}
			}
			req := &Request{ISL: tc.isl, BlockSize: tc.bs, Params: tc.p}
			if got, err := (kvPolicy{}).pick(req, tc.cands, rand.New(rand.NewPCG(1, 1))); err != nil || got != tc.wantPick {
				t.Errorf("pick = %d, %v; want %d", got, err, tc.wantPick)
			}
		})
	}
}

// TestTierCreditsKeepAffinity: kvrouter's affinity rewards the prefix a
// worker holds on any of its tiers, not the shared cache's, which every
// worker can read.
func TestTierCreditsKeepAffinity(t *testing.T) {
	p := DefaultParams()
	p.SharedCache = true
	host := Candidate{HostBlocks: 8}
	shared := Candidate{SharedBlocks: 8}
	l := Lightest{}
	if got := p.Terms(&host, 160, 16, l).CacheCredit; got != p.PrefillLoadScale*p.CacheAffinity*DefaultHostHitWeight*8 {
		t.Errorf("host prefix affinity %v", got)
	}
	if got := p.Terms(&shared, 160, 16, l).CacheCredit; got != 0 {
		t.Errorf("shared prefix earned affinity %v", got)
	}
}

func TestTierOverridesValidated(t *testing.T) {
	for _, o := range []Overrides{
		{HostHitWeight: f(1.5)}, {DiskHitWeight: f(-0.1)}, {SharedMultiplier: f(math.NaN())},
		{CreditDecay: f(-1)}, {DecodeRequestWeight: f(math.Inf(1))},
	} {
		if _, _, err := Resolve(Overrides{}, o); !errors.Is(err, ErrInvalidParams) {
			t.Errorf("%+v: err %v, want ErrInvalidParams", o, err)
		}
	}
	p, _, err := Resolve(Overrides{SharedCache: b(true)}, Overrides{SharedMultiplier: f(0.25)})
	if err != nil || !p.SharedCache || p.SharedMultiplier != 0.25 {
		t.Errorf("request's multiplier: %+v, %v", p, err)
	}
}

// With learned prefill times the cost is in time: of two idle workers
// holding nothing, the one whose token costs half is half the prompt
// cost, and a backlog counts by the seconds it holds, in blocks of the
// fastest worker.
func TestLearnedPrefillCostsTime(t *testing.T) {
	p := dynamoWhole(nil)
	const bs, isl = 16, 1600 // 100 blocks
	cands := []Candidate{
		{Prefill: PrefillTime{Known: true, SecondsPerToken: 2e-4}, PotentialDecodeBlocks: 100},
		{Prefill: PrefillTime{Known: true, SecondsPerToken: 1e-4}, PotentialDecodeBlocks: 100},
	}
	l := LightestOf(cands)
	if l.SecondsPerToken != 1e-4 {
		t.Fatalf("fastest %v", l.SecondsPerToken)
	}
	slow, fast := p.Cost(&cands[0], isl, bs, l), p.Cost(&cands[1], isl, bs, l)
	if math.Abs(slow-400) > 1e-9 || math.Abs(fast-200) > 1e-9 {
		t.Fatalf("slow %v, fast %v: want 2 × (100 + 100) and 100 + 100", slow, fast)
	}
	// 0.32 s of backlog on the fast worker is 200 of its blocks: the slow
	// one wins now.
	cands[1].Prefill.Backlog = 0.32
	if c := p.Cost(&cands[1], isl, bs, l); math.Abs(c-400) > 1e-6 {
		t.Fatalf("fast with backlog %v", c)
	}
	cands[1].Prefill.Backlog = 0.33
	req := &Request{ISL: isl, BlockSize: bs, Params: p}
	if got, _ := (kvPolicy{}).pick(req, cands, rand.New(rand.NewPCG(1, 1))); got != 0 {
		t.Fatalf("picked %d, want the idle slow worker", got)
	}
	// The device credit takes uncached blocks off at the worker's rate.
	cands[0].OverlapBlocks = 50
	if c := p.Cost(&cands[0], isl, bs, l); math.Abs(c-(2*50+2*100)) > 1e-9 {
		t.Fatalf("cached half: %v", c)
	}
}

// With learned prefill times a decode block weighs by the share of the
// worker's KV cache it fills: on a worker with half the largest one's
// blocks it counts twice, so equal block counts send the request to the
// larger cache. Without a learned time (the default cost) capacities
// change nothing.
func TestLearnedPrefillWeighsDecodeByCacheShare(t *testing.T) {
	p := dynamoWhole(nil)
	const bs, isl = 16, 1600 // 100 blocks
	known := PrefillTime{Known: true, SecondsPerToken: 1e-4}
	small := Candidate{Prefill: known, PotentialDecodeBlocks: 1000, TotalKVBlocks: 5000}
	big := Candidate{Prefill: known, PotentialDecodeBlocks: 1000, TotalKVBlocks: 10000}
	cands := []Candidate{small, big}
	l := LightestOf(cands)
	if l.MostKVBlocks != 10000 {
		t.Fatalf("most KV blocks %d", l.MostKVBlocks)
	}
	if s, b := p.Cost(&cands[0], isl, bs, l), p.Cost(&cands[1], isl, bs, l); math.Abs(s-2100) > 1e-9 || math.Abs(b-1100) > 1e-9 {
		t.Fatalf("small %v, big %v: want 100 + 2 × 1000 and 100 + 1000", s, b)
	}
	req := &Request{ISL: isl, BlockSize: bs, Params: p}
	if got, _ := (kvPolicy{}).pick(req, cands, rand.New(rand.NewPCG(1, 1))); got != 1 {
		t.Fatalf("picked %d, want the larger cache", got)
	}
	// Half the blocks on the small worker fill the same share: a tie.
	cands[0].PotentialDecodeBlocks = 500
	if s, b := p.Cost(&cands[0], isl, bs, l), p.Cost(&cands[1], isl, bs, l); s != b {
		t.Fatalf("same share: small %v, big %v", s, b)
	}
	// A worker that has not said its capacity weighs blocks as they are.
	cands[0].TotalKVBlocks = 0
	if s := p.Cost(&cands[0], isl, bs, l); math.Abs(s-600) > 1e-9 {
		t.Fatalf("unknown capacity %v", s)
	}
	// Without a learned time the block counts stand.
	cands = []Candidate{{PotentialDecodeBlocks: 1000, TotalKVBlocks: 5000}, {PotentialDecodeBlocks: 1000, TotalKVBlocks: 10000}}
	l = LightestOf(cands)
	if l.MostKVBlocks != 0 || p.Cost(&cands[0], isl, bs, l) != p.Cost(&cands[1], isl, bs, l) {
		t.Fatalf("untimed: %+v, costs %v and %v", l, p.Cost(&cands[0], isl, bs, l), p.Cost(&cands[1], isl, bs, l))
	}
}

// On a smaller cache the request's own new blocks weigh by its output
// length over the mean one too: a long answer holds them through more
// decode steps, so it takes more of that cache's room and goes to the
// larger one, while a short answer still fills the smaller cache.
func TestLearnedPrefillWeighsOwnBlocksByOutputLength(t *testing.T) {
	p := dynamoWhole(nil)
	const bs, isl = 16, 1600 // 100 blocks, all new on both
	known := PrefillTime{Known: true, SecondsPerToken: 1e-4}
	cands := []Candidate{
		{Prefill: known, ActiveDecodeBlocks: 800, PotentialDecodeBlocks: 900, TotalKVBlocks: 5000},
		{Prefill: known, ActiveDecodeBlocks: 1900, PotentialDecodeBlocks: 2000, TotalKVBlocks: 10000},
	}
	for _, tc := range []struct {
		name       string
		osl        int
		mean       float64
		small, big float64 // costs: 100 prefill blocks + decode
		pick       int
	}{
		{"no hint: blocks by cache share", 0, 300, 100 + 2*900, 100 + 2000, 0},
		{"no mean yet", 600, 0, 100 + 2*900, 100 + 2000, 0},
		{"average answer", 300, 300, 100 + 2*900, 100 + 2000, 0},
		{"short answer", 150, 300, 100 + 2*(800+50), 100 + 2000, 0},
		{"three times the mean: the large cache", 900, 300, 100 + 2*(800+300), 100 + 2000, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := LightestOf(cands)
			l.OSL, l.MeanOSL = tc.osl, tc.mean
			if s, b := p.Cost(&cands[0], isl, bs, l), p.Cost(&cands[1], isl, bs, l); math.Abs(s-tc.small) > 1e-9 || math.Abs(b-tc.big) > 1e-9 {
				t.Fatalf("small %v, big %v: want %v and %v", s, b, tc.small, tc.big)
			}
			req := &Request{ISL: isl, OSL: tc.osl, meanOSL: tc.mean, BlockSize: bs, Params: p}
			if got, _ := (kvPolicy{}).pick(req, cands, rand.New(rand.NewPCG(1, 1))); got != tc.pick {
				t.Fatalf("picked %d, want %d", got, tc.pick)
			}
		})
	}
}

// The mean output length is that of the committed requests' hints: a
// query does not move it, and the request being routed counts in it.
func TestSchedulerLearnsTheMeanOutputLength(t *testing.T) {
	s, err := New(ModeKV, nil)
	if err != nil {
		t.Fatal(err)
	}
	p := dynamoWhole(nil)
	known := PrefillTime{Known: true, SecondsPerToken: 1e-4}
	cands := []Candidate{
		{Worker: worker(1), Prefill: known, ActiveDecodeBlocks: 800, PotentialDecodeBlocks: 900, TotalKVBlocks: 5000},
		{Worker: worker(2), Prefill: known, ActiveDecodeBlocks: 1900, PotentialDecodeBlocks: 2000, TotalKVBlocks: 10000},
	}
	route := func(osl int, commit bool) (Choice, float64) {
		t.Helper()
		req := &Request{ISL: 1600, OSL: osl, BlockSize: 16, Params: p, Commit: commit}
		c, err := s.Select(req, cands, rand.New(rand.NewPCG(1, 1)))
		if err != nil {
			t.Fatal(err)
		}
		return c, req.meanOSL
	}
	for range 3 {
		route(100, true)
	}
	// 900 against a mean of (300 + 900) / 4 = 300 if it were booked; as a
	// query it is not, and a second query sees the same mean.
	for range 2 {
		if c, mean := route(900, false); c.Worker != worker(2) || mean != 300 {
			t.Fatalf("query: %v, mean %v; want worker 2 at mean 300", c.Worker, mean)
		}
	}
	if c, mean := route(100, true); c.Worker != worker(1) || mean != 100 {
		t.Fatalf("short answer: %v, mean %v", c.Worker, mean)
	}
	if _, mean := route(0, true); mean != 0 {
		t.Fatalf("no hint: mean %v", mean)
	}
}
