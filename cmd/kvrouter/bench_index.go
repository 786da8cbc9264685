package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime/pprof"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/kvrouter/kvrouter/core/index"
	"github.com/kvrouter/kvrouter/lab/bench"
	"github.com/kvrouter/kvrouter/lab/trace"
)

func newBenchIndexCmd() *cobra.Command {
	var (
		cfg        bench.IndexConfig
		tracePath  string
		asJSON     bool
		quiet      bool
		cpuProfile string
		memProfile string
	)
	cmd := &cobra.Command{
		Use:   "index",
		Short: "Replay a trace against the block index over simulated engines",
		Long: `Replays a Mooncake trace against the event-fed block index. Simulated engines,
each an LRU cache of --capacity-blocks blocks, are split into groups of
--group-size; group c serves its own disjoint copy of the trace. For every
request the harness hashes the prompt, asks the index for matches (timed),
routes to the group engine with the most overlap (ties: least loaded, then
rotating), and applies the engine's resulting Removed and Stored events to the
index (timed), as an engine announces them: one event per scheduler step, so
none carries more than --max-num-batched-tokens tokens' blocks (512 blocks of
16 tokens by default). Each of the --threads replay goroutines owns whole
groups, and engines are numbered so that a goroutine's engines fall in index
shards no other goroutine writes: one writer per shard, as Dynamo's indexer
gives each event thread its own workers (writer_per_shard; not possible with
more goroutines than shards).

ops/s counts find_matches calls plus events applied; block ops/s counts blocks
looked up plus blocks stored plus blocks removed; Dynamo block ops/s leaves
removed blocks out (blocks offered to find_matches plus blocks stored), as
Dynamo's indexer benchmarks count. --trace-length-factor and
--trace-duplication-factor shape the workload as those benchmarks do: every
hash id becomes that many consecutive ids (deeper chains, same prefix tree),
and every group replays that many disjoint copies of the trace, interleaved.
--num-gpu-blocks is --capacity-blocks under Dynamo's name; one block per hash
id, as in Dynamo's benchmarks, is --block-size 512. bytes_per_pair is the heap
the index holds (HeapAlloc with it, minus without it, each after a GC) over
its (block, worker) pairs. Progress goes to stderr once per second.

--pregenerate first records --max-requests requests (routing decided on the
engines' own caches) and then times only the index's work on them: the
lookups and the events replayed from memory, as Dynamo's indexer benchmarks
time a pregenerated event stream. Without it the simulated engines and the
prompt hashing run inside the measured time.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if tracePath == "" {
				return errors.New("--trace is required")
			}
			tr, err := trace.Load(tracePath)
			if err != nil {
				return err
			}
			if !quiet {
				cfg.Progress = cmd.ErrOrStderr()
			}
			stopProfile, err := startCPUProfile(cpuProfile)
			if err != nil {
				return err
			}
			defer stopProfile()
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt)
			defer stop()
			rep, err := bench.IndexBench(ctx, tr, cfg)
			if err != nil {
				return err
			}
			if memProfile != "" {
				if err := writeHeapProfile(memProfile); err != nil {
					return err
				}
			}
			if asJSON {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(rep)
			}
			return printIndexReport(cmd.OutOrStdout(), rep)
		},
	}
	f := cmd.Flags()
	f.StringVar(&tracePath, "trace", "", "Mooncake trace (JSON lines) to replay")
	f.IntVar(&cfg.Workers, "workers", 64, "simulated engines")
	f.IntVar(&cfg.GroupSize, "group-size", 8, "engines per group; each group serves its own copy of the trace")
	f.IntVar(&cfg.CapacityBlocks, "capacity-blocks", 16384, "KV blocks each engine caches (LRU)")
	f.IntVar(&cfg.CapacityBlocks, "num-gpu-blocks", 16384, "the same as --capacity-blocks, under Dynamo's name")
	f.IntVar(&cfg.TraceLengthFactor, "trace-length-factor", 1, "replace every hash id by this many consecutive ids: longer chains, same prefix tree")
	f.IntVar(&cfg.TraceDuplication, "trace-duplication-factor", 1, "disjoint copies of the trace each group replays, interleaved request by request")
	f.IntVar(&cfg.BlockSize, "block-size", 16, "tokens per KV block (must divide 512)")
	f.IntVar(&cfg.StepTokens, "max-num-batched-tokens", 8192, "engines' token budget per step: each KV event carries at most this many tokens' blocks")
	f.IntVar(&cfg.Threads, "threads", 0, "replay goroutines (0: GOMAXPROCS)")
	f.IntVar(&cfg.Shards, "router-event-threads", index.DefaultShards, "index write parallelism (shards)")
	f.Uint64Var(&cfg.MaxPairs, "max-pairs", 0, "index memory cap in (block, worker) pairs (0: none)")
	f.Uint64Var(&cfg.Seed, "seed", 1, "seed for engine block ids and tie-breaking")
	f.DurationVar(&cfg.Duration, "duration", 20*time.Second, "how long to run, looping over the trace (0: until --max-requests)")
	f.Int64Var(&cfg.MaxRequests, "max-requests", 0, "stop after this many requests (0: no limit)")
	f.BoolVar(&cfg.Pregenerate, "pregenerate", false, "record --max-requests requests first, then time only the index replaying them")
	f.BoolVar(&asJSON, "json", false, "print the report as JSON")
	f.BoolVar(&quiet, "quiet", false, "no progress lines on stderr")
	f.StringVar(&cpuProfile, "cpuprofile", "", "write a CPU profile of the run to this file")
	f.StringVar(&memProfile, "memprofile", "", "write a heap profile at the end of the run to this file")
	return cmd
}

func writeHeapProfile(path string) error { return writeProfile("heap", path) }

// writeAllocsProfile writes what was allocated since the process started
// (pprof -sample_index=alloc_space).
func writeAllocsProfile(path string) error { return writeProfile("allocs", path) }

func writeProfile(name, path string) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := pprof.Lookup(name).WriteTo(f, 0); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

func printIndexReport(w io.Writer, r *bench.IndexReport) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	row := func(name, value string) { fmt.Fprintf(tw, "%s\t%s\t\n", name, value) }
	row("workers", fmt.Sprintf("%d (%d groups of %d)", r.Workers, r.Groups, r.GroupSize))
	if r.TraceLengthFactor > 1 || r.TraceDuplication > 1 {
		row("trace length / duplication factor", fmt.Sprintf("%d / %d", r.TraceLengthFactor, r.TraceDuplication))
	}
	row("threads / shards", fmt.Sprintf("%d / %d", r.Threads, r.Shards))
	if r.Pregenerated {
		row("duration", fmt.Sprintf("%.1f s timed, after %.1f s recording", r.DurationS, r.PregenerateS))
	} else {
		row("duration", fmt.Sprintf("%.1f s", r.DurationS))
	}
	row("requests", fmt.Sprintf("%d", r.Requests))
	row("ops/s", fmt.Sprintf("%.0f", r.OpsPerSec))
	row("block ops/s", fmt.Sprintf("%.0f", r.BlockOpsPerSec))
	row("Dynamo block ops/s", fmt.Sprintf("%.0f", r.DynamoBlockOpsPerSec))
	row("find_matches p50 / p99", fmt.Sprintf("%.1f / %.1f µs", r.FindMatchesP50us, r.FindMatchesP99us))
	row("apply p50 / p99", fmt.Sprintf("%.1f / %.1f µs", r.ApplyP50us, r.ApplyP99us))
	row("hit rate", fmt.Sprintf("%.1f %%", 100*r.HitRate))
	row("indexed pairs", fmt.Sprintf("%d", r.IndexedPairs))
	row("bytes / pair", fmt.Sprintf("%.1f", r.BytesPerPair))
	row("index heap", fmt.Sprintf("%.1f MiB", float64(r.IndexHeapBytes)/(1<<20)))
	row("heap in use", fmt.Sprintf("%.1f MiB", float64(r.HeapInuseBytes)/(1<<20)))
	row("lookup waits", fmt.Sprintf("%d", r.LookupWaits))
	row("apply errors", fmt.Sprintf("%d", r.ApplyErrors))
	row("overlap mismatches", fmt.Sprintf("%d", r.OverlapMismatches))
	return tw.Flush()
}
