package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/kvrouter/kvrouter/lab/bench"
)

func newBenchMemoryCmd() *cobra.Command {
	var (
		cfg    = bench.DefaultMemoryConfig()
		asJSON bool
		quiet  bool
	)
	cmd := &cobra.Command{
		Use:   "memory",
		Short: "Measure the resident memory of kvrouter serve under requests whose size clients control",
		Long: `Starts --workers simulated engines in this process and "kvrouter serve" in
front of them as a child process (--binary, this binary by default; extra
flags with --serve-arg), then sends it --sessions completions opening a
session with an id of --id-bytes and a timeout of 1e9 s, --models POST
/busy_threshold with model names of --id-bytes, and --prompt-clients
concurrent text prompts of --prompt-bytes. It reads the process's VmRSS from
/proc before (idle), after one ordinary completion (warm idle), throughout
(peak), when the probes are done and --settle later, and reports how the
probes were answered. At each point the RSS is split into anonymous,
file-backed and shared pages, next to the Go heap from the process's
/metrics (in MB; the peak has no heap figures), so that what is held is
visible.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if cfg.Binary == "" {
				exe, err := os.Executable()
				if err != nil {
					return err
				}
				cfg.Binary = exe
			}
			return runBench(cmd, quiet, asJSON, func(ctx context.Context, progress io.Writer) (bench.MemoryResult, error) {
				return bench.RunMemory(ctx, cfg, progress)
			}, func(out io.Writer, res bench.MemoryResult) error {
				tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
				fmt.Fprintf(tw, "RSS idle\t%.0f MB\n", res.IdleMB)
				fmt.Fprintf(tw, "RSS peak\t%.0f MB\n", res.PeakMB)
				fmt.Fprintf(tw, "RSS after the probes\t%.0f MB\n", res.AfterProbesMB)
				fmt.Fprintf(tw, "RSS %v later\t%.0f MB\n", cfg.Settle, res.SettledMB)
				fmt.Fprintf(tw, "back within 20 %% of idle after\t%.0f s (-1: not within %v)\n", res.BackWithinS, cfg.Settle)
				fmt.Fprintf(tw, "back within 20 %% of warm idle after\t%.0f s\n", res.BackWithinWarmS)
				fmt.Fprintln(tw, "\tRSS\tanon\tfile\tshmem\theap in use\theap idle\theap released\tstacks\tgoroutines")
				for _, row := range []struct {
					name string
					m    bench.MemorySample
				}{{"idle", res.Idle}, {"warm idle", res.WarmIdle}, {"peak", res.Peak}, {"after the probes", res.AfterProbes}, {fmt.Sprint(cfg.Settle, " later"), res.Settled}} {
					m := row.m
					fmt.Fprintf(tw, "%s\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%.1f\t%d\n", row.name, m.RSSMB, m.AnonMB, m.FileMB, m.ShmemMB, m.HeapInuseMB, m.HeapIdleMB, m.HeapReleasedMB, m.StacksMB, m.Goroutines)
				}
				fmt.Fprintf(tw, "GET /busy_threshold\t%d bytes\n", res.ListBytes)
				for _, p := range []string{"sessions", "busy_threshold", "prompts"} {
					fmt.Fprintf(tw, "answers to %s\t%s\n", p, res.Statuses[p])
				}
				return tw.Flush()
			})
		},
	}
	f := cmd.Flags()
	f.StringVar(&cfg.Binary, "binary", "", "kvrouter binary to measure (default: this one)")
	f.StringArrayVar(&cfg.ServeArgs, "serve-arg", nil, "extra flag for serve (repeatable)")
	f.IntVar(&cfg.Workers, "workers", cfg.Workers, "simulated engines")
	f.IntVar(&cfg.Sessions, "sessions", cfg.Sessions, "completions opening a session")
	f.IntVar(&cfg.Models, "models", cfg.Models, "busy thresholds posted")
	f.IntVar(&cfg.IDBytes, "id-bytes", cfg.IDBytes, "length of the session ids and model names")
	f.IntVar(&cfg.PromptBytes, "prompt-bytes", cfg.PromptBytes, "size of each text prompt")
	f.IntVar(&cfg.PromptClients, "prompt-clients", cfg.PromptClients, "prompts sent at once")
	f.DurationVar(&cfg.Settle, "settle", cfg.Settle, "time watched after the probes")
	f.BoolVar(&asJSON, "json", false, "print the result as JSON")
	f.BoolVar(&quiet, "quiet", false, "no progress lines on stderr")
	return cmd
}
