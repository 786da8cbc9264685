package main

import "github.com/spf13/cobra"

func newBenchCmd() *cobra.Command {
	bench := &cobra.Command{
		Use:   "bench",
		Short: "Benchmark parts of the router against a request trace",
	}
	addBenchCommands(bench)
	return bench
}
