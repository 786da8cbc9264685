package sim

import (
	"bytes"
	"encoding/json"
	"testing"
	"time"
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

func sweepJSON(t *testing.T, w Workload) []byte {
	t.Helper()
	res, err := Sweep(SweepConfig{
		Sim: smallConfig(), Modes: []string{"kv", "round-robin", "llm-d-precise"},
		ArrivalSpeedups: []float64{1, 4}, SLOTTFTP90: 200 * time.Millisecond, BisectSteps: 2,
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

// The same inputs give the same bytes, modes running in parallel or not.
func TestSweepIsDeterministic(t *testing.T) {
	w := synthetic(t, 160)
	a, b := sweepJSON(t, w), sweepJSON(t, w)
	if !bytes.Equal(a, b) {
		t.Fatalf("two sweeps differ:\n%s\n%s", a, b)
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
