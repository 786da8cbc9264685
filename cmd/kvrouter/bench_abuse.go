package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/spf13/cobra"

	"github.com/kvrouter/kvrouter/lab/abuse"
)

func newBenchAbuseCmd() *cobra.Command {
	var (
		cfg       = abuse.DefaultConfig()
		scenarios string
		jsonOut   bool
		quiet     bool
	)
	cmd := &cobra.Command{
		Use:   "abuse",
		Short: "Run the router against misbehaving engines and hostile clients, and judge each scenario",
		Long: `Runs each scenario against a fresh router (in this process, on 127.0.0.1) in
front of two simulated engines and, where the scenario wants one, a
misbehaving engine, and prints a verdict per scenario with the figure it
rests on:

` + abuse.Describe() + `
The router runs with --engine-header-timeout and --engine-response-timeout
set to --engine-header-timeout here, and its other flags at their defaults.
Memory figures are this process's Go heap, which the engines share. The
defaults run in about a minute; --chain-blocks 10000000, --dump-blocks
1000000 and --label-models 50000 repeat the sizes of the original probe.
The command fails when a verdict does.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if scenarios != "" {
				for _, name := range strings.Split(scenarios, ",") {
					if name = strings.TrimSpace(name); name != "" {
						cfg.Scenarios = append(cfg.Scenarios, name)
					}
				}
			}
			var failed bool
			err := runBench(cmd, quiet, jsonOut, func(ctx context.Context, progress io.Writer) (*abuse.Results, error) {
				cfg.Progress = progress
				res, err := abuse.Run(ctx, cfg)
				if err == nil {
					res.Config.Command = "kvrouter " + strings.Join(os.Args[1:], " ")
					failed = !res.Pass
				}
				return res, err
			}, func(w io.Writer, res *abuse.Results) error {
				_, err := fmt.Fprint(w, abuse.Table(res))
				return err
			})
			if err == nil && failed {
				return errors.New("abuse: a scenario failed")
			}
			return err
		},
	}
	f := cmd.Flags()
	f.StringVar(&scenarios, "scenarios", "", "comma-separated scenarios to run (default: all): "+strings.Join(abuse.Names(), ", "))
	f.IntVar(&cfg.Requests, "requests", cfg.Requests, "requests per misbehaving-engine scenario, from 8 clients at once")
	f.DurationVar(&cfg.HeaderTimeout, "engine-header-timeout", cfg.HeaderTimeout, "the router's --engine-header-timeout and --engine-response-timeout for the run")
	f.IntVar(&cfg.ChainBlocks, "chain-blocks", cfg.ChainBlocks, "blocks in the hostile engine's chain (event-chain)")
	f.IntVar(&cfg.DumpBlocks, "dump-blocks", cfg.DumpBlocks, "blocks in the index the dump flood reads")
	f.IntVar(&cfg.LabelModels, "label-models", cfg.LabelModels, "distinct model names the label flood sends")
	f.IntVar(&cfg.DumpClients, "dump-clients", cfg.DumpClients, "concurrent /router/dump_events calls")
	f.IntVar(&cfg.CancelClients, "cancel-clients", cfg.CancelClients, "clients in the cancel storm")
	f.BoolVar(&jsonOut, "json", false, "print the results as JSON instead of the table")
	f.BoolVar(&quiet, "quiet", false, "no progress on stderr")
	return cmd
}
