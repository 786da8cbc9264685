package main

import (
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/kvrouter/kvrouter/core/sched"
	"github.com/kvrouter/kvrouter/lab/replay"
	"github.com/kvrouter/kvrouter/lab/trace"
	"github.com/kvrouter/kvrouter/lab/workload"
	"github.com/kvrouter/kvrouter/mocker/engine"
)

// allReplayModes is every policy worth comparing: kvrouter's kv mode, the
// peers' policies and the load-only baselines.
var allReplayModes = []string{
	string(sched.ModeKV), replay.DynamoKV,
	string(sched.ModeLLMDPrecise), string(sched.ModeSGLangCacheAware), string(sched.ModeGIEApproxPrefix),
	string(sched.ModeLeastLoaded), string(sched.ModePowerOfTwo), string(sched.ModeRoundRobin), string(sched.ModeRandom),
}

func newBenchReplayCmd() *cobra.Command {
	var (
		cfg         = replay.DefaultConfig()
		rf          = newRouterFlags()
		df          disaggFlags
		syn         = workload.DefaultSyntheticConfig()
		tracePath   string
		synthetic   bool
		modes       string
		maxRequests int
		strict      bool
		out         string
		quiet       bool
	)
	cmd := &cobra.Command{
		Use:   "replay",
		Short: "Replay a trace through the router in several routing modes and compare TTFT, latency and cache hits",
		Long: `For each mode of --modes, starts a fresh fleet of --workers simulated
engines (empty caches) and kvrouter's frontend in that mode, replays the
workload open-loop at its arrival times over HTTP (token-id prompts,
streamed), with the engines' KV events live on ZMQ, and records every
request's time to first token, inter-token latency, end-to-end latency,
output tokens, the worker chosen and the prefix-cache hits the engine
reported.

The workload is a Mooncake JSONL trace (--trace; --max-requests keeps the
first N) or a synthetic shared-prefix workload (--synthetic, see its flags).
Arrival times are divided by --arrival-speedup (more load) and, with the
engines running --speedup times faster than the timing model, by --speedup
(the same load in less wall time); latencies are reported in model time.

Modes: kv (kvrouter), dynamo-kv (kv with Dynamo's cost: no cache
affinity), llm-d-precise, sglang-cache-aware, gie-approx-prefix (the peers'
policies), least-loaded, power-of-two, round-robin, random; "all" runs them
all. Router flags (--router-temperature, ...) apply to every
mode. A mode may name its fleet layout and disaggregation options,
MODE[@N|@PpDd][+uncached=N][+no-reuse], so that one replay compares them:
kv@8 (8 aggregated engines), kv@4p4d (4 prefill and 4 decode engines,
served disaggregated), round-robin@4p4d, kv@4p4d+uncached=512 (conditional
disaggregation), kv@4p4d+no-reuse (decode routed as Dynamo does), kv+replicas=2 (two
router replicas on an embedded NATS plane with --router-replica-sync, the
engines registered by agents, requests sent to the replicas in turn;
kv+replicas=1 is the same plane with one router);
--prefill-workers and --decode-workers give the layout of modes that name
none. --target URL replays against a running OpenAI-compatible endpoint
instead (e.g. vLLM or a router in front of it); --target URL1,URL2 sends
the requests to each in turn.

Writes DIR/results.json, DIR/report.md, DIR/ttft_cdf.png,
DIR/worker_load.png, DIR/hit_rate.png and DIR/requests/<mode>.jsonl.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var progress io.Writer = cmd.ErrOrStderr()
			if quiet {
				progress = nil
			}
			rcfg, err := rf.config(cmd.Flags(), func(w string) { fmt.Fprintln(cmd.ErrOrStderr(), "warning:", w) })
			if err != nil {
				return err
			}
			cfg.Router, cfg.Progress = rcfg, progress
			if cfg.Disagg, err = df.config(rf.noAssumeReuse, rcfg.QueueThreshold, rf.mode); err != nil {
				return err
			}
			if (cfg.Prefill > 0) != (cfg.Decode > 0) || cfg.Prefill < 0 || cfg.Decode < 0 {
				return fmt.Errorf("--prefill-workers %d and --decode-workers %d: give both, or neither", cfg.Prefill, cfg.Decode)
			}
			if cfg.Modes, err = parseSetups(modes, cfg.Workers, cfg.Prefill, cfg.Decode); err != nil {
				return err
			}
			reqs, name, err := loadWorkload(tracePath, synthetic, syn, maxRequests, strict, cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			if out == "" {
				return fmt.Errorf("--out DIR is required")
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt)
			defer stop()
			if progress != nil {
				fmt.Fprintf(progress, "replaying %d requests of %s (span %.0f s, %.0f s per mode at arrival speedup %g and speedup %g)\n",
					len(reqs), name, workload.Span(reqs).Seconds(), workload.Span(reqs).Seconds()/cfg.ArrivalSpeedup/cfg.Speedup, cfg.ArrivalSpeedup, cfg.Speedup)
			}
			t0 := time.Now()
			res, err := replay.Run(ctx, cfg, reqs)
			if err != nil {
				return err
			}
			res.Config.Workload = name
			res.Config.Command = "kvrouter " + strings.Join(os.Args[1:], " ")
			res.Config.WallSeconds = time.Since(t0).Seconds()
			if err := replay.WriteReport(out, res); err != nil {
				return err
			}
			fmt.Fprint(cmd.OutOrStdout(), replay.Summary(res))
			fmt.Fprintf(cmd.OutOrStdout(), "\nreport: %s/report.md (%.0f s)\n", out, res.Config.WallSeconds)
			return nil
		},
	}
	f := cmd.Flags()
	rf.register(f)
	registerWorkloadFlags(f, "replay", &tracePath, &synthetic, &modes)
	f.IntVar(&cfg.Workers, "workers", cfg.Workers, "simulated engines per mode")
	f.IntVar(&cfg.Prefill, "prefill-workers", 0, "disaggregated fleet: prefill engines of the modes that name no layout (with --decode-workers)")
	f.IntVar(&cfg.Decode, "decode-workers", 0, "disaggregated fleet: decode engines of the modes that name no layout (with --prefill-workers)")
	df.register(f)
	f.Float64Var(&cfg.Speedup, "speedup", cfg.Speedup, "engines' speedup ratio (wall time = model time / speedup)")
	f.Float64Var(&cfg.ArrivalSpeedup, "arrival-speedup", cfg.ArrivalSpeedup, "divide the workload's arrival times by this (more load)")
	f.IntVar(&maxRequests, "max-requests", 0, "replay only the first N requests of the trace (0 = all)")
	f.Uint64Var(&cfg.Seed, "seed", cfg.Seed, "seed of the router's tie-breaks and of the synthetic workload")
	f.BoolVar(&cfg.SessionHeader, "session-header", false, "name each request's session in X-Dynamo-Session-ID (binding it to its first engine); with several routers a session's turns take them in turn, and the report counts the sessions whose turns went to more than one engine")
	f.StringVar(&cfg.Target, "target", "", "drive this OpenAI-compatible endpoint instead of spawned fleets; several, comma-separated, take the requests in turn (router replicas behind a round-robin client)")
	f.StringVar(&cfg.Model, "model", "", "model name to request (default: the fleet's, or the target's first)")
	f.BoolVar(&strict, "strict", false, "fail on a malformed trace line instead of skipping it")
	f.StringVar(&out, "out", "", "directory for results.json, report.md and the plots")
	f.BoolVar(&quiet, "quiet", false, "no progress on stderr")
	registerEngineFlags(f, &cfg.Fleet.Engine)
	f.DurationVar(&cfg.EngineMetricsInterval, "engine-metrics-interval", cfg.EngineMetricsInterval, "model-time interval of /metrics reads for modes scoring by engine load")
	registerSyntheticFlags(f, &syn)
	cmd.PreRun = func(cmd *cobra.Command, _ []string) { syn.Seed = cfg.Seed }
	return cmd
}

// parseSetups reads bench replay's --modes, whose modes may name a fleet
// layout (replay.Setup).
func parseSetups(s string, workers, prefill, decode int) ([]string, error) {
	if strings.TrimSpace(s) == "all" {
		return parseModes(s)
	}
	var out []string
	for _, part := range strings.Split(s, ",") {
		if part = strings.TrimSpace(part); part == "" {
			continue
		}
		if _, err := replay.ParseSetup(part, workers, prefill, decode); err != nil {
			return nil, err
		}
		out = append(out, part)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("--modes names no mode")
	}
	return out, nil
}

func parseModes(s string) ([]string, error) {
	if strings.TrimSpace(s) == "all" {
		return allReplayModes, nil
	}
	var out []string
	for _, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		if _, err := replay.ParseMode(part); err != nil {
			return nil, err
		}
		if part != replay.DynamoKV {
			part = strings.ToLower(part)
		}
		out = append(out, part)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("--modes names no mode")
	}
	return out, nil
}

// loadWorkload reads the trace (skipping malformed lines with a warning
// unless strict) or generates the synthetic workload.
func loadWorkload(path string, synthetic bool, syn workload.SyntheticConfig, max int, strict bool, warn io.Writer) ([]workload.Request, string, error) {
	switch {
	case synthetic && path != "":
		return nil, "", fmt.Errorf("give --trace or --synthetic, not both")
	case synthetic:
		if max > 0 {
			syn.Requests = max
		}
		reqs, err := workload.Synthetic(syn)
		name := fmt.Sprintf("synthetic (%d groups × %d system tokens, %d question and %d output tokens, %d turns, %g req/s)",
			syn.Groups, syn.SystemTokens, syn.QuestionTokens, syn.OutputTokens, syn.Turns, syn.Rate)
		if syn.Tenants > 0 {
			name = strings.TrimSuffix(name, ")") + fmt.Sprintf(", %d salted tenants)", syn.Tenants)
		}
		return reqs, name, err
	case path == "":
		return nil, "", fmt.Errorf("give --trace FILE or --synthetic")
	}
	tr, name, err := loadTrace(path, max, strict, warn)
	if err != nil {
		return nil, "", err
	}
	return workload.FromTrace(tr, max), name, nil
}

// loadTrace parses a Mooncake trace, skipping malformed lines with a
// warning unless strict, and names it as reports do.
func loadTrace(path string, max int, strict bool, warn io.Writer) (*trace.Trace, string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, "", err
	}
	defer f.Close()
	var skip func(int, error)
	if !strict {
		skip = func(line int, err error) { fmt.Fprintf(warn, "warning: %s: skipped: %v\n", path, err) }
	}
	tr, err := trace.ParseSkipping(f, skip)
	if err != nil {
		return nil, "", fmt.Errorf("%s: %w", path, err)
	}
	name := path
	if max > 0 && max < len(tr.Requests) {
		name = fmt.Sprintf("%s (first %d requests)", path, max)
	}
	return tr, name, nil
}

// registerWorkloadFlags binds the workload and the modes to run; verb is
// what the command does with them.
func registerWorkloadFlags(f *pflag.FlagSet, verb string, tracePath *string, synthetic *bool, modes *string) {
	f.StringVar(tracePath, "trace", "", "Mooncake JSONL trace to "+verb)
	f.BoolVar(synthetic, "synthetic", false, verb+" a generated shared-prefix workload instead of a trace")
	f.StringVar(modes, "modes", "kv,round-robin", `comma-separated routing modes, or "all"`)
}

// registerSyntheticFlags binds the synthetic workload's flags.
func registerSyntheticFlags(f *pflag.FlagSet, syn *workload.SyntheticConfig) {
	f.IntVar(&syn.Requests, "synthetic-requests", syn.Requests, "synthetic: requests")
	f.IntVar(&syn.Groups, "groups", syn.Groups, "synthetic: distinct system prompts")
	f.IntVar(&syn.SystemTokens, "system-tokens", syn.SystemTokens, "synthetic: tokens per system prompt")
	f.IntVar(&syn.QuestionTokens, "question-tokens", syn.QuestionTokens, "synthetic: new user tokens per turn")
	f.IntVar(&syn.OutputTokens, "output-tokens", syn.OutputTokens, "synthetic: output tokens per turn")
	f.Float64Var(&syn.Rate, "rate", syn.Rate, "synthetic: requests per second")
	f.IntVar(&syn.Turns, "turns", syn.Turns, "synthetic: turns per session")
	f.DurationVar(&syn.ThinkTime, "think-time", syn.ThinkTime, "synthetic: mean time between a session's turns")
	f.IntVar(&syn.Tenants, "tenants", syn.Tenants, "synthetic: tenants, each session one's, whose requests carry its cache_salt (0 = no salts)")
}

// registerEngineFlags binds the simulated engines' sizes.
func registerEngineFlags(f *pflag.FlagSet, e *engine.Config) {
	f.IntVar(&e.NumGPUBlocks, "num-gpu-blocks", e.NumGPUBlocks, "KV blocks per engine")
	f.IntVar(&e.MaxNumBatchedTokens, "max-num-batched-tokens", e.MaxNumBatchedTokens, "engines' token budget per step")
	f.IntVar(&e.MaxNumSeqs, "max-num-seqs", e.MaxNumSeqs, "engines' most running requests")
	registerKVCacheGroups(f, e)
	registerHostTier(f, e)
}
