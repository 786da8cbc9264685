package main

import (
	"context"
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/kvrouter/kvrouter/lab/bench"
)

func newBenchMockerCmd() *cobra.Command {
	var (
		cfg    = bench.DefaultMockerConfig()
		asJSON bool
		quiet  bool
	)
	cmd := &cobra.Command{
		Use:   "mocker",
		Short: "Measure whether simulated engines keep the timing model's pace under load",
		Long: `Starts --workers simulated engines at --speedup in this process and keeps
--concurrency streaming completions open against them over HTTP on 127.0.0.1
(each request: one of --system-prompts shared system prompts of
--system-tokens tokens plus unique tokens, and a random max_tokens). After
--warmup it measures, for --duration, every engine's scheduler steps: the sum
of their model times divided by the speedup against the wall time they took,
the mocker's own overhead (HTTP, JSON, event publishing) included. drift =
(wall − model) / model; 0 means the simulation kept the model's pace exactly.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runBench(cmd, quiet, asJSON, func(ctx context.Context, progress io.Writer) (bench.MockerResult, error) {
				return bench.RunMocker(ctx, cfg, progress)
			}, func(out io.Writer, res bench.MockerResult) error {
				tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
				fmt.Fprintf(tw, "engines × speedup\t%d × %g\n", res.Workers, res.Speedup)
				fmt.Fprintf(tw, "concurrent streams\t%d\n", res.Concurrency)
				fmt.Fprintf(tw, "steps measured\t%d in %.1f s\n", res.Steps, res.DurationSecond)
				fmt.Fprintf(tw, "step time: model / wall\t%.2f s / %.2f s\n", res.ModelSeconds, res.ActualSeconds)
				fmt.Fprintf(tw, "drift\t%+.2f %%\n", 100*res.Drift)
				fmt.Fprintf(tw, "lag resets\t%d\n", res.LagResets)
				fmt.Fprintf(tw, "requests (errors)\t%d (%d)\n", res.Requests, res.Errors)
				fmt.Fprintf(tw, "tokens/s streamed\t%.0f\n", res.TokensPerSec)
				fmt.Fprintf(tw, "client TTFT p50\t%.1f ms\n", res.ClientTTFTp50)
				return tw.Flush()
			})
		},
	}
	f := cmd.Flags()
	f.IntVar(&cfg.Workers, "workers", cfg.Workers, "simulated engines")
	f.Float64Var(&cfg.Speedup, "speedup", cfg.Speedup, "speedup ratio of the engines")
	f.IntVar(&cfg.Concurrency, "concurrency", cfg.Concurrency, "streams kept open")
	f.DurationVar(&cfg.Duration, "duration", cfg.Duration, "measured time")
	f.DurationVar(&cfg.Warmup, "warmup", cfg.Warmup, "load before measuring")
	f.IntVar(&cfg.SystemPrompts, "system-prompts", cfg.SystemPrompts, "distinct shared system prompts")
	f.IntVar(&cfg.SystemTokens, "system-tokens", cfg.SystemTokens, "tokens per system prompt")
	f.IntVar(&cfg.MinUser, "min-user-tokens", cfg.MinUser, "fewest unique prompt tokens per request")
	f.IntVar(&cfg.MaxUser, "max-user-tokens", cfg.MaxUser, "most unique prompt tokens per request")
	f.IntVar(&cfg.MinOutput, "min-output-tokens", cfg.MinOutput, "smallest max_tokens")
	f.IntVar(&cfg.MaxOutput, "max-output-tokens", cfg.MaxOutput, "largest max_tokens")
	f.BoolVar(&cfg.Stream, "stream", cfg.Stream, "stream the completions (server-sent events)")
	f.Uint64Var(&cfg.Seed, "seed", cfg.Seed, "seed of the workload")
	f.BoolVar(&asJSON, "json", false, "print the result as JSON")
	f.BoolVar(&quiet, "quiet", false, "no progress lines on stderr")
	return cmd
}
