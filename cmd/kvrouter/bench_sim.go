package main

import (
	"context"
	"fmt"
	"io"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/kvrouter/kvrouter/lab/sim"
	"github.com/kvrouter/kvrouter/lab/workload"
)

// simBenchResult is one timed run of the simulator.
type simBenchResult struct {
	Workload       string  `json:"workload"`
	Requests       int     `json:"requests"`
	Workers        int     `json:"workers"`
	Mode           string  `json:"mode"`
	ArrivalSpeedup float64 `json:"arrival_speedup"`
	ModelS         float64 `json:"model_s"`
	WallS          float64 `json:"wall_s"`
	// Speed is model time per wall time: how much faster than real time.
	Speed float64 `json:"speed"`
	// CPUS is the process's user and system time during the run.
	CPUS float64 `json:"cpu_s"`
	// PeakRSSMB is the process's peak resident memory so far (getrusage),
	// which the run dominates: loading the workload takes little.
	PeakRSSMB float64 `json:"peak_rss_mb"`
	TTFTP90MS float64 `json:"ttft_p90_ms"`
	HitRate   float64 `json:"hit_rate"`
}

func newBenchSimCmd() *cobra.Command {
	var (
		cfg         = sim.DefaultConfig()
		rf          = newRouterFlags()
		syn         = workload.DefaultSyntheticConfig()
		tracePath   string
		synthetic   bool
		mode        string
		speedup     float64
		maxRequests int
		asJSON      bool
		quiet       bool
		cpuProfile  string
	)
	cmd := &cobra.Command{
		Use:   "sim",
		Short: "Time one run of kvrouter sim: model time per wall time, CPU and peak memory",
		Long: `Runs the workload once through the simulator (kvrouter sim's loop, on one
goroutine, without the sweep's ceiling pass or report) in --mode at
--arrival-speedup, and reports the model time simulated, the wall time it
took, their ratio (how much faster than real time), the process's CPU time
and peak RSS. The full conversation trace on 8 engines in kv mode at
arrival speedup 1 is the reference figure of docs/benchmarks.md.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			rcfg, err := rf.config(cmd.Flags(), func(w string) { fmt.Fprintln(cmd.ErrOrStderr(), "warning:", w) })
			if err != nil {
				return err
			}
			cfg.Router, cfg.Engine.BlockSize = rcfg, rcfg.BlockSize
			if err := disaggConfig(cmd.Flags(), &cfg, rf.noAssumeReuse); err != nil {
				return err
			}
			syn.Seed = cfg.Seed
			return runBench(cmd, quiet, asJSON, func(_ context.Context, progress io.Writer) (simBenchResult, error) {
				w, name, err := simWorkload(tracePath, synthetic, syn, maxRequests, false, false, progress)
				if err != nil {
					return simBenchResult{}, err
				}
				fmt.Fprintf(progress, "simulating %d requests of %s in %s at arrival speedup %g on %d engines\n", w.Len(), name, mode, speedup, cfg.Workers)
				stopProfile, err := startCPUProfile(cpuProfile)
				if err != nil {
					return simBenchResult{}, err
				}
				cpu0 := cpuTime()
				t0 := time.Now()
				p, err := sim.Run(cfg, mode, w, speedup)
				stopProfile()
				if err != nil {
					return simBenchResult{}, err
				}
				wall := time.Since(t0).Seconds()
				res := simBenchResult{
					Workload: name, Requests: w.Len(), Workers: cfg.Workers, Mode: mode, ArrivalSpeedup: speedup,
					ModelS: p.ModelS, WallS: wall, Speed: p.ModelS / wall, CPUS: (cpuTime() - cpu0).Seconds(),
					PeakRSSMB: peakRSSMB(), TTFTP90MS: p.TTFT.P90, HitRate: p.HitRate,
				}
				return res, nil
			}, func(out io.Writer, r simBenchResult) error {
				tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
				fmt.Fprintf(tw, "requests\t%d (%s)\n", r.Requests, r.Workload)
				fmt.Fprintf(tw, "model time\t%.1f s\n", r.ModelS)
				fmt.Fprintf(tw, "wall time\t%.2f s\n", r.WallS)
				fmt.Fprintf(tw, "speed\t%.0f× real time\n", r.Speed)
				fmt.Fprintf(tw, "CPU time\t%.2f s\n", r.CPUS)
				fmt.Fprintf(tw, "peak RSS\t%.0f MB\n", r.PeakRSSMB)
				fmt.Fprintf(tw, "TTFT p90\t%.0f ms\n", r.TTFTP90MS)
				fmt.Fprintf(tw, "hit rate\t%.3f\n", r.HitRate)
				return tw.Flush()
			})
		},
	}
	f := cmd.Flags()
	rf.register(f)
	f.StringVar(&tracePath, "trace", "", "Mooncake JSONL trace to simulate")
	f.BoolVar(&synthetic, "synthetic", false, "simulate a generated shared-prefix workload instead of a trace")
	f.StringVar(&mode, "mode", "kv", "routing mode (as --modes of kvrouter sim names them)")
	f.Float64Var(&speedup, "arrival-speedup", 1, "divide the workload's arrival times by this")
	f.IntVar(&maxRequests, "max-requests", 0, "simulate only the first N requests (0 = all)")
	f.IntVar(&cfg.Workers, "workers", cfg.Workers, "simulated engines")
	f.Uint64Var(&cfg.Seed, "seed", cfg.Seed, "seed of the router's tie-breaks and of the synthetic workload")
	registerEngineFlags(f, &cfg.Engine)
	registerSimDisaggFlags(f, &cfg.Disagg)
	registerSyntheticFlags(f, &syn)
	f.BoolVar(&asJSON, "json", false, "print the result as JSON")
	f.BoolVar(&quiet, "quiet", false, "no progress lines on stderr")
	f.StringVar(&cpuProfile, "cpuprofile", "", "write a CPU profile of the run to this file")
	return cmd
}

// cpuTime is the process's user and system time so far.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// peakRSSMB is the process's peak resident set (Linux reports KiB).
func peakRSSMB() float64 {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return float64(ru.Maxrss) / 1024
}
