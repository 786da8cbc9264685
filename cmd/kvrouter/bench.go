package main

import (
	"os"
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
