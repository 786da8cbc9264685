package main

import (
	"encoding/json"
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/kvrouter/kvrouter/lab/bench"
)

func newBenchRouteCmd() *cobra.Command {
	var (
		cfg    = bench.DefaultRouteConfig()
		asJSON bool
		quiet  bool
		// In seconds, as serve takes it.
		predictedTTLSecs float64
	)
	cmd := &cobra.Command{
		Use:   "route",
		Short: "Measure whole routing decisions of the router",
		Long: `Measures core/router's BestWorker end to end: hashing the prompt, matching it
against the event-fed index, scoring every worker and booking the request.

The warm index holds, on each of --workers workers, --conversations
conversations of --isl tokens that all start with one shared system prompt of
--system-tokens tokens. Half of the measured requests continue a cached
conversation (three quarters of the prompt cached on one worker), half start a
new one (only the system prompt cached, everywhere). Each decision books its
request and frees the oldest of --inflight booked ones, so the load tracker is
never empty; the timed span covers hashing, matching, scoring, booking and
freeing, and each stage is also reported on its own (p50 and mean), with the
mean of the rest of the span no stage covers (mostly listing every worker's
load and overlap as candidates). Progress goes to stderr.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			progress := io.Discard
			if !quiet {
				progress = cmd.ErrOrStderr()
			}
			cfg.PredictedTTL = seconds(predictedTTLSecs)
			res, err := bench.RunRoute(cfg, progress)
			if err != nil {
				return err
			}
			if asJSON {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(res)
			}
			return printRouteResult(cmd.OutOrStdout(), &res)
		},
	}
	f := cmd.Flags()
	f.IntVar(&cfg.ISL, "isl", cfg.ISL, "prompt tokens per request")
	f.IntVar(&cfg.Workers, "workers", cfg.Workers, "workers (one rank each)")
	f.IntVar(&cfg.BlockSize, "block-size", cfg.BlockSize, "tokens per KV block")
	f.IntVar(&cfg.Iterations, "iterations", cfg.Iterations, "measured routing decisions")
	f.IntVar(&cfg.InFlight, "inflight", cfg.InFlight, "requests kept booked while measuring")
	f.IntVar(&cfg.Warmup, "warmup", 0, "decisions routed untimed before the measured ones (predict-on-route's index grows for its first 2 s)")
	f.IntVar(&cfg.Conversations, "conversations", cfg.Conversations, "cached conversations per worker in the warm index")
	f.IntVar(&cfg.SystemTokens, "system-tokens", cfg.SystemTokens, "system prompt tokens shared by every conversation")
	f.IntVar(&cfg.EventThreads, "router-event-threads", cfg.EventThreads, "index write parallelism (shards)")
	f.Uint64Var(&cfg.Seed, "seed", cfg.Seed, "seed for tokens and tie-breaking")
	f.Float64Var(&predictedTTLSecs, "router-predicted-ttl-secs", cfg.PredictedTTL.Seconds(), "predict-on-route: also index each decision for this many seconds; 0 = off")
	f.BoolVar(&cfg.ThreadCPU, "thread-cpu", false, "also time each decision by its thread's CPU time (Linux), which other processes' use of the core leaves out, and a fixed computation after each (the machine's floor)")
	f.BoolVar(&asJSON, "json", false, "print the result as JSON")
	f.BoolVar(&quiet, "quiet", false, "no progress lines on stderr")
	return cmd
}

func printRouteResult(w io.Writer, r *bench.RouteResult) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	row := func(name, value string) { fmt.Fprintf(tw, "%s\t%s\t\n", name, value) }
	row("workers", fmt.Sprintf("%d", r.Workers))
	row("prompt tokens", fmt.Sprintf("%d", r.ISL))
	row("decisions", fmt.Sprintf("%d", r.Iterations))
	row("route p50 / p99", fmt.Sprintf("%.1f / %.1f µs", r.RouteP50us, r.RouteP99us))
	row("route mean", fmt.Sprintf("%.1f µs", r.RouteMeanus))
	if r.CPUP50us > 0 {
		row("thread CPU p50 / p99 / mean", fmt.Sprintf("%.1f / %.1f / %.1f µs", r.CPUP50us, r.CPUP99us, r.CPUMeanus))
		row("floor CPU p50 / p99 / mean", fmt.Sprintf("%.1f / %.1f / %.1f µs", r.FloorP50us, r.FloorP99us, r.FloorMeanus))
	}
	row("hash / find / schedule p50", fmt.Sprintf("%.1f / %.1f / %.1f µs", r.HashP50us, r.FindP50us, r.ScheduleP50us))
	row("score / book / free p50", fmt.Sprintf("%.1f / %.1f / %.1f µs", r.ScoreP50us, r.BookP50us, r.FreeP50us))
	m := r.Split
	row("mean hash / find / score / book / free", fmt.Sprintf("%.1f / %.1f / %.1f / %.1f / %.1f µs", m.Hash, m.FindMatches, m.Score, m.Book, m.Free))
	row("mean other (candidates)", fmt.Sprintf("%.1f µs", m.Other))
	row("decisions/s", fmt.Sprintf("%.0f", r.DecisionsPerS))
	row("hit rate", fmt.Sprintf("%.1f %%", 100*r.HitRate))
	row("indexed pairs", fmt.Sprintf("%d", r.IndexedPairs))
	return tw.Flush()
}
