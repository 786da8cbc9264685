package main

import (
	"context"
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/kvrouter/kvrouter/lab/bench"
)

func newBenchRecoveryCmd() *cobra.Command {
	var (
		cfg    = bench.DefaultRecoveryConfig()
		noDump bool
		asJSON bool
		quiet  bool
	)
	cmd := &cobra.Command{
		Use:   "recovery",
		Short: "Measure how fast a restarted router learns an engine's cache again",
		Long: `Starts one simulated engine (--speedup, --num-gpu-blocks, a replay ring of
--kv-events-buffer-steps batches) and a router in front of it, and keeps
--concurrency clients sending completions through the router: each prompt is
one of --prefixes shared prefixes of --prefix-tokens tokens plus unique
tokens. After --traffic, and once the engine's replay ring no longer holds
its first batch, the router is replaced by a new one that knows nothing,
and the clients move to it. Every --sample the engine is paused between two
steps, the new router is given time to apply every batch published so far,
and its blocks for the engine are compared with the engine's own cache, tier
by tier (a block must be on the same storage tiers in both), for
--observe. With --no-dump the router may not ask the engine for its
cache (as with vLLM, which has no such call) and must rebuild from the
events and the traffic it routes.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cfg.Dump = !noDump
			return runBench(cmd, quiet, asJSON, func(ctx context.Context, progress io.Writer) (bench.RecoveryResult, error) {
				return bench.RunRecovery(ctx, cfg, progress)
			}, func(out io.Writer, res bench.RecoveryResult) error {
				tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
				fmt.Fprintf(tw, "engine dump\t%v\n", res.Dump)
				fmt.Fprintf(tw, "batches published at the restart\t%d (ring from %d)\n", res.BatchesAtRestart, res.OldestAtRestart)
				if res.ConvergedAfterSec >= 0 {
					fmt.Fprintf(tw, "router blocks == engine blocks after\t%.1f s\n", res.ConvergedAfterSec)
					fmt.Fprintf(tw, "later samples still equal\t%.0f %%\n", 100*res.EqualAfterConverged)
				} else {
					fmt.Fprintf(tw, "router blocks == engine blocks after\tnever within %v\n", cfg.Observe)
				}
				fmt.Fprintf(tw, "engine blocks known at the end (each tier)\t%.2f %%\n", 100*res.FinalCoverage)
				if n := len(res.Samples); n > 0 {
					last := res.Samples[n-1]
					fmt.Fprintf(tw, "lower-tier blocks at the end, engine / router\t%d / %d\n", last.EngineLowerBlocks, last.RouterLowerBlocks)
				}
				fmt.Fprintf(tw, "requests after the restart (errors)\t%d (%d)\n", res.RequestsAfter, res.Errors)
				fmt.Fprintf(tw, "events re-anchored / refused\t%d / %d\n", res.Reanchored, res.Refused)
				fmt.Fprintf(tw, "blocks inferred\t%d\n", res.BlocksInferred)
				fmt.Fprintf(tw, "dumps loaded\t%d\n", res.Dumps)
				return tw.Flush()
			})
		},
	}
	f := cmd.Flags()
	f.Float64Var(&cfg.Speedup, "speedup", cfg.Speedup, "speedup ratio of the engine")
	f.IntVar(&cfg.Blocks, "num-gpu-blocks", cfg.Blocks, "KV blocks of the engine")
	f.IntVar(&cfg.BufferSteps, "kv-events-buffer-steps", cfg.BufferSteps, "KV-event batches the engine keeps for replay")
	f.IntVar(&cfg.Prefixes, "prefixes", cfg.Prefixes, "distinct shared prompt prefixes")
	f.IntVar(&cfg.PrefixTokens, "prefix-tokens", cfg.PrefixTokens, "tokens per shared prefix")
	f.IntVar(&cfg.MinUser, "min-user-tokens", cfg.MinUser, "fewest unique prompt tokens per request")
	f.IntVar(&cfg.MaxUser, "max-user-tokens", cfg.MaxUser, "most unique prompt tokens per request")
	f.IntVar(&cfg.MinOutput, "min-output-tokens", cfg.MinOutput, "smallest max_tokens")
	f.IntVar(&cfg.MaxOutput, "max-output-tokens", cfg.MaxOutput, "largest max_tokens")
	f.IntVar(&cfg.Concurrency, "concurrency", cfg.Concurrency, "clients sending back to back")
	f.DurationVar(&cfg.Traffic, "traffic", cfg.Traffic, "traffic through the first router before the restart")
	f.DurationVar(&cfg.Observe, "observe", cfg.Observe, "how long to compare after the restart")
	f.DurationVar(&cfg.Sample, "sample", cfg.Sample, "time between comparisons")
	f.BoolVar(&noDump, "no-dump", false, "do not let the restarted router ask the engine for its cache (vLLM has no such call)")
	f.Uint64Var(&cfg.Seed, "seed", cfg.Seed, "seed of the workload")
	f.BoolVar(&asJSON, "json", false, "print the result as JSON")
	f.BoolVar(&quiet, "quiet", false, "no progress lines on stderr")
	return cmd
}
