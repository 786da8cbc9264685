package main

import (
	"context"
	"encoding/json"
	"io"
	"os"
	"os/signal"
	"runtime/pprof"

	"github.com/spf13/cobra"
)

func newBenchCmd() *cobra.Command {
	bench := &cobra.Command{
		Use:   "bench",
		Short: "Benchmark parts of the router against a request trace",
	}
	addBenchCommands(bench)
	return bench
}

// startCPUProfile profiles the process into path until stop; "" profiles
// nothing.
func startCPUProfile(path string) (stop func(), err error) {
	if path == "" {
		return func() {}, nil
	}
	f, err := os.Create(path)
	if err != nil {
		return nil, err
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, err
	}
	return func() {
		pprof.StopCPUProfile()
		f.Close()
	}, nil
}

// runBench is the plumbing of the bench commands: progress lines on stderr
// unless quiet, Ctrl-C cancels the run, and the result is printed as JSON
// or by print.
func runBench[R any](cmd *cobra.Command, quiet, asJSON bool, run func(context.Context, io.Writer) (R, error), print func(io.Writer, R) error) error {
	progress := io.Discard
	if !quiet {
		progress = cmd.ErrOrStderr()
	}
	ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt)
	defer stop()
	res, err := run(ctx, progress)
	if err != nil {
		return err
	}
	if asJSON {
		enc := json.NewEncoder(cmd.OutOrStdout())
		enc.SetIndent("", "  ")
		return enc.Encode(res)
	}
	return print(cmd.OutOrStdout(), res)
}
