package sim

import (
	"context"
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/lab/replay"
	"github.com/kvrouter/kvrouter/lab/workload"
)

// The sim stands in for bench replay: on the same workload, engines and
// router configuration, the live replay (HTTP, ZMQ, wall time) and the sim
// find the same share of prompts cached (within the 2 points the
// calibration allows), and first tokens no later. The live path adds its
// transport and the harness's own time, multiplied by the engines'
// speedup (about 7 ms of model time per request here, far more under the
// race detector or a loaded machine): at this size the sim's TTFT is only
// held to be no later; the full-size comparison is in docs/benchmarks.md.
func TestCalibrationAgainstReplay(t *testing.T) {
	if testing.Short() {
		t.Skip("starts fleets")
	}
	reqs, err := workload.Synthetic(workload.SyntheticConfig{
		Requests: 80, Groups: 4, SystemTokens: 1024, QuestionTokens: 64, OutputTokens: 16,
		Rate: 10, Turns: 4, ThinkTime: time.Second, Seed: 2,
	})
	if err != nil {
		t.Fatal(err)
	}
	rc := replay.DefaultConfig()
	rc.Workers, rc.Speedup, rc.Modes = 3, 4, []string{"kv", "round-robin"}
	rc.Fleet.Engine.NumGPUBlocks = 4096
	// A replay whose mean TTFT reaches seconds, where the model's prefill
	// of these prompts takes tens of milliseconds, was starved by other
	// work on the machine (58 s seen under the race detector at a load
	// average of 14): its requests piled up and met other cache states, so
	// its hit rate says nothing of the sim's. Such a run is repeated, up
	// to three in all.
	var res *CalibrationResult
	for attempt := 1; ; attempt++ {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		r, err := Calibrate(ctx, CalibrateConfig{Replay: rc, ArrivalSpeedups: []float64{1}}, reqs, nil)
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		res = r
		starved := slices.ContainsFunc(r.Rows, func(row CalibrationRow) bool { return row.ReplayTTFT.Mean > replayStarvedMs })
		if !starved {
			break
		}
		if attempt == 3 {
			t.Skipf("the machine starved all %d replays (mean TTFT over %d ms): nothing to compare", attempt, replayStarvedMs)
		}
		t.Logf("replay %d starved by the machine (mean TTFT over %d ms), run again", attempt, replayStarvedMs)
	}
	if len(res.Rows) != len(rc.Modes) {
		t.Fatalf("%d comparisons, want one per mode (%d)", len(res.Rows), len(rc.Modes))
	}
	for _, row := range res.Rows {
		t.Logf("%s: hit rate sim %.3f, replay %.3f; TTFT mean sim %.0f ms, replay %.0f ms; p90 %.0f, %.0f",
			row.Mode, row.SimHitRate, row.ReplayHitRate, row.SimTTFT.Mean, row.ReplayTTFT.Mean, row.SimTTFT.P90, row.ReplayTTFT.P90)
		if math.Abs(row.HitDiff) > CalibrationHitRateTolerance {
			t.Errorf("%s: hit rate %.3f in the sim, %.3f in the replay", row.Mode, row.SimHitRate, row.ReplayHitRate)
		}
		// The replay's TTFT grows with the machine's load, multiplied by
		// the speedup, so only its lower side is held: the sim is never
		// later, and its own TTFT is the model's prefill time, well above
		// a millisecond for these prompts.
		if row.SimTTFT.Mean < 1 || row.SimTTFT.Mean > 1.15*row.ReplayTTFT.Mean {
			t.Errorf("%s: mean TTFT %.0f ms in the sim, %.0f in the replay", row.Mode, row.SimTTFT.Mean, row.ReplayTTFT.Mean)
		}
		if row.ReplayErrors != 0 {
			t.Errorf("%s: %d errors in the replay", row.Mode, row.ReplayErrors)
		}
	}
	if got := CalibrationTable(res); !strings.Contains(got, "| kv | ×1 |") || !strings.Contains(got, "| round-robin | ×1 |") {
		t.Errorf("table lacks a row per mode:\n%s", got)
	}
}

// replayStarvedMs is a replay mean TTFT no run of this size reaches on a
// machine that gives it its cores: a hundred times the model's.
const replayStarvedMs = 5000

func TestCalibrationVerdictFollowsTolerances(t *testing.T) {
	cases := []struct {
		name            string
		sim, live       float64
		simHit, liveHit float64
		want            bool
	}{
		{"equal", 100, 100, 0.3, 0.3, true},
		{"ttft 9 % low", 91, 100, 0.3, 0.3, true},
		{"ttft 11 % high", 111, 100, 0.3, 0.3, false},
		{"hit rate 3 points apart", 100, 100, 0.33, 0.30, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			row := compareRow("kv", 1, Point{TTFT: replay.Dist{Mean: c.sim, P90: c.sim}, HitRate: c.simHit},
				&replay.ModeResult{TTFT: replay.Dist{Mean: c.live, P90: c.live}, PrefixHitRate: c.liveHit})
			if row.Agrees != c.want {
				t.Errorf("agrees = %v, want %v (%+v)", row.Agrees, c.want, row)
			}
		})
	}
}
