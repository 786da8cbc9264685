package sim

import (
	"context"
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/lab/replay"
	"github.com/kvrouter/kvrouter/lab/workload"
)

// Calibration tolerances: the sim stands in for bench replay when, on the
// same workload, engines and router, they agree this closely.
const (
	CalibrationTTFTTolerance    = 0.10 // relative, on mean and p90 TTFT
	CalibrationHitRateTolerance = 0.02 // absolute, on the prefix hit rate
)

// CalibrateConfig is `kvrouter bench calibrate`: Replay says what the live
// side runs (its Modes, fleet, router and engine speedup); each of
// ArrivalSpeedups is run live and simulated.
type CalibrateConfig struct {
	Replay          replay.Config
	ArrivalSpeedups []float64
	KVEventDelay    time.Duration // the sim's; 0 = DefaultKVEventDelay
}

// CalibrationRow compares one mode at one load.
type CalibrationRow struct {
	Mode           string      `json:"mode"`
	ArrivalSpeedup float64     `json:"arrival_speedup"`
	SimTTFT        replay.Dist `json:"sim_ttft_ms"`
	ReplayTTFT     replay.Dist `json:"replay_ttft_ms"`
	SimHitRate     float64     `json:"sim_hit_rate"`
	ReplayHitRate  float64     `json:"replay_hit_rate"`
	ReplayErrors   int         `json:"replay_errors"`
	// ReplayDrift is how much slower than the timing model the replay's
	// engines ran (replay.ModeResult.EngineDrift): above
	// replay.DriftWarning the replay, not the sim, is off.
	ReplayDrift float64 `json:"replay_engine_drift"`
	// MeanDiff and P90Diff are (sim − replay) / replay; HitDiff is sim −
	// replay.
	MeanDiff float64 `json:"ttft_mean_diff"`
	P90Diff  float64 `json:"ttft_p90_diff"`
	HitDiff  float64 `json:"hit_rate_diff"`
	Agrees   bool    `json:"agrees"`
}

// CalibrationResult is calibration.json.
type CalibrationResult struct {
	Workload string           `json:"workload"`
	Requests int              `json:"requests"`
	Workers  int              `json:"workers"`
	Speedup  float64          `json:"replay_speedup"`
	Rows     []CalibrationRow `json:"rows"`
	Agrees   bool             `json:"agrees"`
	Command  string           `json:"command,omitempty"`
}

// Calibrate runs reqs through bench replay's live path and through the sim
// at each load, mode by mode, and compares them. Progress (replay's bar and
// one line per comparison) goes to progress, which may be nil.
func Calibrate(ctx context.Context, cfg CalibrateConfig, reqs []workload.Request, progress io.Writer) (*CalibrationResult, error) {
	if len(cfg.ArrivalSpeedups) == 0 || len(cfg.Replay.Modes) == 0 {
		return nil, fmt.Errorf("calibrate: need at least one mode and one arrival speedup")
	}
	sc := DefaultConfig()
	sc.Workers, sc.Engine, sc.Router, sc.Seed = cfg.Replay.Workers, cfg.Replay.Fleet.Engine, cfg.Replay.Router, cfg.Replay.Seed
	sc.EngineMetricsInterval = cfg.Replay.EngineMetricsInterval
	if cfg.KVEventDelay > 0 {
		sc.KVEventDelay = cfg.KVEventDelay
	}
	w := FromRequests(reqs)
	res := &CalibrationResult{Requests: len(reqs), Workers: cfg.Replay.Workers, Speedup: cfg.Replay.Speedup, Agrees: true}
	speedups := slices.Clone(cfg.ArrivalSpeedups)
	slices.Sort(speedups)
	for _, s := range speedups {
		rc := cfg.Replay
		rc.ArrivalSpeedup = s
		if progress != nil {
			rc.Progress = progress
		}
		live, err := replay.Run(ctx, rc, reqs)
		if err != nil {
			return nil, fmt.Errorf("replay at arrival speedup %g: %w", s, err)
		}
		for _, mode := range rc.Modes {
			p, err := Run(sc, mode, w, s)
			if err != nil {
				return nil, fmt.Errorf("sim of %s at arrival speedup %g: %w", mode, s, err)
			}
			m := live.Modes[mode]
			if m == nil {
				return nil, fmt.Errorf("replay has no result for mode %s", mode)
			}
			row := compareRow(mode, s, p, m)
			res.Agrees = res.Agrees && row.Agrees
			res.Rows = append(res.Rows, row)
			if progress != nil {
				fmt.Fprintf(progress, "%s ×%g: TTFT mean %.0f / %.0f ms (%+.1f %%), p90 %.0f / %.0f (%+.1f %%), hit rate %.3f / %.3f, replay engines %+.1f %% behind the model: %s\n",
					mode, s, p.TTFT.Mean, m.TTFT.Mean, 100*row.MeanDiff, p.TTFT.P90, m.TTFT.P90, 100*row.P90Diff,
					p.HitRate, m.PrefixHitRate, 100*m.EngineDrift, agreeWord(row.Agrees))
			}
		}
	}
	return res, nil
}

func compareRow(mode string, speedup float64, p Point, m *replay.ModeResult) CalibrationRow {
	row := CalibrationRow{
		Mode: mode, ArrivalSpeedup: speedup, SimTTFT: p.TTFT, ReplayTTFT: m.TTFT,
		SimHitRate: p.HitRate, ReplayHitRate: m.PrefixHitRate, ReplayErrors: m.Errors, ReplayDrift: m.EngineDrift,
		MeanDiff: relDiff(p.TTFT.Mean, m.TTFT.Mean), P90Diff: relDiff(p.TTFT.P90, m.TTFT.P90),
		HitDiff: p.HitRate - m.PrefixHitRate,
	}
	row.Agrees = math.Abs(row.MeanDiff) <= CalibrationTTFTTolerance && math.Abs(row.P90Diff) <= CalibrationTTFTTolerance &&
		math.Abs(row.HitDiff) <= CalibrationHitRateTolerance && m.Errors == 0 && p.Errors == 0
	return row
}

func relDiff(sim, live float64) float64 {
	if live == 0 {
		if sim == 0 {
			return 0
		}
		return math.Inf(1)
	}
	return (sim - live) / live
}

func agreeWord(ok bool) string {
	if ok {
		return "agree"
	}
	return "DISAGREE"
}

// CalibrationTable is the comparison as a markdown table.
func CalibrationTable(r *CalibrationResult) string {
	var b strings.Builder
	b.WriteString("| mode | load | TTFT mean sim / replay (ms) | p90 sim / replay (ms) | hit rate sim / replay | replay engines' lag | verdict |\n")
	b.WriteString("|---|---|---|---|---|---|---|\n")
	for _, row := range r.Rows {
		fmt.Fprintf(&b, "| %s | ×%g | %.0f / %.0f (%+.1f %%) | %.0f / %.0f (%+.1f %%) | %.3f / %.3f (%+.1f pts) | %+.1f %% | %s |\n",
			row.Mode, row.ArrivalSpeedup, row.SimTTFT.Mean, row.ReplayTTFT.Mean, 100*row.MeanDiff,
			row.SimTTFT.P90, row.ReplayTTFT.P90, 100*row.P90Diff, row.SimHitRate, row.ReplayHitRate, 100*row.HitDiff, 100*row.ReplayDrift, agreeWord(row.Agrees))
	}
	return b.String()
}
