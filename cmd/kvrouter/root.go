package main

import "github.com/spf13/cobra"

func newRootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:   "kvrouter",
		Short: "KV-cache-aware router for LLM inference",
		Long: `kvrouter routes LLM requests to the engine (vLLM, SGLang, simulator) that
already caches the most of their prompt, balanced against each engine's load.`,
		SilenceUsage: true,
		Version:      versionString(), // --version, as "kvrouter version" prints it
	}
	root.SetVersionTemplate("{{.Version}}\n")
	root.SetFlagErrorFunc(suggestFlag) // inherited by every subcommand
	addCommands(root)
	return root
}

// addCommands is the one place where subcommands are registered. Each
// command is built by a newXxxCmd function in its own file (xxx.go).
func addCommands(root *cobra.Command) {
	root.AddCommand(
		newVersionCmd(),  // version.go
		newBenchCmd(),    // bench.go
		newUpCmd(),       // up.go: simulated engines and the frontend on one machine
		newServeCmd(),    // serve.go: the OpenAI frontend in front of real engines
		newIndexerCmd(),  // indexer.go: the standalone KV indexer
		newAgentCmd(),    // agent.go: puts one engine on the NATS plane
		newDoctorCmd(),   // doctor.go: checks engines as serve will use them
		newDemoCmd(),     // demo.go: trace replay through the router over in-process caches
		newSimCmd(),      // sim.go: the router and engine cores in virtual time
		newMockerCmd(),   // mocker.go: simulated vLLM engines
		newTokenizeCmd(), // tokenize.go: token ids of a text, tokenized in process
	)
}

// addBenchCommands registers the subcommands of "kvrouter bench".
func addBenchCommands(bench *cobra.Command) {
	bench.AddCommand(
		newBenchIndexCmd(),           // bench_index.go
		newBenchIndexerCmd(),         // bench_indexer.go
		newBenchRouteCmd(),           // bench_route.go
		newBenchMockerCmd(),          // bench_mocker.go
		newBenchOverheadCmd(),        // bench_overhead.go
		newBenchOverheadClientsCmd(), // bench_overhead.go: its clients' child process
		newBenchReplayCmd(),          // bench_replay.go
		newBenchHotSetCmd(),          // bench_hotset.go
		newBenchPlaneCmd(),           // bench_plane.go
		newBenchRecoveryCmd(),        // bench_recovery.go
		newBenchMemoryCmd(),          // bench_memory.go
		newBenchChaosCmd(),           // bench_chaos.go
		newBenchAbuseCmd(),           // bench_abuse.go
		newBenchSimCmd(),             // bench_sim.go
		newBenchCalibrateCmd(),       // bench_calibrate.go
		newBenchTokenizeCmd(),        // bench_tokenize.go
	)
}
