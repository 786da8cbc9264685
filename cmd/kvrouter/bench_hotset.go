package main

import (
	"context"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/kvrouter/kvrouter/lab/bench"
	"github.com/kvrouter/kvrouter/lab/replay"
)

func newBenchHotSetCmd() *cobra.Command {
	var (
		cfg    = replay.DefaultHotSetConfig()
		rf     = newRouterFlags()
		asJSON bool
		quiet  bool
	)
	cmd := &cobra.Command{
		Use:   "hotset",
		Short: "Measure how a hot set of conversations cached on one engine is spread over two",
		Long: `Starts two simulated engines (--speedup) and a router in front of them,
has the first engine cache --conversations conversations of
--history-tokens tokens, then keeps each of --clients closed-loop clients
sending a conversation plus --turn-tokens new tokens (--output-tokens
generated, streamed) for --duration after --warmup. One run per client
count and mode (--modes: kv, dynamo-kv for Dynamo's cost, or any other
mode), each on new engines and a new router. Prints, per run, the requests
each engine served, TTFT p50 and p90 and the requests per second, in model
time.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			rcfg, err := rf.config(cmd.Flags(), func(w string) { fmt.Fprintln(cmd.ErrOrStderr(), "warning:", w) })
			if err != nil {
				return err
			}
			cfg.Router, cfg.Fleet.Engine.BlockSize = rcfg, rcfg.BlockSize
			return runBench(cmd, quiet, asJSON, func(ctx context.Context, progress io.Writer) ([]replay.HotSetRow, error) {
				return replay.RunHotSet(ctx, cfg, progress)
			}, func(out io.Writer, rows []replay.HotSetRow) error {
				tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
				fmt.Fprintln(tw, "clients\tmode\trequests engine 1 / 2\tTTFT p50 / p90 (ms)\treq/s\thit rate\terrors\t")
				for _, r := range rows {
					served := make([]string, len(r.Served))
					for i, n := range r.Served {
						served[i] = bench.Thousands(float64(n))
					}
					fmt.Fprintf(tw, "%d\t%s\t%s\t%.1f / %.1f\t%.1f\t%.3f\t%d\t\n", r.Clients, r.Mode, strings.Join(served, " / "), r.TTFTP50, r.TTFTP90, r.RPS, r.HitRate, r.Errors)
				}
				return tw.Flush()
			})
		},
	}
	f := cmd.Flags()
	rf.register(f)
	f.IntSliceVar(&cfg.Clients, "clients", cfg.Clients, "closed-loop clients; several run one after the other")
	f.StringSliceVar(&cfg.Modes, "modes", cfg.Modes, "routing modes to compare (dynamo-kv: kv mode with Dynamo's cost)")
	f.Float64Var(&cfg.Speedup, "speedup", cfg.Speedup, "speedup ratio of the engines")
	f.IntVar(&cfg.Conversations, "conversations", cfg.Conversations, "conversations the first engine caches")
	f.IntVar(&cfg.HistoryTokens, "history-tokens", cfg.HistoryTokens, "tokens of each conversation's history")
	f.IntVar(&cfg.TurnTokens, "turn-tokens", cfg.TurnTokens, "new tokens per request")
	f.IntVar(&cfg.OutputTokens, "output-tokens", cfg.OutputTokens, "tokens generated per request")
	f.DurationVar(&cfg.Duration, "duration", cfg.Duration, "measured time per run")
	f.DurationVar(&cfg.Warmup, "warmup", cfg.Warmup, "unmeasured time per run before it")
	f.IntVar(&cfg.Fleet.Engine.NumGPUBlocks, "num-gpu-blocks", cfg.Fleet.Engine.NumGPUBlocks, "KV blocks of each engine")
	f.Uint64Var(&cfg.Seed, "seed", cfg.Seed, "seed of the prompts and the router's tie-breaks")
	f.BoolVar(&asJSON, "json", false, "print the result as JSON")
	f.BoolVar(&quiet, "quiet", false, "no progress lines on stderr")
	return cmd
}
