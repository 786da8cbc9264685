package main

import (
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/kvrouter/kvrouter/lab/sim"
	"github.com/kvrouter/kvrouter/lab/workload"
)

func newSimCmd() *cobra.Command {
	var (
		cfg         = sim.SweepConfig{Sim: sim.DefaultConfig(), SLOTTFTP90: 2 * time.Second, BisectSteps: sim.DefaultBisectSteps}
		rf          = newRouterFlags()
		syn         = workload.DefaultSyntheticConfig()
		agentic     = workload.DefaultAgenticConfig()
		kind        string
		tracePath   string
		synthetic   bool
		modes       string
		maxRequests int
		spreadBatch bool
		strict      bool
		out         string
		asJSON      bool
		quiet       bool
		cpuProfile  string
		workers     []int
		replicas    int
		spread      string
		syncDelay   = replicaSyncDelay{}
	)
	cmd := &cobra.Command{
		Use:   "sim",
		Short: "Simulate the router and its engines in virtual time: latency, hit rate and goodput per mode across loads",
		Long: `Replays a workload through kvrouter's router and the mocker's engine core
in virtual time, in one single-threaded event loop per run: the same code
as kvrouter serve in front of kvrouter mocker engines, without sockets or
wall-clock waits, so a trace that takes an hour to replay takes seconds.

The workload is a Mooncake JSONL trace (--trace; its prompts are built as
they are sent), the synthetic shared-prefix sessions of bench replay
(--synthetic, or --workload synthetic) or multi-turn agent sessions
(--workload agentic: long contexts growing by a tool call and its result
every turn; closed loop: a turn is sent --tool-time after the answer to the
one before, and --arrival-speedup speeds up only the sessions' starts; see
the --agent* and --tool* flags).
--max-requests keeps the first N requests.

For each mode of --modes (as bench replay names them), and each arrival
speedup of --arrival-speedup (the workload's arrival times are divided by
it: more load), runs the workload on a fresh fleet of --workers engines
(several, as in --workers 4,8,16, repeat the sweep on each fleet size),
then bisects between the tested loads for the mode's goodput: the highest
arrival rate, in requests per second of model time, at which p90 TTFT
stays within --slo-ttft-p90 (and p90 inter-token latency within
--slo-itl-p90, if given). A run's rate is what it offered (its requests
over their arrival span), and the goodput is the highest rate of a run
within the SLO at or below the bisected load: closed-loop sessions past
their knee offer fewer requests a second as the speedup grows. Modes run
in parallel. The report adds the prefill bound: the rate that would
saturate the fleet with the prompt tokens one infinite cache misses, which
no policy's goodput can reach.

--prefill-workers P --decode-workers D simulate a disaggregated fleet
instead: P prefill and D decode engines, served as kvrouter serve serves
them (conditional disaggregation with --disagg-min-uncached-tokens, Dynamo's
decode routing with --no-router-assume-kv-reuse); a decode engine pulls the
prompt blocks it lacks in --kv-bytes-per-token × tokens ÷
--kv-transfer-bandwidth of model time. The report adds where prompts were
prefilled, the blocks and bytes pulled, and prefill against total TTFT.

KV events reach the router --kv-event-delay after the step that made them;
the peers' policies read engine load every --engine-metrics-interval.
--router-replicas R runs R router replicas instead of one, as serve runs
them behind a load balancer, requests spread over them by --replica-spread
(request: each to the next in turn; burst: the requests of one instant to
one replica; session: by a hash of the session): each indexes
every engine's KV events and learns the others' bookings
--replica-sync-delay after they were made, through the messages
--router-replica-sync sends over NATS (off: replicas without sync). The
report adds the share of their decisions a single router, seeing the same
engines and every booking at once, rates cheapest (--router-replicas 1
measures one router so: every decision).

Router flags are serve's. The same inputs and --seed give the same
results.json, but for wall_s.

Writes DIR/results.json, DIR/report.md, DIR/goodput.png,
DIR/ttft_vs_load.png, DIR/itl_vs_load.png, DIR/hit_rate_vs_load.png and,
over several fleet sizes, DIR/goodput_vs_workers.png (results.json's
modes.<mode> is then the first size's, modes.<mode>.by_workers every
size's).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			rcfg, err := rf.config(cmd.Flags(), func(w string) { fmt.Fprintln(cmd.ErrOrStderr(), "warning:", w) })
			if err != nil {
				return err
			}
			// One block size for engines and router: the sim's engines
			// are configured here, not discovered.
			cfg.Sim.Router, cfg.Sim.Engine.BlockSize = rcfg, rcfg.BlockSize
			if cfg.Modes, err = parseModes(modes); err != nil {
				return err
			}
			for _, n := range workers {
				if n < 1 {
					return fmt.Errorf("--workers %d: want at least one engine", n)
				}
			}
			cfg.Sim.Workers = workers[0]
			if len(workers) > 1 {
				cfg.WorkerCounts = workers
			}
			if len(cfg.Sim.Specs) > 0 {
				if len(workers) > 1 {
					return fmt.Errorf("--fleet sizes the fleet: it cannot sweep --workers %v", workers)
				}
				if err := fleetCount(cmd.Flags(), "workers", cfg.Sim.Specs, &cfg.Sim.Workers); err != nil {
					return err
				}
			}
			if err := disaggConfig(cmd.Flags(), &cfg.Sim, rf.noAssumeReuse); err != nil {
				return err
			}
			if err := replicasConfig(cmd.Flags(), replicas, syncDelay, spread, &cfg.Sim); err != nil {
				return err
			}
			if out == "" && !asJSON {
				return fmt.Errorf("--out DIR (or --json) is required")
			}
			switch kind {
			case "", "trace":
			case "synthetic":
				synthetic = true
			case "agentic":
				if tracePath != "" || synthetic {
					return fmt.Errorf("give --trace, --synthetic or --workload agentic, not two")
				}
			default:
				return fmt.Errorf("--workload %q: want trace, synthetic or agentic", kind)
			}
			var (
				w    sim.Workload
				name string
			)
			if spreadBatch && (kind == "agentic" || synthetic) {
				return fmt.Errorf("--trace-spread-batches spaces a trace's batches: give --trace")
			}
			if kind == "agentic" {
				w, name, err = agenticWorkload(agentic, maxRequests)
			} else {
				w, name, err = simWorkload(tracePath, synthetic, syn, maxRequests, spreadBatch, strict, cmd.ErrOrStderr())
			}
			if err != nil {
				return err
			}
			if !quiet {
				cfg.Progress = func(line string) { fmt.Fprintln(cmd.ErrOrStderr(), line) }
				fmt.Fprintf(cmd.ErrOrStderr(), "simulating %d requests of %s (span %.0f s) in %d modes at arrival speedups %v\n",
					w.Len(), name, sim.Span(w).Seconds(), len(cfg.Modes), cfg.ArrivalSpeedups)
			}
			stopProfile, err := startCPUProfile(cpuProfile)
			if err != nil {
				return err
			}
			res, err := sim.Sweep(cfg, w)
			stopProfile()
			if err != nil {
				return err
			}
			res.Config.Workload = name
			res.Config.Command = "kvrouter " + strings.Join(os.Args[1:], " ")
			if out != "" {
				if err := sim.WriteReport(out, res); err != nil {
					return err
				}
			}
			if asJSON {
				b, err := sim.JSON(res)
				if err != nil {
					return err
				}
				_, err = cmd.OutOrStdout().Write(b)
				return err
			}
			fmt.Fprint(cmd.OutOrStdout(), goodputSummary(res))
			if b := res.Config.PrefillBoundRPS; b > 0 {
				fmt.Fprintf(cmd.OutOrStdout(), "prefill bound: no policy sustains more than %.1f req/s on %d engines\n", b, res.Config.Workers)
			}
			if b := res.Config.EngineBoundRPS; b > 0 {
				fmt.Fprintf(cmd.OutOrStdout(), "engine bound (decode steps charged too): no policy sustains more than %.1f req/s\n", b)
			}
			if w := res.BurstWarning(); w != "" {
				fmt.Fprintf(cmd.ErrOrStderr(), "warning: %s\n", w)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "\nreport: %s/report.md (%.0f s of model time in %.1f s)\n", out, res.ModelS, res.WallS)
			return nil
		},
	}
	f := cmd.Flags()
	rf.register(f)
	registerWorkloadFlags(f, "simulate", &tracePath, &synthetic, &modes)
	f.IntSliceVar(&workers, "workers", []int{cfg.Sim.Workers}, "simulated engines; several (4,8,16) sweep the fleet size")
	registerFleetFlag(f, &cfg.Sim.Specs)
	f.IntVar(&cfg.Sim.DPSize, "data-parallel-size", 1, "data-parallel ranks per engine, routed to separately")
	f.Float64SliceVar(&cfg.ArrivalSpeedups, "arrival-speedup", []float64{1, 2, 4, 8, 12, 16}, "loads to run: divide the workload's arrival times by each")
	f.DurationVar(&cfg.SLOTTFTP90, "slo-ttft-p90", cfg.SLOTTFTP90, "goodput objective: p90 time to first token (model time)")
	f.DurationVar(&cfg.SLOITLP90, "slo-itl-p90", 0, "goodput objective: p90 inter-token latency (model time); 0 = none")
	f.IntVar(&cfg.BisectSteps, "bisect-steps", cfg.BisectSteps, "runs that refine each mode's goodput, each halving the interval")
	f.IntVar(&cfg.Parallel, "parallel", 0, "runs simulated at once (0 = one per core); the results are the same for any value")
	f.DurationVar(&cfg.Sim.KVEventDelay, "kv-event-delay", cfg.Sim.KVEventDelay, "model time from an engine's step to its KV events' arrival at the router")
	f.DurationVar(&cfg.Sim.EngineMetricsInterval, "engine-metrics-interval", cfg.Sim.EngineMetricsInterval, "model-time interval of engine-load reads for modes scoring by engine load")
	f.IntVar(&maxRequests, "max-requests", 0, "simulate only the first N requests (0 = all)")
	f.BoolVar(&spreadBatch, "trace-spread-batches", false, "trace: space the requests that share one timestamp evenly until the next timestamp, instead of sending each such batch at one instant (traces that log arrivals in batches)")
	f.BoolVar(&cfg.Sim.IgnoreCacheSalt, "ignore-cache-salt", false, "the router ignores requests' cache_salt and the salts in KV events (keys blocks by tokens alone); the engines still cache each salt apart")
	f.BoolVar(&cfg.Sim.IgnoreLowerTiers, "ignore-lower-tiers", false, "the router never hears of the engines' host tier (--num-cpu-blocks): device overlaps only, as kvrouter before storage tiers; the engines still load their host hits")
	f.BoolVar(&cfg.Sim.SpeculativePrefill, "speculative-prefill", false, "session turns carry agent_hints.speculative_prefill: when a turn ends, the router prefills the next turn's prefix (prompt and answer) on the same engine with one output token, booked as load")
	f.Uint64Var(&cfg.Sim.Seed, "seed", cfg.Sim.Seed, "seed of the router's tie-breaks and of the synthetic workload")
	f.BoolVar(&strict, "strict", false, "fail on a malformed trace line instead of skipping it")
	f.StringVar(&out, "out", "", "directory for results.json, report.md and the plots")
	f.BoolVar(&asJSON, "json", false, "print results.json to stdout")
	f.BoolVar(&quiet, "quiet", false, "no progress on stderr")
	f.StringVar(&cpuProfile, "cpuprofile", "", "write a CPU profile of the sweep to this file (go tool pprof)")
	f.IntVar(&replicas, "router-replicas", 1, "router replicas, requests sent to them in turn; with it, the report compares their decisions with a single router's")
	f.StringVar(&spread, "replica-spread", string(sim.SpreadRequest), "how the load balancer in front of the replicas spreads requests: request (each to the next replica in turn), burst (the requests of one instant to one replica, as one client's connection), session (a hash of the session)")
	f.Var(&syncDelay, "replica-sync-delay", "model time for a replica's booking to reach the other replicas (the NATS replica sync); off = replicas without sync")
	registerEngineFlags(f, &cfg.Sim.Engine)
	registerSimDisaggFlags(f, &cfg.Sim.Disagg)
	registerSyntheticFlags(f, &syn)
	f.StringVar(&kind, "workload", "", "workload kind: trace (--trace), synthetic or agentic")
	f.IntVar(&agentic.Requests, "agentic-requests", agentic.Requests, "agentic: requests (all turns of all sessions)")
	f.IntVar(&agentic.Agents, "agents", agentic.Agents, "agentic: agent kinds, each with its own system prompt and tools")
	f.IntVar(&agentic.SystemTokens, "agent-system-tokens", agentic.SystemTokens, "agentic: tokens of each kind's system prompt and tool definitions")
	f.IntVar(&agentic.TaskTokens, "task-tokens", agentic.TaskTokens, "agentic: tokens of a session's task")
	f.IntVar(&agentic.MinTurns, "min-turns", agentic.MinTurns, "agentic: fewest model calls per session")
	f.IntVar(&agentic.MaxTurns, "max-turns", agentic.MaxTurns, "agentic: most model calls per session")
	f.IntVar(&agentic.ToolCallTokens, "tool-call-tokens", agentic.ToolCallTokens, "agentic: tokens generated per turn (the tool call)")
	f.IntVar(&agentic.ToolResultTokens, "tool-result-tokens", agentic.ToolResultTokens, "agentic: mean tokens of a tool's result (exponential, capped at 8×)")
	f.Float64Var(&agentic.Rate, "agentic-rate", agentic.Rate, "agentic: sessions start at this many requests per second ÷ the mean turns (before --arrival-speedup)")
	f.DurationVar(&agentic.ThinkTime, "tool-time", agentic.ThinkTime, "agentic: mean time from a turn's answer to the session's next call (the tool's run; not sped up)")
	cmd.PreRun = func(cmd *cobra.Command, _ []string) { syn.Seed, agentic.Seed = cfg.Sim.Seed, cfg.Sim.Seed }
	return cmd
}

// registerSimDisaggFlags binds a simulated disaggregated fleet: serve's
// --disagg-min-uncached-tokens and the mocker's KV transfer flags.
func registerSimDisaggFlags(f *pflag.FlagSet, d *sim.Disagg) {
	f.IntVar(&d.PrefillWorkers, "prefill-workers", 0, "disaggregated fleet: prefill engines (with --decode-workers, in place of --workers)")
	f.IntVar(&d.DecodeWorkers, "decode-workers", 0, "disaggregated fleet: decode engines (with --prefill-workers)")
	f.IntVar(&d.MinUncachedTokens, "disagg-min-uncached-tokens", defaultDisaggMinUncachedTokens,
		"conditional disaggregation: prefill on the decode engine itself when it lacks fewer than this many of the prompt's tokens; 0 = always on a prefill engine")
	f.DurationVar(&d.PrefillTimeout, "disagg-prefill-timeout", sim.DefaultPrefillTimeout,
		"a prefill that has not answered this long after its request's arrival (model time) is given up and the decode engine prefills")
	f.IntVar(&d.KVBytesPerToken, "kv-bytes-per-token", d.KVBytesPerToken, "KV of one token over all layers, in bytes (the default is Llama-3.1-8B in bf16)")
	f.Float64Var(&d.KVTransferBandwidth, "kv-transfer-bandwidth", d.KVTransferBandwidth, "bandwidth of the link KV blocks cross between engines, bytes per second (model time)")
}

// disaggConfig checks the disaggregated fleet's flags; noAssumeReuse is
// --no-router-assume-kv-reuse, which also routes decode as Dynamo does.
func disaggConfig(f *pflag.FlagSet, c *sim.Config, noAssumeReuse bool) error {
	d := &c.Disagg
	d.NoAssumeKVReuse = noAssumeReuse
	if !d.Enabled() {
		return nil
	}
	if d.PrefillWorkers < 1 || d.DecodeWorkers < 1 {
		return fmt.Errorf("--prefill-workers %d --decode-workers %d: a disaggregated fleet needs both", d.PrefillWorkers, d.DecodeWorkers)
	}
	if f.Changed("workers") || f.Changed("fleet") {
		return fmt.Errorf("give --workers or --fleet (aggregated) or --prefill-workers and --decode-workers, not both")
	}
	c.Workers = d.PrefillWorkers + d.DecodeWorkers
	return nil
}

// simWorkload is the trace, its prompts built as they are sent, or the
// synthetic workload.
func simWorkload(path string, synthetic bool, syn workload.SyntheticConfig, max int, spreadBatches, strict bool, warn io.Writer) (sim.Workload, string, error) {
	if synthetic || path == "" {
		reqs, name, err := loadWorkload(path, synthetic, syn, max, strict, warn)
		if err != nil {
			return nil, "", err
		}
		return sim.FromRequests(reqs), name, nil
	}
	tr, name, err := loadTrace(path, max, strict, warn)
	if err != nil {
		return nil, "", err
	}
	w, err := sim.FromTrace(tr, max)
	if err == nil && spreadBatches {
		w.SpreadBatches()
	}
	return w, name, err
}

func agenticWorkload(c workload.AgenticConfig, max int) (sim.Workload, string, error) {
	if max > 0 {
		c.Requests = max
	}
	reqs, err := workload.Agentic(c)
	name := fmt.Sprintf("agentic (%d agent kinds × %d system tokens, %d task tokens, %d–%d turns of %d tool-call and ~%d tool-result tokens, %g req/s, %v between turns)",
		c.Agents, c.SystemTokens, c.TaskTokens, c.MinTurns, c.MaxTurns, c.ToolCallTokens, c.ToolResultTokens, c.Rate, c.ThinkTime)
	return sim.FromRequests(reqs), name, err
}

// goodputSummary is a one-line-per-mode table for the terminal.
func goodputSummary(res *sim.Results) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%-20s %14s %10s %s\n", "mode", "goodput req/s", "speedup", "TTFT p90 (ms) per tested speedup")
	for _, name := range res.Order {
		m := res.Modes[name]
		var p90 []string
		for _, p := range m.Points {
			p90 = append(p90, fmt.Sprintf("×%g %.0f", p.ArrivalSpeedup, p.TTFT.P90))
		}
		g := fmt.Sprintf("%.2f", m.GoodputRPS)
		if m.GoodputBound != "" {
			g = "≥" + g
		}
		fmt.Fprintf(&b, "%-20s %14s %10.3g %s\n", name, g, m.GoodputArrivalSpeedup, strings.Join(p90, ", "))
		var same []string
		for _, p := range m.Points {
			if r := p.Replicas; r != nil && r.Decisions > 0 {
				same = append(same, fmt.Sprintf("×%g %.1f%%", p.ArrivalSpeedup, 100*r.IdenticalShare))
			}
		}
		if len(same) > 0 {
			fmt.Fprintf(&b, "  decisions a single router makes, per tested speedup: %s\n", strings.Join(same, ", "))
		}
		for _, f := range m.ByWorkers {
			bound := ""
			if f.GoodputBound != "" {
				bound = "≥"
			}
			fmt.Fprintf(&b, "  %4d workers %20s req/s at ×%.3g\n", f.Workers, bound+fmt.Sprintf("%.2f", f.GoodputRPS), f.GoodputArrivalSpeedup)
		}
	}
	return b.String()
}

// replicaSyncDelay is --replica-sync-delay: a duration, or off.
type replicaSyncDelay struct {
	d   time.Duration
	off bool
}

func (v *replicaSyncDelay) String() string {
	if v.off {
		return "off"
	}
	return v.d.String()
}

func (v *replicaSyncDelay) Set(s string) error {
	if strings.EqualFold(strings.TrimSpace(s), "off") {
		*v = replicaSyncDelay{off: true}
		return nil
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return fmt.Errorf("want a duration (10ms) or off")
	}
	if d < 0 {
		return fmt.Errorf("negative delay %v", d)
	}
	*v = replicaSyncDelay{d: d}
	return nil
}

func (v *replicaSyncDelay) Type() string { return "duration|off" }

// replicasConfig reads --router-replicas and --replica-sync-delay: the
// default, one router, is not measured against one.
func replicasConfig(f *pflag.FlagSet, n int, delay replicaSyncDelay, spread string, c *sim.Config) error {
	if !f.Changed("router-replicas") {
		for _, name := range []string{"replica-sync-delay", "replica-spread"} {
			if f.Changed(name) {
				return fmt.Errorf("--%s is for --router-replicas", name)
			}
		}
		return nil
	}
	sp, err := sim.ParseSpread(spread)
	if err != nil {
		return fmt.Errorf("--replica-spread: %w", err)
	}
	if n < 1 {
		return fmt.Errorf("--router-replicas %d: want at least one", n)
	}
	if c.Disagg.Enabled() && n > 1 {
		return fmt.Errorf("--router-replicas is simulated on aggregated fleets, not --prefill-workers/--decode-workers")
	}
	c.Replicas = sim.Replicas{Count: n, SyncDelay: delay.d, NoSync: delay.off, Spread: sp}
	return nil
}
