package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/signal"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/kvrouter/kvrouter/internal/bench"
)

func newBenchOverheadCmd() *cobra.Command {
	var (
		cfg    = bench.DefaultOverheadConfig()
		asJSON bool
		quiet  bool
	)
	cmd := &cobra.Command{
		Use:   "overhead",
		Short: "Measure what the router's frontend adds to TTFT and how many requests/s it carries",
		Long: `Starts --workers simulated engines and the router's frontend (kv mode, live KV
events) in this process, then runs the same load twice: straight to the
engines (round-robin) and through the router. --concurrency clients each keep
one streaming completion of --isl unique prompt tokens and --osl output
tokens open; after --warmup, time to first token and end-to-end latency are
measured for --duration. Prompts never share a prefix, so the router's
choices cannot change the engines' work: the TTFT difference is the
frontend's overhead (parsing, hashing, routing, proxying the stream). A
second pair of phases measures requests/s of short non-streamed completions
(--short-isl tokens, one output token) with --short-concurrency clients.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			progress := io.Discard
			if !quiet {
				progress = cmd.ErrOrStderr()
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt)
			defer stop()
			res, err := bench.RunOverhead(ctx, cfg, progress)
			if err != nil {
				return err
			}
			if asJSON {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(res)
			}
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 0, 2, ' ', tabwriter.AlignRight)
			fmt.Fprintln(tw, "phase\trequests\terrors\treq/s\tTTFT p50 ms\tTTFT p99 ms\te2e p50 ms\t")
			for _, p := range []struct {
				name string
				p    bench.Phase
			}{{"direct", res.Direct}, {"routed", res.Routed}, {"short direct", res.ShortDirect}, {"short routed", res.ShortRouted}} {
				fmt.Fprintf(tw, "%s\t%d\t%d\t%.0f\t%.2f\t%.2f\t%.2f\t\n", p.name, p.p.Requests, p.p.Errors, p.p.RequestsPS, p.p.TTFTp50ms, p.p.TTFTp99ms, p.p.E2Ep50ms)
			}
			tw.Flush()
			fmt.Fprintf(cmd.OutOrStdout(), "\nTTFT through the router minus direct: %+.2f ms at p50, %+.2f ms at p99\n", res.AddedP50ms, res.AddedP99ms)
			fmt.Fprintf(cmd.OutOrStdout(), "time the frontend held a request before the engine got it: p50 %.3f ms, p99 %.3f ms (streamed), p50 %.3f ms, p99 %.3f ms (short)\n",
				res.Routed.FrontendP50ms, res.Routed.FrontendP99ms, res.ShortRouted.FrontendP50ms, res.ShortRouted.FrontendP99ms)
			return nil
		},
	}
	f := cmd.Flags()
	f.IntVar(&cfg.Workers, "workers", cfg.Workers, "simulated engines")
	f.Float64Var(&cfg.Speedup, "speedup", cfg.Speedup, "speedup ratio of the engines")
	f.IntVar(&cfg.Concurrency, "concurrency", cfg.Concurrency, "streams kept open")
	f.IntVar(&cfg.ISL, "isl", cfg.ISL, "prompt tokens of the streamed requests")
	f.IntVar(&cfg.OSL, "osl", cfg.OSL, "output tokens of the streamed requests")
	f.DurationVar(&cfg.Duration, "duration", cfg.Duration, "measured time per phase")
	f.DurationVar(&cfg.Warmup, "warmup", cfg.Warmup, "load before measuring, per phase")
	f.IntVar(&cfg.ShortISL, "short-isl", cfg.ShortISL, "prompt tokens of the short completions")
	f.IntVar(&cfg.ShortConcurrency, "short-concurrency", cfg.ShortConcurrency, "clients of the short-completion phases")
	f.Uint64Var(&cfg.Seed, "seed", cfg.Seed, "seed of the prompts")
	f.BoolVar(&asJSON, "json", false, "print the result as JSON")
	f.BoolVar(&quiet, "quiet", false, "no progress lines on stderr")
	return cmd
}
