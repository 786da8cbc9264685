package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/kvrouter/kvrouter/lab/bench"
)

func newBenchPlaneCmd() *cobra.Command {
	var (
		cfg        bench.PlaneConfig
		asJSON     bool
		quiet      bool
		cpuProfile string
	)
	cmd := &cobra.Command{
		Use:   "plane",
		Short: "Measure the NATS scale-out plane: event throughput, recovery time, router replicas",
		Long: `Runs three measurements of the NATS plane, each on its own embedded NATS
server on 127.0.0.1 (--skip leaves some out):

throughput  --publishers simulated workers, each with its own NATS connection
            and event publisher, publish Stored events of --blocks-per-event
            blocks for --duration, as fast as they can (or at --rate blocks/s in
            total), into one router subscriber in NATS-core mode. Each worker's
            chains hang below its recent chains (up to 256 blocks deep) or start
            at the root, with fresh engine hashes; once a worker holds --worker-blocks blocks its oldest
            chain is evicted with one Removed event, as an engine's cache does.
            Reported: stored blocks/s applied to the router's index (target
            500,000), events/s, and whether the subscriber fell behind: events
            lost (a full subscription, a dropped connection; recovered by
            ranges or dumps) or more than half a second of publishing still
            queued when it stopped. --publisher-cpus publishers send at once,
            so that the router keeps the CPUs workers on other hosts would
            leave it.
recovery    builds --recovery-blocks indexed blocks over --publishers workers on
            the durable (JetStream) plane with a low snapshot threshold
            (--snapshot-threshold), then times a new replica from Start until its index holds every block
            (snapshot plus the stream's tail), and a new NATS-core router that
            dumps every worker. Target: 3 s each.
replicas    --engines simulated engines with agents, and 1 then 2 router
            replicas (serve with the plane; 2 with replica sync) on one NATS
            server; --concurrency clients send short completions round-robin
            over the replicas for --replica-duration. Reported: requests/s and
            p50/p99 latency per setup.

Everything runs in this process and shares its cores, so publishers, the
NATS server, engines and clients all take CPU from the router under test.
Progress goes to stderr.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := cfg.Validate(); err != nil {
				return err
			}
			progress := io.Discard
			if !quiet {
				progress = cmd.ErrOrStderr()
			}
			stopProfile, err := startCPUProfile(cpuProfile)
			if err != nil {
				return err
			}
			defer stopProfile()
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt)
			defer stop()
			rep, err := bench.RunPlane(ctx, cfg, progress)
			if err != nil {
				return err
			}
			if asJSON {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(rep)
			}
			return printPlaneReport(cmd.OutOrStdout(), rep)
		},
	}
	f := cmd.Flags()
	f.IntVar(&cfg.Publishers, "publishers", 64, "simulated workers, each with its own NATS connection (throughput and recovery)")
	f.IntVar(&cfg.BlocksPerEvent, "blocks-per-event", 16, "blocks per Stored event")
	f.IntVar(&cfg.WorkerBlocks, "worker-blocks", 16384, "blocks a throughput worker holds before it evicts its oldest chain (0: never evict)")
	f.Float64Var(&cfg.Rate, "rate", 0, "throughput: blocks/s all publishers together aim at (0: as fast as they can)")
	f.IntVar(&cfg.PublisherCPUs, "publisher-cpus", max(1, runtime.GOMAXPROCS(0)/2), "throughput: publishers sending at once, leaving the rest of the CPUs to the router and NATS as workers on other hosts would (0: no limit)")
	f.DurationVar(&cfg.Duration, "duration", 10*time.Second, "throughput: how long the workers publish")
	f.IntVar(&cfg.RecoveryBlocks, "recovery-blocks", 1_000_000, "recovery: blocks in the index a new router must rebuild")
	f.Uint64Var(&cfg.SnapshotEvents, "snapshot-threshold", 0, "recovery: stream length above which the durable plane snapshots (0: an eighth of the events that build the index)")
	f.DurationVar(&cfg.ReplicaDuration, "replica-duration", 10*time.Second, "replicas: measured time per setup")
	f.IntVar(&cfg.Concurrency, "concurrency", 64, "replicas: clients, each with one request in flight")
	f.IntVar(&cfg.Engines, "engines", 4, "replicas: simulated engines")
	f.Float64Var(&cfg.Speedup, "speedup-ratio", 1000, "replicas: divide the engines' simulated step times by this")
	f.IntVar(&cfg.MaxTokens, "max-tokens", 2, "replicas: output tokens per request")
	f.Uint64Var(&cfg.Seed, "seed", 1, "seed of the event generators and prompts")
	f.StringSliceVar(&cfg.Skip, "skip", nil, "measurements to leave out: "+strings.Join(bench.PlaneMeasurements, ","))
	f.BoolVar(&asJSON, "json", false, "print the report as JSON")
	f.BoolVar(&quiet, "quiet", false, "no progress lines on stderr")
	f.StringVar(&cpuProfile, "cpuprofile", "", "write a CPU profile of the run to this file")
	return cmd
}

func verdict(ok bool) string {
	if ok {
		return "met"
	}
	return "MISSED"
}

func printPlaneReport(w io.Writer, rep *bench.PlaneReport) error {
	if t := rep.Throughput; t != nil {
		rate := "as fast as they can"
		if t.RateTarget > 0 {
			rate = "aiming at " + bench.Thousands(t.RateTarget) + " blocks/s"
		}
		if t.PublisherCPUs > 0 {
			rate += fmt.Sprintf(" on %d CPU(s)", t.PublisherCPUs)
		}
		fmt.Fprintf(w, "Event throughput: %d publishers (%s) → 1 router subscriber, NATS core, %d blocks/event, %.1f s\n\n",
			t.Publishers, rate, t.BlocksPerEvent, t.DurationS)
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "\tmeasured\ttarget\t\t")
		fmt.Fprintf(tw, "stored blocks/s applied\t%s\t≥ %s\t%s\t\n", bench.Thousands(t.AppliedBlocksPerS), bench.Thousands(t.TargetBlocksPerS), verdict(t.MeetsTarget))
		fmt.Fprintf(tw, "stored blocks/s published\t%s\t\t\t\n", bench.Thousands(t.PublishedBlocksPerS))
		fmt.Fprintf(tw, "removed blocks/s applied\t%s\t\t\t\n", bench.Thousands(t.AppliedRemovedPerS))
		fmt.Fprintf(tw, "events/s applied / published\t%s / %s\t\t\t\n", bench.Thousands(t.AppliedEventsPerS), bench.Thousands(t.PublishedEventsPerS))
		fmt.Fprintf(tw, "events behind at stop\t%s (%.2f s of publishing)\t\t\t\n", bench.Thousands(float64(t.LagEventsAtStop)), t.LagSAtStop)
		drained := fmt.Sprintf("%.2f s", t.DrainS)
		if !t.Drained {
			drained = fmt.Sprintf("not within %.0f s", t.DrainS)
		}
		fmt.Fprintf(tw, "drain after stop\t%s\t\t\t\n", drained)
		fmt.Fprintf(tw, "events dropped (full subscription)\t%s\t\t\t\n", bench.Thousands(float64(t.SlowConsumerDropped)))
		fmt.Fprintf(tw, "gaps / ranges / dumps / failed\t%d / %d / %d / %d\t\t\t\n", t.Gaps, t.RangesRecovered, t.Dumps, t.RecoveryFailures)
		fmt.Fprintf(tw, "blocks recovered by dumps\t%s\t\t\t\n", bench.Thousands(float64(t.RecoveredBlocks)))
		fmt.Fprintf(tw, "router NATS reconnects\t%d\t\t\t\n", t.RouterReconnects)
		fmt.Fprintf(tw, "index blocks / workers' blocks\t%s / %s\t\t\t\n", bench.Thousands(float64(t.IndexBlocks)), bench.Thousands(float64(t.WorkerBlocksHeld)))
		fmt.Fprintf(tw, "subscriber fell behind\t%v\t\t\t\n", t.FellBehind)
		if err := tw.Flush(); err != nil {
			return err
		}
		fmt.Fprintln(w)
	}
	if r := rep.Recovery; r != nil {
		fmt.Fprintf(w, "Recovery: a new router rebuilding %s blocks of %d workers\n\n", bench.Thousands(float64(r.Blocks)), r.Workers)
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "plane\ttime to full index\ttarget\t\thow\t")
		fmt.Fprintf(tw, "durable (JetStream)\t%.2f s\t≤ %.0f s\t%s\tsnapshot of %s blocks + %s stream events (Start took %.2f s)\t\n",
			r.DurableS, r.TargetS, verdict(r.DurableMeetsTarget), bench.Thousands(float64(r.DurableSnapshotBlocks)), bench.Thousands(float64(r.DurableStreamEvents)), r.DurableStartS)
		fmt.Fprintf(tw, "core (dumps)\t%.2f s\t≤ %.0f s\t%s\t%d worker dumps\t\n", r.CoreS, r.TargetS, verdict(r.CoreMeetsTarget), r.CoreDumps)
		if err := tw.Flush(); err != nil {
			return err
		}
		fmt.Fprintf(w, "(build: %.1f s for %s stream events, snapshot threshold %s)\n\n", r.BuildS, bench.Thousands(float64(r.StreamLastSeq)), bench.Thousands(float64(r.SnapshotThreshold)))
	}
	if p := rep.Replicas; p != nil {
		fmt.Fprintf(w, "Replicas: %d engines (speedup %g), %d clients round-robin, %d-token prompts, %d output tokens\n\n",
			p.Engines, p.Speedup, p.Concurrency, p.PromptTokens, p.MaxTokens)
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "replicas\treplica sync\trequests\terrors\treq/s\tp50 ms\tp99 ms\t")
		for _, s := range p.Setups {
			fmt.Fprintf(tw, "%d\t%v\t%d\t%d\t%.0f\t%.2f\t%.2f\t\n", s.Replicas, s.ReplicaSync, s.Requests, s.Errors, s.RequestsPS, s.P50ms, s.P99ms)
		}
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	return nil
}
