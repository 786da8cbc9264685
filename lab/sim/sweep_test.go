package sim

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/lab/replay"
	"github.com/kvrouter/kvrouter/lab/workload"
	"github.com/kvrouter/kvrouter/mocker/engine"
)

func TestGoodputBisection(t *testing.T) {
	at := func(meets ...bool) []Point {
		var ps []Point
		for i, m := range meets {
			ps = append(ps, Point{ArrivalSpeedup: float64(int(1) << i), MeetsSLO: m})
		}
		return ps
	}
	cases := []struct {
		name      string
		points    []Point // at speedups 1, 2, 4, 8, ...
		threshold float64 // the fake system meets the SLO up to here
		steps     int
		want      GoodputResult
		probes    []float64
	}{
		// Between 4 (met) and 8 (missed): 6, 5, 5.5, 5.25, 5.375, 5.3125.
		{"between two points", at(true, true, true, false), 5.3, 6, GoodputResult{Speedup: 5.25},
			[]float64{6, 5, 5.5, 5.25, 5.375, 5.3125}},
		{"every point met", at(true, true, true), 100, 6, GoodputResult{Speedup: 4, Bound: "at least"}, nil},
		// Below the lowest point: between 0 and 1.
		{"even the lowest missed", at(false, false), 0.3, 3, GoodputResult{Speedup: 0.25},
			[]float64{0.5, 0.25, 0.375}},
		{"no refinement", at(true, false), 1.5, 0, GoodputResult{Speedup: 1}, nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var probes []float64
			got, err := Goodput(tc.points, func(s float64) (bool, error) {
				probes = append(probes, s)
				return s <= tc.threshold, nil
			}, tc.steps)
			if err != nil {
				t.Fatal(err)
			}
			if got != tc.want {
				t.Fatalf("goodput %+v, want %+v", got, tc.want)
			}
			if len(probes) != len(tc.probes) {
				t.Fatalf("probed %v, want %v", probes, tc.probes)
			}
			for i := range probes {
				if probes[i] != tc.probes[i] {
					t.Fatalf("probed %v, want %v", probes, tc.probes)
				}
			}
		})
	}
}

// The goodput is the most a run within the SLO carried, which for
// closed-loop sessions can be a run below the knee.
func TestCarriedRate(t *testing.T) {
	run := func(speedup, rps float64, meets bool) Point {
		return Point{ArrivalSpeedup: speedup, ArrivalRPS: rps, MeetsSLO: meets}
	}
	cases := []struct {
		name    string
		runs    []Point
		knee    float64
		rps, at float64
	}{
		{"open loop: the knee's run", []Point{run(1, 10, true), run(2, 20, true), run(4, 40, false), run(3, 30, true)}, 3, 30, 3},
		{"closed loop: a run below the knee offered more", []Point{run(1, 100, true), run(2, 190, true), run(4, 150, false), run(3, 180, true)}, 3, 190, 2},
		{"a run past the knee never counts", []Point{run(1, 100, true), run(2, 150, false), run(4, 300, true)}, 1, 100, 1},
		{"a run that missed never counts", []Point{run(1, 100, true), run(2, 250, false), run(1.5, 120, true)}, 1.5, 120, 1.5},
		{"nothing met", []Point{run(1, 100, false), run(0.5, 50, false)}, 0, 0, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if rps, at := carriedRate(tc.runs, tc.knee); rps != tc.rps || at != tc.at {
				t.Fatalf("carried %v req/s at ×%v, want %v at ×%v", rps, at, tc.rps, tc.at)
			}
		})
	}
}

func sweepJSON(t *testing.T, w Workload, parallel int) []byte {
	t.Helper()
	res, err := Sweep(SweepConfig{
		Sim: smallConfig(), Modes: []string{"kv", "round-robin", "llm-d-precise"},
		ArrivalSpeedups: []float64{1, 4}, SLOTTFTP90: 200 * time.Millisecond, BisectSteps: 2, Parallel: parallel,
	}, w)
	if err != nil {
		t.Fatal(err)
	}
	res.WallS = 0 // the one field that is not a function of the inputs
	b, err := json.Marshal(res)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// The same inputs give the same bytes, one run at a time or every load
// of every mode at once.
func TestSweepIsDeterministic(t *testing.T) {
	w := synthetic(t, 160)
	a, b := sweepJSON(t, w, 1), sweepJSON(t, w, 8)
	if !bytes.Equal(a, b) {
		t.Fatalf("serial and parallel sweeps differ:\n%s\n%s", a, b)
	}
	var res Results
	if err := json.Unmarshal(a, &res); err != nil {
		t.Fatal(err)
	}
	for _, mode := range res.Order {
		m := res.Modes[mode]
		if len(m.Points) != 2 || m.Points[0].ArrivalSpeedup != 1 || m.Points[0].TTFT.P90 <= 0 || m.Points[0].HitRate <= 0 {
			t.Fatalf("%s: %+v", mode, m)
		}
	}
	if res.ModelS <= 0 || res.Config.CeilingHitRate <= 0 {
		t.Fatalf("model time %g, ceiling %g", res.ModelS, res.Config.CeilingHitRate)
	}
}

// A sweep over fleet sizes runs every mode on each size, keeps the first
// size's results where a single-size sweep has them, and a larger fleet
// carries at least the load a smaller one does.
func TestSweepOverFleetSizes(t *testing.T) {
	w := synthetic(t, 160)
	cfg := SweepConfig{
		Sim: smallConfig(), Modes: []string{"kv", "round-robin"}, WorkerCounts: []int{1, 3},
		ArrivalSpeedups: []float64{1, 4, 16}, SLOTTFTP90: 200 * time.Millisecond, BisectSteps: 3,
	}
	var lines []string
	cfg.Progress = func(l string) { lines = append(lines, l) }
	res, err := Sweep(cfg, w)
	if err != nil {
		t.Fatal(err)
	}
	if res.Config.Workers != 1 || !slices.Equal(res.Config.WorkerCounts, []int{1, 3}) {
		t.Fatalf("config workers %d, counts %v", res.Config.Workers, res.Config.WorkerCounts)
	}
	runs := 0
	for _, mode := range res.Order {
		m := res.Modes[mode]
		if len(m.ByWorkers) != 2 || m.ByWorkers[0].Workers != 1 || m.ByWorkers[1].Workers != 3 {
			t.Fatalf("%s: by_workers %+v", mode, m.ByWorkers)
		}
		small, large := m.ByWorkers[0], m.ByWorkers[1]
		if m.GoodputRPS != small.GoodputRPS || len(m.Points) != len(small.Points) || m.Points[1].TTFT != small.Points[1].TTFT {
			t.Errorf("%s: the top level is not the first fleet's: %+v vs %+v", mode, m, small)
		}
		if large.GoodputRPS < small.GoodputRPS {
			t.Errorf("%s: 3 engines carry %.2f req/s, 1 engine %.2f", mode, large.GoodputRPS, small.GoodputRPS)
		}
		if large.Points[2].TTFT.P90 > small.Points[2].TTFT.P90 {
			t.Errorf("%s: at ×16, p90 TTFT %.0f ms on 3 engines, %.0f on 1", mode, large.Points[2].TTFT.P90, small.Points[2].TTFT.P90)
		}
		for _, f := range m.ByWorkers {
			runs += len(f.Points) + len(f.Probes)
		}
	}
	// One progress line per run, the last one complete.
	if len(lines) != runs {
		t.Fatalf("%d progress lines for %d runs", len(lines), runs)
	}
	if last := lines[len(lines)-1]; !strings.Contains(last, fmt.Sprintf("] %d/%d runs", runs, runs)) {
		t.Errorf("last progress line %q, want %d/%d runs", last, runs, runs)
	}
}

// The prefill bound, checked by hand: two identical 1,000-token prompts in
// 16-token blocks; one infinite cache misses the first whole and all but
// the last 8 tokens' block of the second (992 hits), so 1,008 tokens need
// computing. With a budget of 1,000 tokens a step, the cheapest step is
// the largest: (4.209989e-7·1000² + 1.518344e-2·1000 + 16.50142) ms for
// 1,000 tokens. Spread over 2 engines, each is busy 504 tokens' worth.
func TestPrefillBoundByHand(t *testing.T) {
	prompt := make([]uint32, 1000)
	for i := range prompt {
		prompt[i] = uint32(i + 1)
	}
	c := ceilingOf(Requests{{Tokens: prompt, OSL: 1}, {At: time.Second, Tokens: prompt, OSL: 1}}, 16)
	if hits, total := c.Tokens(); hits != 992 || total != 2000 {
		t.Fatalf("ceiling: %d of %d tokens cached, want 992 of 2000", hits, total)
	}
	perToken := (4.209989e-7*1000*1000 + 1.518344e-2*1000 + 16.50142) / 1000 // ms
	want := 2 / (1008 * perToken / 2 / 1000)
	if got := PrefillBoundRPS(c, 2, 2, 1000); math.Abs(got-want) > want*1e-6 {
		t.Fatalf("bound %.4f req/s, want %.4f", got, want)
	}
	// A larger budget finds the cheaper step near 6,261 tokens.
	if got := PrefillBoundRPS(c, 2, 2, 8192); got <= want {
		t.Fatalf("a larger step budget cannot lower the bound: %.4f ≤ %.4f", got, want)
	}
	if got := PrefillBoundRPS(replay.NewCeiling(16), 0, 2, 1000); got != 0 {
		t.Fatalf("nothing to compute: bound %v, want 0", got)
	}
}

// The engine bound by hand: three requests of 4-token blocks, two the turns
// of one closed-loop session, the third an open request repeating the
// first's prompt.
func TestEngineBoundByHand(t *testing.T) {
	toks := func(n int) []uint32 { return seqTokens(3, n) }
	w := FromRequests([]workload.Request{
		{At: 0, Tokens: toks(8), OSL: 3, Session: "s"},
		{At: time.Second, Tokens: toks(12), OSL: 2, Session: "s", Think: time.Second},
		{At: 2 * time.Second, Tokens: toks(8), OSL: 1},
	})
	eng := engine.Config{BlockSize: 4, NumGPUBlocks: 10, MaxNumSeqs: 2, MaxNumBatchedTokens: 64}
	c := ceilingOf(w, eng.BlockSize)
	d0, d1 := float64(engine.DecodeTime(0)), float64(engine.DecodeTime(1))
	// Misses: 8 tokens, then 4 (the second turn's third block), then 4
	// (the open request's last block is always computed).
	best := math.Inf(1)
	for n := 1; n <= 64; n++ {
		best = min(best, float64(engine.PrefillTime(n))/float64(n))
	}
	// Held blocks, summed over decode steps: the first two blocks are the
	// session's, whose turns decode 2 + 1 steps (more than the open
	// request's 0), each holding them alone; the second turn's third
	// block, 1 step; the partial blocks of the answers, at 9 and 10
	// tokens for the first turn and 13 for the second (the first turn's
	// prompt is repeated: no full answer block would count).
	held := 2*3 + 1 + 2 + 1
	busy := 16*best + 3*(d0/2) + (d1-d0)*float64(held)/10 // ns, one engine
	for _, workers := range []int{1, 3} {
		want := 3 / (busy / float64(workers) / 1e9)
		if got := EngineBoundRPS(c, w, eng, workers); math.Abs(got-want) > want*1e-9 {
			t.Errorf("%d workers: engine bound %g req/s, want %g", workers, got, want)
		}
	}
	if got, prefillOnly := EngineBoundRPS(c, w, eng, 1), PrefillBoundRPS(c, 3, 1, 64); got >= prefillOnly {
		t.Errorf("engine bound %g is not below the prefill bound %g", got, prefillOnly)
	}
}

// The engine bound relies on DecodeTime lying above its chord on [0, 1].
func TestDecodeTimeIsAboveItsChord(t *testing.T) {
	d0, d1 := engine.DecodeTime(0), engine.DecodeTime(1)
	for i := range 101 {
		u := float64(i) / 100
		if chord := float64(d0) + (float64(d1)-float64(d0))*u; float64(engine.DecodeTime(u)) < chord-1 {
			t.Fatalf("DecodeTime(%g) = %v is below the chord's %v ns", u, engine.DecodeTime(u), chord)
		}
	}
}

// A goodput above the engine bound is a burst, and the report says so.
func TestGoodputAboveTheEngineBoundIsFlagged(t *testing.T) {
	res := &Results{
		Modes: map[string]*ModeResult{"kv": {GoodputRPS: 150}, "round-robin": {GoodputRPS: 90}, "random": {GoodputRPS: 120}},
		Order: []string{"kv", "round-robin", "random"},
	}
	for _, tc := range []struct {
		bound float64
		above []string
	}{
		{100, []string{"kv", "random"}},
		{200, nil},
		{0, nil}, // no bound computed: nothing to compare with
	} {
		res.Config.EngineBoundRPS = tc.bound
		if got := res.AboveEngineBound(); !slices.Equal(got, tc.above) {
			t.Errorf("bound %g: %v above it, want %v", tc.bound, got, tc.above)
		}
		var md bytes.Buffer
		if err := Markdown(&md, res); err != nil {
			t.Fatal(err)
		}
		if warned := strings.Contains(md.String(), "exceeds the engine bound"); warned != (len(tc.above) > 0) {
			t.Errorf("bound %g: report warns %v, want %v", tc.bound, warned, len(tc.above) > 0)
		}
	}
}
