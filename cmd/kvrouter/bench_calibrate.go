package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/spf13/cobra"

	"github.com/kvrouter/kvrouter/lab/replay"
	"github.com/kvrouter/kvrouter/lab/sim"
	"github.com/kvrouter/kvrouter/lab/workload"
)

func newBenchCalibrateCmd() *cobra.Command {
	var (
		cfg         = sim.CalibrateConfig{Replay: replay.DefaultConfig(), ArrivalSpeedups: []float64{4, 8}}
		rf          = newRouterFlags()
		syn         = workload.DefaultSyntheticConfig()
		tracePath   string
		synthetic   bool
		modes       string
		maxRequests int
		out         string
		asJSON      bool
		quiet       bool
	)
	cfg.Replay.Speedup = 2
	cmd := &cobra.Command{
		Use:   "calibrate",
		Short: "Check kvrouter sim against bench replay: the same workload live and simulated, TTFT and hit rate compared",
		Long: `Runs the workload through bench replay's live path (engines over HTTP,
KV events on ZMQ, wall time divided by --speedup) and through kvrouter
sim's loop, for each mode of --modes at each load of --arrival-speedup,
with the same engines and router configuration, and compares them: the sim
agrees when its mean and p90 TTFT are within 10 % of the replay's and its
prefix hit rate within 2 points. The live side adds its transport and
harness time (about 2 ms of wall time per request, times --speedup), so a
low --speedup calibrates more strictly and takes longer: the full
conversation trace at arrival speedup 4 takes 442 s per mode at --speedup 2 (the default).

Writes DIR/calibration.json and DIR/calibration.md; exits with an error
when any comparison disagrees.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			rcfg, err := rf.config(cmd.Flags(), func(w string) { fmt.Fprintln(cmd.ErrOrStderr(), "warning:", w) })
			if err != nil {
				return err
			}
			cfg.Replay.Router, cfg.Replay.Fleet.Engine.BlockSize = rcfg, rcfg.BlockSize
			if cfg.Replay.Modes, err = parseModes(modes); err != nil {
				return err
			}
			var res *sim.CalibrationResult
			err = runBench(cmd, quiet, asJSON, func(ctx context.Context, progress io.Writer) (*sim.CalibrationResult, error) {
				reqs, name, err := loadWorkload(tracePath, synthetic, syn, maxRequests, false, cmd.ErrOrStderr())
				if err != nil {
					return nil, err
				}
				fmt.Fprintf(progress, "calibrating on %d requests of %s: %v at arrival speedups %v, replay at speedup %g\n",
					len(reqs), name, cfg.Replay.Modes, cfg.ArrivalSpeedups, cfg.Replay.Speedup)
				if quiet {
					progress = nil
				}
				r, err := sim.Calibrate(ctx, cfg, reqs, progress)
				if r != nil {
					r.Workload, r.Command = name, "kvrouter "+strings.Join(os.Args[1:], " ")
				}
				res = r
				return r, err
			}, func(w io.Writer, r *sim.CalibrationResult) error {
				_, err := io.WriteString(w, sim.CalibrationTable(r))
				return err
			})
			if err != nil {
				return err
			}
			if out != "" {
				if err := writeCalibration(out, res); err != nil {
					return err
				}
			}
			if !res.Agrees {
				return fmt.Errorf("calibration: the sim and the replay disagree beyond 10 %% of TTFT or 2 points of hit rate")
			}
			return nil
		},
	}
	f := cmd.Flags()
	rf.register(f)
	registerWorkloadFlags(f, "calibrate on", &tracePath, &synthetic, &modes)
	f.IntVar(&cfg.Replay.Workers, "workers", cfg.Replay.Workers, "simulated engines")
	f.Float64Var(&cfg.Replay.Speedup, "speedup", cfg.Replay.Speedup, "the live engines' speedup ratio (wall time = model time / speedup)")
	f.Float64SliceVar(&cfg.ArrivalSpeedups, "arrival-speedup", cfg.ArrivalSpeedups, "loads to compare at: divide the workload's arrival times by each")
	f.IntVar(&maxRequests, "max-requests", 0, "use only the first N requests (0 = all)")
	f.Uint64Var(&cfg.Replay.Seed, "seed", cfg.Replay.Seed, "seed of the router's tie-breaks and of the synthetic workload")
	f.DurationVar(&cfg.Replay.EngineMetricsInterval, "engine-metrics-interval", cfg.Replay.EngineMetricsInterval, "model-time interval of engine-load reads for modes scoring by engine load")
	f.DurationVar(&cfg.KVEventDelay, "kv-event-delay", sim.DefaultKVEventDelay, "the sim's model time from an engine's step to its KV events' arrival")
	f.StringVar(&out, "out", "", "directory for calibration.json and calibration.md")
	f.BoolVar(&asJSON, "json", false, "print the result as JSON")
	f.BoolVar(&quiet, "quiet", false, "no progress on stderr")
	registerEngineFlags(f, &cfg.Replay.Fleet.Engine)
	registerSyntheticFlags(f, &syn)
	cmd.PreRun = func(cmd *cobra.Command, _ []string) { syn.Seed = cfg.Replay.Seed }
	return cmd
}

func writeCalibration(dir string, r *sim.CalibrationResult) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "calibration.json"), append(b, '\n'), 0o644); err != nil {
		return err
	}
	verdict := "The sim agrees with the replay at every point."
	if !r.Agrees {
		verdict = "The sim and the replay disagree at some points (see the verdict column)."
	}
	md := fmt.Sprintf("# kvrouter sim against bench replay\n\n```sh\n%s\n```\n\n%d requests of %s on %d engines, the replay's engines at speedup %g; latencies in model ms.\n\n%s\n%s\n",
		r.Command, r.Requests, r.Workload, r.Workers, r.Speedup, sim.CalibrationTable(r), verdict)
	return os.WriteFile(filepath.Join(dir, "calibration.md"), []byte(md), 0o644)
}
