package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/signal"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/kvrouter/kvrouter/core/sched"
	"github.com/kvrouter/kvrouter/lab/demo"
	"github.com/kvrouter/kvrouter/lab/trace"
)

const defaultDemoTrace = "../shared/traces/mooncake_conversation.jsonl"

func newDemoCmd() *cobra.Command {
	var (
		cfg       demo.Config
		tracePath string
		requests  int
	)
	cmd := &cobra.Command{
		Use:   "demo",
		Short: "Replay a trace through the router over in-process simulated caches, kv vs round-robin",
		Long: `Starts --workers simulated engines, each an LRU prefix cache of --num-gpu-blocks
blocks, and the router (core/router) in kv mode, and replays the first
--requests requests of a Mooncake trace through it as production would: each
request is booked with BestWorker, the chosen engine's cache admits the prompt
and emits Stored/Removed KV events under its own block ids, which the router
applies, then the first token (MarkPrefillCompleted) and the end of the stream
(Free) follow. --inflight requests are active at once. The same replay then
runs on a fresh fleet in round-robin mode, and the two are compared: the
prefix-cache hit rate the engines saw, the prompt tokens they had to prefill,
a simulated time to first token and each worker's share of the requests.

The replay runs in virtual time (trace timestamps are ignored): each engine
prefills one prompt after another at 10,000 uncached tokens/s and decodes at
20 ms per output token. Without the trace file (default path, relative to the
repository root) a built-in synthetic workload is used: a few shared system
prompts and many interleaved multi-turn conversations; --trace "" asks for it.

"kvrouter up" runs the same router behind its HTTP frontend, over simulated
engines that speak vLLM's interfaces.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if requests < 1 {
				return errors.New("--requests must be positive")
			}
			if trace.BlockTokens%cfg.BlockSize != 0 {
				return fmt.Errorf("--block-size %d must divide %d", cfg.BlockSize, trace.BlockTokens)
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt)
			defer stop()
			errOut := cmd.ErrOrStderr()

			var wl demo.Workload
			tr, err := loadUpTrace(tracePath, cmd.Flags().Changed("trace"))
			switch {
			case err != nil:
				return err
			case tr != nil:
				wl = demo.TraceWorkload(fmt.Sprintf("first %d requests of %s", min(requests, len(tr.Requests)), tracePath), tr, requests, cfg.BlockSize)
			default:
				if tracePath != "" {
					fmt.Fprintf(errOut, "%s not found: using the synthetic workload\n", tracePath)
				}
				wl = demo.SyntheticWorkload(requests, cfg.BlockSize, cfg.Seed)
			}
			if len(wl.Requests) == 0 {
				return errors.New("the trace holds no requests")
			}

			start := time.Now()
			res, err := demo.Compare(ctx, cfg, wl, func(m sched.Mode) {
				fmt.Fprintf(errOut, "replaying %d requests in %s mode...\n", len(wl.Requests), m)
			})
			if errors.Is(err, context.Canceled) && ctx.Err() != nil {
				fmt.Fprintln(errOut, "interrupted")
				return nil
			}
			if err != nil {
				return err
			}
			return printUpReport(cmd.OutOrStdout(), cfg, wl, res, time.Since(start))
		},
	}
	d := demo.DefaultConfig()
	f := cmd.Flags()
	f.IntVar(&cfg.Workers, "workers", d.Workers, "simulated engines")
	f.IntVar(&cfg.CapacityBlocks, "num-gpu-blocks", d.CapacityBlocks, "KV blocks each engine caches (LRU)")
	f.IntVar(&cfg.BlockSize, "block-size", d.BlockSize, "tokens per KV block (must divide 512)")
	f.IntVar(&requests, "requests", 2000, "requests to replay")
	f.IntVar(&cfg.InFlight, "inflight", d.InFlight, "requests active at once")
	f.StringVar(&tracePath, "trace", defaultDemoTrace, `Mooncake trace to replay ("": the synthetic workload)`)
	f.Uint64Var(&cfg.Seed, "seed", d.Seed, "seed for engine block ids, tie-breaks and the synthetic workload")
	return cmd
}

// loadUpTrace loads the trace at path. A missing file at the default path
// (explicit: false) is no error: the caller falls back to the synthetic
// workload, as it does for an empty path. A missing file the user named is
// an error.
func loadUpTrace(path string, explicit bool) (*trace.Trace, error) {
	if path == "" {
		return nil, nil
	}
	tr, err := trace.Load(path)
	if errors.Is(err, fs.ErrNotExist) && !explicit {
		return nil, nil
	}
	return tr, err
}

func printUpReport(w io.Writer, cfg demo.Config, wl demo.Workload, res []demo.Result, took time.Duration) error {
	fmt.Fprintf(w, "kvrouter demo: %d simulated engines × %d blocks of %d tokens, %d requests in flight\n",
		cfg.Workers, cfg.CapacityBlocks, cfg.BlockSize, cfg.InFlight)
	fmt.Fprintf(w, "workload: %s\n\n", wl.Name)
	ceiling := wl.HitCeiling()
	ofCeiling := func(r *demo.Result) string {
		if ceiling == 0 {
			return "-"
		}
		return fmt.Sprintf("%.0f %%", 100*r.HitRate/ceiling)
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "mode\thit rate\tof ceiling\tprefill tokens\tsim TTFT mean / p99\tshare of requests per worker")
	for _, r := range res {
		fmt.Fprintf(tw, "%s\t%.1f %%\t%s\t%s\t%s / %s\t%s\n", r.Mode, 100*r.HitRate, ofCeiling(&r), millions(r.PrefillTokens),
			secs(r.TTFTMean), secs(r.TTFTP99), shares(&r))
	}
	fmt.Fprintf(tw, "ceiling\t%.1f %%\t100 %%\t\t\tone engine with unlimited cache\n", 100*ceiling)
	if err := tw.Flush(); err != nil {
		return err
	}
	var events, errs, mism int
	for _, r := range res {
		events += r.Events
		errs += r.EventErrors
		mism += r.OverlapMismatches
	}
	fmt.Fprintf(w, "\nhit rate: prompt blocks the engines found in their prefix cache / prompt blocks.\n")
	if len(res) == 2 && res[0].Mode == sched.ModeKV && res[1].Mode == sched.ModeRoundRobin {
		fmt.Fprintf(w, "kv sends each request to the engine already holding its prefix (a conversation's history), and\n"+
			"prefills %.0f %% fewer tokens; round-robin deals a conversation's turns out to all %d engines.\n",
			100*(1-float64(res[0].PrefillTokens)/float64(max(res[1].PrefillTokens, 1))), cfg.Workers)
	}
	fmt.Fprintf(w, "%d KV events applied (%d refused); router overlap ≠ engine cache on %d requests. Replayed in %.1f s.\n",
		events, errs, mism, took.Seconds())
	fmt.Fprintln(w, "`kvrouter up` runs the router behind its HTTP frontend; `kvrouter bench index` and `kvrouter bench route` measure its speed.")
	return nil
}

func millions(n uint64) string {
	if n >= 1e6 {
		return fmt.Sprintf("%.2f M", float64(n)/1e6)
	}
	return fmt.Sprintf("%.1f k", float64(n)/1e3)
}

func secs(d time.Duration) string { return fmt.Sprintf("%.2f s", d.Seconds()) }

// shares lists every worker's share of requests, or the range of them on
// a large fleet.
func shares(r *demo.Result) string {
	n := len(r.PerWorker)
	if n > 8 {
		lo, hi := 1.0, 0.0
		for i := range n {
			lo, hi = min(lo, r.Share(i)), max(hi, r.Share(i))
		}
		return fmt.Sprintf("%.1f–%.1f %% (%d workers)", 100*lo, 100*hi, n)
	}
	parts := make([]string, n)
	for i := range n {
		parts[i] = fmt.Sprintf("%.1f", 100*r.Share(i))
	}
	return strings.Join(parts, " / ") + " %"
}
