package sim

import (
	"math"
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/lab/workload"
	"github.com/kvrouter/kvrouter/mocker/engine"
)

func TestKVBound(t *testing.T) {
	eng := engine.DefaultConfig()
	cstar := cheapestPrefillPerToken(eng.MaxNumBatchedTokens)
	d0 := float64(engine.DecodeTime(0))
	slope := float64(engine.DecodeTime(1)) - d0
	m := float64(eng.MaxNumSeqs)
	// perSecond is a request's rate alone on an engine of n blocks: its
	// prompt, its steps at D(0), or its blocks' steps if more, and its
	// blocks read at the chord.
	perSecond := func(private, steps, blocks, n float64) float64 {
		return float64(time.Second) / (cstar*private + d0*max(steps/m, blocks*steps/n) + slope*blocks*steps/n)
	}
	one := kvRequests{private: []int32{1000}, steps: []int32{300}, blockSteps: []int64{500 * 300}, misses: 1000}
	two := kvRequests{private: []int32{1000, 1000}, steps: []int32{300, 300}, blockSteps: []int64{500 * 300, 500 * 300}, misses: 2000}
	cases := []struct {
		name    string
		r       kvRequests
		classes []kvClass
		want    float64
	}{
		{"one engine, few blocks: the blocks' steps bind", one, []kvClass{{1, 100, 1}}, perSecond(1000, 300, 500, 100)},
		{"one engine, many blocks: the steps bind", one, []kvClass{{1, 1 << 20, 1}}, perSecond(1000, 300, 500, 1<<20)},
		{"two engines of one class", two, []kvClass{{1, 1000, 2}}, 2 * perSecond(1000, 300, 500, 1000)},
		{"half speed", one, []kvClass{{0.5, 1000, 1}}, 0.5 * perSecond(1000, 300, 500, 1000)},
		// Equal requests on a full and a half engine: each serves at its own rate.
		{"a full and a half engine", two, []kvClass{{1, 1000, 1}, {1, 500, 1}}, perSecond(1000, 300, 500, 1000) + perSecond(1000, 300, 500, 500)},
		{"shared prompt tokens go anywhere", kvRequests{private: []int32{1}, steps: []int32{0}, blockSteps: []int64{0}, misses: 2001},
			[]kvClass{{1, 1000, 1}, {1, 10, 3}}, 4 * float64(time.Second) / (cstar * 2001)},
		{"three classes: not bounded here", two, []kvClass{{1, 1000, 1}, {1, 500, 1}, {1, 250, 1}}, 0},
		{"no requests", kvRequests{}, []kvClass{{1, 1000, 1}}, 0},
	}
	for _, c := range cases {
		got := kvBound(&c.r, c.classes, eng)
		if math.Abs(got-c.want) > 1e-6*c.want || (c.want == 0) != (got == 0) {
			t.Errorf("%s: %g req/s, want %g", c.name, got, c.want)
		}
	}
}

// A class of two equal halves bounds as one class; a workload whose
// requests differ sends the block-heavy ones to the large engines, above
// the rate of equal shares.
func TestKVBoundAssignsByBlocks(t *testing.T) {
	eng := engine.DefaultConfig()
	r := kvRequests{private: []int32{8000, 8000, 100, 100}, steps: []int32{10, 10, 2000, 2000}, blockSteps: []int64{500 * 10, 500 * 10, 700 * 2000, 700 * 2000}, misses: 16200}
	merged := kvBound(&r, []kvClass{{1, 4000, 4}}, eng)
	split := kvBound(&r, []kvClass{{1, 4000, 2}, {1, 4000, 2}}, eng)
	if math.Abs(merged-split) > 1e-9*merged {
		t.Errorf("one class %g, two equal classes %g", merged, split)
	}
	unequal := kvBound(&r, []kvClass{{1, 4000, 2}, {1, 1000, 2}}, eng)
	small := kvBound(&r, []kvClass{{1, 1000, 4}}, eng)
	if !(unequal < merged && unequal > small) {
		t.Errorf("2 large + 2 small engines %g, want between 4 small %g and 4 large %g", unequal, small, merged)
	}
	// Brute force over whole requests: no assignment of the four beats
	// the fractional bound.
	cost := func(i int, blocks float64) float64 {
		d0 := float64(engine.DecodeTime(0))
		slope := float64(engine.DecodeTime(1)) - d0
		s, b := float64(r.steps[i]), float64(r.blockSteps[i])
		return cheapestPrefillPerToken(eng.MaxNumBatchedTokens)*float64(r.private[i]) + d0*max(s/float64(eng.MaxNumSeqs), b/blocks) + slope*b/blocks
	}
	best := math.Inf(1)
	for mask := range 1 << 4 {
		var large, small float64
		for i := range 4 {
			if mask>>i&1 == 1 {
				large += cost(i, 4000)
			} else {
				small += cost(i, 1000)
			}
		}
		best = min(best, max(large, small)/2)
	}
	if whole := 4 / (best / float64(time.Second)); unequal < whole*(1-1e-9) {
		t.Errorf("bound %g below the best whole assignment's %g", unequal, whole)
	}
}

// A request's private blocks are those no other request holds; its
// private tokens add its partial block, and at least its last token. Each
// block is designated to the holder with the most decode steps, and each
// decode step adds the answer's own blocks.
func TestPrivacy(t *testing.T) {
	bs := 4
	tok := func(from, n int) []uint32 {
		out := make([]uint32, n)
		for i := range out {
			out[i] = uint32(from + i)
		}
		return out
	}
	reqs := Requests{
		{Tokens: append(tok(0, 8), tok(100, 6)...), OSL: 5},  // 3 full blocks, 2 shared with the next
		{Tokens: append(tok(0, 8), tok(200, 8)...), OSL: 1},  // 4 full, 2 shared
		{Tokens: tok(0, 8), OSL: 3},                          // all shared: its last token only
		{Tokens: append(tok(0, 4), tok(300, 2)...), OSL: 10}, // 1 full, shared
	}
	m := measure(reqs, bs, 0, true)
	if want := []int32{6, 8, 4, 2}; !slices.Equal(m.kv.private, want) {
		t.Errorf("private tokens %v, want %v", m.kv.private, want)
	}
	if want := []int32{4, 0, 2, 9}; !slices.Equal(m.kv.steps, want) {
		t.Errorf("steps %v, want %v", m.kv.steps, want)
	}
	// Designated: [0 1 2 3] to request 3 (9 steps), [4 5 6 7] to request
	// 0 (4 steps, more than request 2's), the rest to their only holder:
	// 2, 2, 0 and 1 blocks. Answers' blocks (decodeTails): request 0
	// (14 tokens) holds a partial block at 15, 17 and 18 tokens; request 2
	// (8 tokens) at 9 and 10; request 3 (6 tokens) at 7, 9, 10, 11, 13,
	// 14 and 15 tokens, and from 12 tokens on the full block of tokens
	// 8–11, all generated (4 steps).
	if want := []int64{2*4 + 3, 0, 0*2 + 2, 1*9 + 7 + 4}; !slices.Equal(m.kv.blockSteps, want) {
		t.Errorf("block steps %v, want %v", m.kv.blockSteps, want)
	}
}

// The answer's blocks of decodeTails by hand: 4-token blocks.
func TestDecodeTails(t *testing.T) {
	cases := []struct {
		name        string
		prompt, osl int
		repeated    bool
		want        int64
	}{
		{"one token out: no decode step", 5, 1, false, 0},
		// 6 tokens: steps hold 7..10 tokens; partial at 7, 9, 10; the
		// block of tokens 4–7 mixes prompt and answer: not counted.
		{"prompt ends inside a block", 6, 5, false, 3},
		// 8 tokens: steps at 9..16; partial at 9–11 and 13–15; the block of
		// tokens 8–11 is all answer from 12 tokens on (5 steps), that of
		// 12–15 at 16 (1 step).
		{"prompt ends on a block", 8, 9, false, 6 + 5 + 1},
		{"a repeated prompt: partial blocks only", 8, 9, true, 6},
	}
	for _, c := range cases {
		d := newDecodeTails(2, 4)
		r := workload.Request{Tokens: make([]uint32, c.prompt), OSL: c.osl}
		for i := range r.Tokens {
			r.Tokens[i] = uint32(i + 1)
		}
		seq := make([]uint64, c.prompt/4) // only its length matters here
		d.add(&r, seq)
		other := workload.Request{Tokens: []uint32{9, 9, 9}, OSL: 2}
		if c.repeated {
			other = r
		}
		d.add(&other, seq[:len(other.Tokens)/4])
		if got := d.blockSteps(0); got != c.want {
			t.Errorf("%s: %d block steps, want %d", c.name, got, c.want)
		}
	}
}

// No policy carries requests faster than the bound: on small fleets of
// equal engines, engines of two speeds and engines of two cache sizes,
// every mode's completed requests per second of model time, offered far
// more than the fleet can take, stay below the engine bound the sim
// reports (the KV bound wherever it applies), and on unequal caches the
// KV bound is below the compute bound's largest-cache charge.
func TestNoPolicyExceedsTheKVBound(t *testing.T) {
	reqs, err := workload.Synthetic(workload.SyntheticConfig{
		Requests: 160, Groups: 16, SystemTokens: 256, QuestionTokens: 512, OutputTokens: 200,
		Rate: 40, Turns: 1, Seed: 5,
	})
	if err != nil {
		t.Fatal(err)
	}
	w := FromRequests(reqs)
	for _, fl := range []string{"1x1,1x1:0.25", "2x1,1x0.5:0.5", "2x1,2x1:0.5", "2x1,2x0.5", "4x1"} {
		cfg := smallConfig()
		cfg.Specs = mustSpecs(t, fl)
		cfg.Workers = len(cfg.Specs)
		b := boundsOf(&cfg, w, cfg.Workers)
		speed, maxBlocks, _ := cfg.fleetSize(cfg.Workers)
		eng := cfg.Engine
		eng.NumGPUBlocks = maxBlocks
		compute := unequalEngineBound(b.ceiling, w, eng, speed)
		if !(b.engineRPS > 0 && b.engineRPS <= compute) {
			t.Fatalf("%s: bound %g, compute bound %g", fl, b.engineRPS, compute)
		}
		if unequalKV(cfg.kvClasses(cfg.Workers)) && !(b.kvRPS == b.engineRPS && b.kvRPS < compute) {
			t.Errorf("%s: KV bound %g, compute bound %g, reported %g", fl, b.kvRPS, compute, b.engineRPS)
		}
		for _, mode := range []string{"kv", "round-robin", "dynamo-kv", "sglang-cache-aware", "least-loaded"} {
			p, err := Run(cfg, mode, w, 50)
			if err != nil {
				t.Fatal(err)
			}
			if rate := float64(p.Requests) / p.ModelS; rate > b.engineRPS {
				t.Errorf("%s on %s: %.2f req/s above the bound %.2f", mode, fl, rate, b.engineRPS)
			} else {
				t.Logf("%s on %s: %.2f req/s, bound %.2f, compute %.2f", mode, fl, rate, b.engineRPS, compute)
			}
		}
	}
}
