package sim

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/replay"
	"github.com/kvrouter/kvrouter/internal/workload"
)

// The sim stands in for bench replay: on the same workload, engines and
// router configuration, the live replay (HTTP, ZMQ, wall time) and the sim
// find the same share of prompts cached (within the 2 points the
// calibration allows), and first tokens no later. The live path adds its
// transport and the harness's own time, multiplied by the engines'
// speedup (about 7 ms of model time per request here, far more under the
// race detector): at this size TTFT agrees in order only, the full-size
// comparison is in docs/benchmarks.md.
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
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	live, err := replay.Run(ctx, rc, reqs)
	if err != nil {
		t.Fatal(err)
	}
	cfg := DefaultConfig()
	cfg.Workers, cfg.Engine = rc.Workers, rc.Fleet.Engine
	for _, mode := range rc.Modes {
		p, err := Run(cfg, mode, FromRequests(reqs), 1)
		if err != nil {
			t.Fatal(err)
		}
		m := live.Modes[mode]
		t.Logf("%s: hit rate sim %.3f, replay %.3f; TTFT mean sim %.0f ms, replay %.0f ms; p90 %.0f, %.0f",
			mode, p.HitRate, m.PrefixHitRate, p.TTFT.Mean, m.TTFT.Mean, p.TTFT.P90, m.TTFT.P90)
		if math.Abs(p.HitRate-m.PrefixHitRate) > 0.02 {
			t.Errorf("%s: hit rate %.3f in the sim, %.3f in the replay", mode, p.HitRate, m.PrefixHitRate)
		}
		if r := p.TTFT.Mean / m.TTFT.Mean; r < 0.1 || r > 1.15 {
			t.Errorf("%s: mean TTFT %.0f ms in the sim, %.0f in the replay", mode, p.TTFT.Mean, m.TTFT.Mean)
		}
	}
}
