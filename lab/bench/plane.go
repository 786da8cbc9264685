package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/adapters/natsplane"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/internal/agent"
	"github.com/kvrouter/kvrouter/internal/serve"
	"github.com/kvrouter/kvrouter/mocker/fleet"
)

// What the plane is held to: one router keeps up with a large fleet's
// block events, and a new or restarted replica routes on the full index
// within seconds.
const (
	planeTargetBlocksPerS = 500_000
	planeTargetRecovery   = 3 * time.Second
)

// PlaneMeasurements names the measurements PlaneConfig.Skip may leave out.
var PlaneMeasurements = []string{"throughput", "recovery", "replicas"}

// PlaneConfig sets up `kvrouter bench plane`; its flags document each field.
type PlaneConfig struct {
	Publishers      int
	BlocksPerEvent  int
	WorkerBlocks    int
	Rate            float64
	PublisherCPUs   int
	Duration        time.Duration
	RecoveryBlocks  int
	SnapshotEvents  uint64
	ReplicaDuration time.Duration
	Concurrency     int
	Engines         int
	Speedup         float64
	MaxTokens       int
	Seed            uint64
	Skip            []string
}

// PlaneReport is the --json output; a skipped measurement is absent.
type PlaneReport struct {
	Throughput *PlaneThroughput `json:"throughput,omitempty"`
	Recovery   *PlaneRecovery   `json:"recovery,omitempty"`
	Replicas   *PlaneReplicas   `json:"replicas,omitempty"`
}

// Validate rejects a configuration the measurements cannot run; its
// messages name the command's flags.
func (c *PlaneConfig) Validate() error {
	for _, s := range c.Skip {
		if !slices.Contains(PlaneMeasurements, s) {
			return fmt.Errorf("--skip %q: measurements are %s", s, strings.Join(PlaneMeasurements, ", "))
		}
	}
	switch {
	// Workers are announced to a durable subscriber before it starts, into
	// a queue of 4,096.
	case c.Publishers < 1 || c.Publishers > 4000:
		return errors.New("--publishers must be between 1 and 4,000")
	case c.BlocksPerEvent < 1:
		return errors.New("--blocks-per-event must be at least 1")
	case c.WorkerBlocks < 0:
		return errors.New("--worker-blocks must not be negative")
	case c.WorkerBlocks > 0 && c.WorkerBlocks < 2*c.BlocksPerEvent:
		return errors.New("--worker-blocks must hold at least two events' blocks")
	case c.PublisherCPUs < 0:
		return errors.New("--publisher-cpus must not be negative")
	case c.Rate < 0:
		return errors.New("--rate must not be negative")
	case c.Duration <= 0 || c.ReplicaDuration <= 0:
		return errors.New("--duration and --replica-duration must be positive")
	case c.RecoveryBlocks < c.Publishers:
		return errors.New("--recovery-blocks must give every publisher a block")
	case c.Concurrency < 1 || c.Engines < 1 || c.MaxTokens < 1:
		return errors.New("--concurrency, --engines and --max-tokens must be at least 1")
	case c.Speedup <= 0:
		return errors.New("--speedup-ratio must be positive")
	}
	return nil
}

// RunPlane runs the measurements cfg does not skip, in order, each on its
// own embedded NATS server; progress lines go to progress.
func RunPlane(ctx context.Context, cfg PlaneConfig, progress io.Writer) (*PlaneReport, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	skip := map[string]bool{}
	for _, s := range cfg.Skip {
		skip[s] = true
	}
	var rep PlaneReport
	var err error
	if !skip["throughput"] {
		if rep.Throughput, err = runPlaneThroughput(ctx, cfg, progress); err != nil {
			return nil, fmt.Errorf("throughput: %w", err)
		}
	}
	if !skip["recovery"] {
		if rep.Recovery, err = runPlaneRecovery(ctx, cfg, progress); err != nil {
			return nil, fmt.Errorf("recovery: %w", err)
		}
	}
	if !skip["replicas"] {
		if rep.Replicas, err = runPlaneReplicas(ctx, cfg, progress); err != nil {
			return nil, fmt.Errorf("replicas: %w", err)
		}
	}
	return &rep, nil
}

// startBenchNATS starts an embedded server on a store of its own; stop
// removes everything it left.
func startBenchNATS() (*natsplane.Embedded, func(), error) {
	dir, err := os.MkdirTemp("", "kvrouter-bench-plane-")
	if err != nil {
		return nil, nil, err
	}
	srv, err := natsplane.StartEmbedded(natsplane.EmbeddedConfig{StoreDir: dir})
	if err != nil {
		os.RemoveAll(dir)
		return nil, nil, err
	}
	return srv, func() { srv.Shutdown(); os.RemoveAll(dir) }, nil
}

// waitFor polls cond until it holds; false when within passed first.
// tick, if set, runs once a second meanwhile, for progress lines.
func waitFor(ctx context.Context, within, every time.Duration, cond func() bool, tick func()) bool {
	start := time.Now()
	ticked := start
	for !cond() {
		if ctx.Err() != nil || time.Since(start) > within {
			return false
		}
		if tick != nil && time.Since(ticked) >= time.Second {
			tick()
			ticked = time.Now()
		}
		time.Sleep(every)
	}
	return true
}

// eventGen produces one worker's KV events the way an engine under steady
// load emits them: a stored chain continues one of the worker's recent
// chains (a conversation's next turn) or starts at the root (a new prompt,
// or a conversation that reached its context length), every block with a
// fresh engine hash. Once the worker holds its capacity, its oldest chain
// is evicted in one Removed event, as an engine's allocator frees blocks
// in batches; that also bounds the memory of the worker's log and of the
// router's index.
type eventGen struct {
	w        kv.Worker
	rng      *rand.Rand
	next     uint64
	chains   []heldChain // held chains, oldest first from head
	head     int
	held     int
	xor      uint64 // of the held blocks' engine hashes, mixed
	capacity int    // 0: never evict
	blocks   int
}

type heldChain struct {
	hashes []uint64
	depth  int // of the last block, counted from the root
}

// maxChainDepth is a conversation's context length in blocks: 4,096
// tokens of 16-token blocks.
const maxChainDepth = 256

func newEventGen(worker uint64, blocks, capacity int, seed uint64) *eventGen {
	return &eventGen{w: kv.Worker{ID: worker}, rng: rand.New(rand.NewPCG(seed, worker)), next: worker << 40, capacity: capacity, blocks: blocks}
}

// recentChains bounds how far back a continued conversation reaches, so
// that parents are never the chains about to be evicted.
const recentChains = 64

func (g *eventGen) event(n int) kv.Event {
	if g.capacity > 0 && g.held+n > g.capacity && g.head < len(g.chains) {
		old := g.chains[g.head].hashes
		g.chains[g.head] = heldChain{}
		g.head++
		g.held -= len(old)
		for _, h := range old {
			g.xor ^= mix64(h)
		}
		if g.head >= 1024 && 2*g.head >= len(g.chains) {
			g.chains = append(g.chains[:0], g.chains[g.head:]...)
			g.head = 0
		}
		return kv.RemovedEvent(g.w, 0, old...)
	}
	var parent *uint64
	depth := n
	if live := len(g.chains) - g.head; live > 0 && g.rng.IntN(4) > 0 {
		c := g.chains[len(g.chains)-1-g.rng.IntN(min(live, recentChains))]
		if c.depth+n <= maxChainDepth {
			parent, depth = kv.Ptr(c.hashes[len(c.hashes)-1]), c.depth+n
		}
	}
	blocks := make([]kv.Block, n)
	hashes := make([]uint64, n)
	for i := range blocks {
		g.next++
		// Content hashes are as unique as the engine's ids: prompts that
		// share nothing, the index's worst case for memory.
		blocks[i] = kv.Block{EngineHash: g.next, LocalHash: g.next*0x9e3779b97f4a7c15 ^ 0x5851f42d4c957f2d}
		hashes[i] = g.next
		g.xor ^= mix64(g.next)
	}
	g.chains = append(g.chains, heldChain{hashes: hashes, depth: depth})
	g.held += n
	return kv.StoredEvent(g.w, 0, parent, blocks...)
}

// countingSink is the router as the subscriber sees it, counting what the
// index accepted. Live and range-recovered events carry their event id;
// dumps replay single-block events without one, so blocks that came back
// through a dump are told apart from delivered ones. Per worker it keeps
// the number and XOR of the engine hashes it holds: equal to the worker's
// own, they show the router caught up with it (counts alone match by
// chance once workers and router both sit at capacity). Hashes go through
// mix64 before the XOR: the generator's are consecutive, and a chain stored
// late and one evicted late would otherwise cancel out.
type countingSink struct {
	*router.Router
	events, storedBlocks, removedBlocks, recoveredBlocks atomic.Uint64
	held                                                 []heldSum // by worker id
}

type heldSum struct{ n, xor atomic.Uint64 }

func (s *countingSink) ApplyEvent(ev *kv.Event) error {
	if err := s.Router.ApplyEvent(ev); err != nil {
		return err
	}
	// Only the subscriber's goroutine writes the sums.
	sum := &s.held[ev.Worker.ID]
	n, x := sum.n.Load(), sum.xor.Load()
	switch ev.Kind {
	case kv.KindStored:
		for _, b := range ev.Stored.Blocks {
			n, x = n+1, x^mix64(b.EngineHash)
		}
		if ev.EventID == 0 {
			s.recoveredBlocks.Add(uint64(len(ev.Stored.Blocks)))
		} else {
			s.events.Add(1)
			s.storedBlocks.Add(uint64(len(ev.Stored.Blocks)))
		}
	case kv.KindRemoved:
		for _, h := range ev.Removed.EngineHashes {
			n, x = n-1, x^mix64(h)
		}
		if ev.EventID != 0 {
			s.events.Add(1)
			s.removedBlocks.Add(uint64(len(ev.Removed.EngineHashes)))
		}
	case kv.KindCleared:
		n, x = 0, 0
	}
	sum.n.Store(n)
	sum.xor.Store(x)
	return nil
}

// caughtUp reports whether the router holds exactly the workers' blocks.
func (s *countingSink) caughtUp(ws []*benchWorker) bool {
	for _, w := range ws {
		sum := &s.held[w.gen.w.ID]
		if sum.n.Load() != uint64(w.gen.held) || sum.xor.Load() != w.gen.xor {
			return false
		}
	}
	return true
}

type benchWorker struct {
	nc  *nats.Conn
	pub *natsplane.Publisher
	gen *eventGen
	// Published counters, read by the progress line while publishing.
	events, stored, removed atomic.Uint64
}

// startWorkers connects n simulated workers, ids 1..n, and registers each
// with the router and subscriber. Close them with closeWorkers.
func startWorkers(url string, n, blocks, capacity int, seed uint64, r *router.Router, sub *natsplane.Subscriber) ([]*benchWorker, error) {
	var ws []*benchWorker
	for i := range n {
		id := uint64(i + 1)
		nc, err := natsplane.Connect(url, fmt.Sprintf("bench-worker-%d", id), nil)
		if err != nil {
			closeWorkers(ws)
			return nil, err
		}
		pub, err := natsplane.NewPublisher(nc, natsplane.PublisherConfig{Worker: id})
		if err != nil {
			nc.Close()
			closeWorkers(ws)
			return nil, err
		}
		ws = append(ws, &benchWorker{nc: nc, pub: pub, gen: newEventGen(id, blocks, capacity, seed)})
		r.AddWorker(router.WorkerInfo{ID: id, DPSize: 1})
		sub.WorkerAdded(natsplane.Instance{WorkerID: id, URL: "http://127.0.0.1", DPSize: 1})
	}
	return ws, nil
}

func closeWorkers(ws []*benchWorker) {
	for _, w := range ws {
		_ = w.pub.Close()
		w.nc.Close()
	}
}

// PlaneThroughput is the event-throughput measurement.
type PlaneThroughput struct {
	Publishers     int     `json:"publishers"`
	BlocksPerEvent int     `json:"blocks_per_event"`
	WorkerBlocks   int     `json:"worker_blocks"`
	RateTarget     float64 `json:"rate_blocks_per_s,omitempty"`
	PublisherCPUs  int     `json:"publisher_cpus"`
	DurationS      float64 `json:"duration_s"`

	PublishedEvents       uint64  `json:"published_events"`
	PublishedBlocks       uint64  `json:"published_blocks"`
	PublishedBlocksPerS   float64 `json:"published_blocks_per_s"`
	PublishedEventsPerS   float64 `json:"published_events_per_s"`
	AppliedEvents         uint64  `json:"applied_events"`
	AppliedBlocks         uint64  `json:"applied_blocks"`
	AppliedBlocksPerS     float64 `json:"applied_blocks_per_s"`
	AppliedEventsPerS     float64 `json:"applied_events_per_s"`
	AppliedRemovedPerS    float64 `json:"applied_removed_blocks_per_s"`
	TargetBlocksPerS      float64 `json:"target_blocks_per_s"`
	MeetsTarget           bool    `json:"meets_target"`
	LagEventsAtStop       int64   `json:"lag_events_at_stop"`
	LagSAtStop            float64 `json:"lag_s_at_stop"`
	FellBehind            bool    `json:"fell_behind"`
	Drained               bool    `json:"drained"`
	DrainS                float64 `json:"drain_s"`
	RecoveredBlocks       uint64  `json:"recovered_blocks"`
	SlowConsumerDropped   int     `json:"slow_consumer_dropped"`
	Gaps                  uint64  `json:"gaps"`
	RangesRecovered       uint64  `json:"ranges_recovered"`
	Dumps                 uint64  `json:"dumps"`
	RecoveryFailures      uint64  `json:"recovery_failures"`
	RouterReconnects      uint64  `json:"router_reconnects"`
	PublishErrors         uint64  `json:"publish_errors"`
	IndexBlocks           uint64  `json:"index_blocks"`
	WorkerBlocksHeld      uint64  `json:"worker_blocks_held"`
	SubscriberApplyErrors uint64  `json:"apply_errors"`
}

func runPlaneThroughput(ctx context.Context, cfg PlaneConfig, progress io.Writer) (*PlaneThroughput, error) {
	srv, stopNATS, err := startBenchNATS()
	if err != nil {
		return nil, err
	}
	defer stopNATS()
	r, err := router.New(router.DefaultConfig())
	if err != nil {
		return nil, err
	}
	sink := &countingSink{Router: r, held: make([]heldSum, cfg.Publishers+1)}
	nc, err := natsplane.Connect(srv.URL(), "bench-router", nil)
	if err != nil {
		return nil, err
	}
	defer nc.Close()
	// The subscription hands messages to the subscriber through a bounded
	// channel; when it is full the client drops them and says so here.
	var eventsSub atomic.Pointer[nats.Subscription]
	nc.SetErrorHandler(func(_ *nats.Conn, s *nats.Subscription, err error) {
		if errors.Is(err, nats.ErrSlowConsumer) && s != nil && strings.HasSuffix(s.Subject, ".kv-events") {
			eventsSub.Store(s)
		}
	})
	sub, err := natsplane.NewSubscriber(nc, natsplane.SubscriberConfig{RouterID: "bench-throughput"}, sink)
	if err != nil {
		return nil, err
	}
	if err := sub.Start(ctx); err != nil {
		return nil, err
	}
	defer sub.Close()
	ws, err := startWorkers(srv.URL(), cfg.Publishers, cfg.BlocksPerEvent, cfg.WorkerBlocks, cfg.Seed, r, sub)
	if err != nil {
		return nil, err
	}
	defer closeWorkers(ws)
	if !waitFor(ctx, 30*time.Second, time.Millisecond, func() bool { return sub.Stats().Dumps >= uint64(len(ws)) }, nil) {
		return nil, errors.New("the subscriber did not sync every worker within 30 s")
	}
	fmt.Fprintf(progress, "throughput: %d publishers, %d blocks/event, %v...\n", cfg.Publishers, cfg.BlocksPerEvent, cfg.Duration)

	var stop atomic.Bool
	var wg sync.WaitGroup
	start := time.Now()
	perWorkerRate := cfg.Rate / float64(len(ws))
	var cpus chan struct{}
	if cfg.PublisherCPUs > 0 {
		cpus = make(chan struct{}, cfg.PublisherCPUs)
	}
	for _, w := range ws {
		wg.Add(1)
		go func() {
			defer wg.Done()
			w.publish(&stop, start, perWorkerRate, cpus)
		}()
	}
	stopped := make(chan struct{})
	progressDone := make(chan struct{})
	go func() {
		defer close(progressDone)
		t := time.NewTicker(time.Second)
		defer t.Stop()
		var lastPub, lastApplied uint64
		for {
			select {
			case <-stopped:
				return
			case <-t.C:
			}
			var pub uint64
			for _, w := range ws {
				pub += w.stored.Load()
			}
			applied := sink.storedBlocks.Load()
			fmt.Fprintf(progress, "throughput: %4.0f s  published %s blocks/s  applied %s blocks/s\n",
				time.Since(start).Seconds(), Thousands(float64(pub-lastPub)), Thousands(float64(applied-lastApplied)))
			lastPub, lastApplied = pub, applied
		}
	}()
	select {
	case <-ctx.Done():
	case <-time.After(cfg.Duration):
	}
	stop.Store(true)
	close(stopped)
	wg.Wait()
	window := time.Since(start)
	appliedEvents, appliedStored, appliedRemoved := sink.events.Load(), sink.storedBlocks.Load(), sink.removedBlocks.Load()
	<-progressDone
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}

	res := &PlaneThroughput{
		Publishers: cfg.Publishers, BlocksPerEvent: cfg.BlocksPerEvent, WorkerBlocks: cfg.WorkerBlocks,
		RateTarget: cfg.Rate, PublisherCPUs: cfg.PublisherCPUs, DurationS: window.Seconds(), TargetBlocksPerS: planeTargetBlocksPerS,
	}
	var held uint64
	for _, w := range ws {
		res.PublishedEvents += w.events.Load()
		res.PublishedBlocks += w.stored.Load()
		res.PublishErrors += w.pub.Stats().PublishErrors
		held += uint64(w.gen.held)
	}
	res.AppliedEvents, res.AppliedBlocks = appliedEvents, appliedStored
	res.LagEventsAtStop = int64(res.PublishedEvents) - int64(appliedEvents)
	res.PublishedBlocksPerS = float64(res.PublishedBlocks) / window.Seconds()
	res.PublishedEventsPerS = float64(res.PublishedEvents) / window.Seconds()
	res.AppliedBlocksPerS = float64(appliedStored) / window.Seconds()
	res.AppliedEventsPerS = float64(appliedEvents) / window.Seconds()
	res.AppliedRemovedPerS = float64(appliedRemoved) / window.Seconds()
	res.MeetsTarget = res.AppliedBlocksPerS >= planeTargetBlocksPerS
	if res.PublishedEventsPerS > 0 {
		res.LagSAtStop = float64(max(res.LagEventsAtStop, 0)) / res.PublishedEventsPerS
	}

	// Load reports carry each worker's newest event id: they reveal losses
	// at the very end that no later event would, as agents' reports do.
	fmt.Fprintf(progress, "throughput: publishing stopped; waiting for the subscriber to drain %d events...\n", max(res.LagEventsAtStop, 0))
	drainStart := start.Add(window)
	lastReport := time.Time{}
	res.Drained = waitFor(ctx, max(30*time.Second, cfg.Duration), time.Millisecond, func() bool {
		if time.Since(lastReport) > 250*time.Millisecond {
			for _, w := range ws {
				_ = w.pub.PublishLoad(natsplane.LoadReport{})
			}
			lastReport = time.Now()
		}
		return sink.caughtUp(ws)
	}, func() {
		st := sub.Stats()
		fmt.Fprintf(progress, "throughput: draining: %s events applied, %d gaps, %d dumps so far\n", Thousands(float64(st.Applied)), st.Gaps, st.Dumps)
	})
	res.DrainS = time.Since(drainStart).Seconds()
	st := sub.Stats()
	res.Gaps, res.RangesRecovered, res.RecoveryFailures = st.Gaps, st.RangesRecovered, st.RecoveryFailures
	res.Dumps = st.Dumps - uint64(len(ws)) // the initial syncs are not recoveries
	res.SubscriberApplyErrors = st.ApplyErrors
	res.RecoveredBlocks = sink.recoveredBlocks.Load()
	if s := eventsSub.Load(); s != nil {
		res.SlowConsumerDropped, _ = s.Dropped()
	}
	res.IndexBlocks, res.WorkerBlocksHeld = r.Stats().IndexedPairs, held
	res.RouterReconnects = nc.Stats().Reconnects
	res.FellBehind = !res.Drained || res.LagSAtStop > 0.5 || res.Gaps > 0 || res.SlowConsumerDropped > 0 || res.RouterReconnects > 0
	return res, nil
}

// publish sends the worker's events until stop; perSecond > 0 paces it to
// that many blocks per second, measured from start. cpus, when not nil,
// is a token held while generating and sending, so that publishers
// together take no more of the machine than workers on other hosts would
// take from the router. A load report goes out every second, as an
// agent's does.
func (w *benchWorker) publish(stop *atomic.Bool, start time.Time, perSecond float64, cpus chan struct{}) {
	nextReport := start.Add(time.Second)
	var stored float64
	for i := 0; !stop.Load(); i++ {
		if cpus != nil && i%publishTurn == 0 {
			if i > 0 {
				<-cpus
			}
			cpus <- struct{}{}
		}
		ev := w.gen.event(w.gen.blocks)
		if err := w.pub.Publish(ev); err != nil {
			continue
		}
		w.events.Add(1)
		if ev.Kind == kv.KindStored {
			w.stored.Add(uint64(len(ev.Stored.Blocks)))
			stored += float64(len(ev.Stored.Blocks))
		} else {
			w.removed.Add(uint64(len(ev.Removed.EngineHashes)))
		}
		if i%publishTurn != publishTurn-1 {
			continue
		}
		now := time.Now()
		if now.After(nextReport) {
			_ = w.pub.PublishLoad(natsplane.LoadReport{})
			nextReport = nextReport.Add(time.Second)
		}
		if perSecond > 0 {
			if ahead := start.Add(time.Duration(stored / perSecond * float64(time.Second))).Sub(now); ahead > time.Millisecond {
				if cpus != nil {
					<-cpus
				}
				time.Sleep(ahead)
				if cpus != nil {
					cpus <- struct{}{}
				}
			}
		}
	}
	if cpus != nil {
		<-cpus
	}
}

// publishTurn is how many events a publisher sends per turn on a CPU
// token: enough to make the hand-over cheap, few enough to interleave.
const publishTurn = 8

// PlaneRecovery is the recovery-time measurement.
type PlaneRecovery struct {
	Blocks            int     `json:"blocks"`
	Workers           int     `json:"workers"`
	BuildS            float64 `json:"build_s"`
	SnapshotThreshold uint64  `json:"snapshot_threshold"`
	StreamLastSeq     uint64  `json:"stream_last_seq"`
	TargetS           float64 `json:"target_s"`

	DurableS              float64 `json:"durable_s"`
	DurableMeetsTarget    bool    `json:"durable_meets_target"`
	DurableSnapshotBlocks uint64  `json:"durable_snapshot_blocks"`
	DurableStreamEvents   uint64  `json:"durable_stream_events"`
	DurableStartS         float64 `json:"durable_start_s"`

	CoreS           float64 `json:"core_s"`
	CoreMeetsTarget bool    `json:"core_meets_target"`
	CoreDumps       uint64  `json:"core_dumps"`
}

func runPlaneRecovery(ctx context.Context, cfg PlaneConfig, progress io.Writer) (*PlaneRecovery, error) {
	srv, stopNATS, err := startBenchNATS()
	if err != nil {
		return nil, err
	}
	defer stopNATS()
	admin, err := natsplane.Connect(srv.URL(), "bench-admin", nil)
	if err != nil {
		return nil, err
	}
	defer admin.Close()
	js, err := jetstream.New(admin)
	if err != nil {
		return nil, err
	}
	stream, err := natsplane.EnsureStream(ctx, js, natsplane.Names{})
	if err != nil {
		return nil, err
	}
	n, bpe := cfg.Publishers, cfg.BlocksPerEvent
	events := (cfg.RecoveryBlocks + bpe - 1) / bpe
	res := &PlaneRecovery{Blocks: cfg.RecoveryBlocks, Workers: n, TargetS: planeTargetRecovery.Seconds(), SnapshotThreshold: cfg.SnapshotEvents}
	if res.SnapshotThreshold == 0 {
		// Low enough that the build crosses it: the new replica starts from a
		// snapshot and a tail, the path a replica of a long-lived fleet takes.
		res.SnapshotThreshold = uint64(max(events/8, 16))
	}
	// A threshold the build does not cross leaves the whole stream to replay.
	snapshots := res.SnapshotThreshold < uint64(events)

	// Replica a follows the build on the durable plane and writes the
	// snapshot; it is closed before anything is timed.
	ra, err := router.New(router.DefaultConfig())
	if err != nil {
		return nil, err
	}
	subA, err := natsplane.NewSubscriber(admin, natsplane.SubscriberConfig{RouterID: "bench-recovery-a", Durable: true, SnapshotThreshold: res.SnapshotThreshold}, ra)
	if err != nil {
		return nil, err
	}
	ws, err := startWorkers(srv.URL(), n, bpe, 0, cfg.Seed, ra, subA)
	if err != nil {
		return nil, err
	}
	defer closeWorkers(ws)
	if err := subA.Start(ctx); err != nil {
		return nil, err
	}
	closedA := false
	defer func() {
		if !closedA {
			subA.Close()
		}
	}()

	fmt.Fprintf(progress, "recovery: publishing %d blocks over %d workers on the durable plane...\n", cfg.RecoveryBlocks, n)
	build := time.Now()
	var wg sync.WaitGroup
	for i, w := range ws {
		share := cfg.RecoveryBlocks / n
		if i < cfg.RecoveryBlocks%n {
			share++
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for share > 0 && ctx.Err() == nil {
				k := min(bpe, share)
				if err := w.pub.Publish(w.gen.event(k)); err == nil {
					share -= k
				}
			}
		}()
	}
	wg.Wait()
	for _, w := range ws {
		if err := w.nc.Flush(); err != nil {
			return nil, err
		}
	}
	want := uint64(cfg.RecoveryBlocks)
	fmt.Fprintln(progress, "recovery: waiting for replica a to apply every event and write a snapshot...")
	// The stream stores what the workers sent asynchronously, so its last
	// sequence counts only once replica a holds every block.
	if !waitFor(ctx, 120*time.Second, 10*time.Millisecond, func() bool {
		return (subA.Stats().Snapshots > 0 || !snapshots) && ra.Stats().IndexedPairs == want
	}, func() {
		fmt.Fprintf(progress, "recovery: replica a holds %s of %s blocks, %d snapshot(s)\n", Thousands(float64(ra.Stats().IndexedPairs)), Thousands(float64(want)), subA.Stats().Snapshots)
	}) {
		return nil, fmt.Errorf("replica a: %d snapshots, %d of %d blocks within 120 s", subA.Stats().Snapshots, ra.Stats().IndexedPairs, want)
	}
	info, err := stream.Info(ctx)
	if err != nil {
		return nil, err
	}
	res.StreamLastSeq = info.State.LastSeq
	if !waitFor(ctx, 10*time.Second, time.Millisecond, func() bool { return subA.Stats().StreamSeq >= res.StreamLastSeq }, nil) {
		return nil, fmt.Errorf("replica a: stream seq %d of %d", subA.Stats().StreamSeq, res.StreamLastSeq)
	}
	res.BuildS = time.Since(build).Seconds()
	subA.Close()
	closedA = true

	fmt.Fprintln(progress, "recovery: new replica on the durable plane (snapshot + stream)...")
	rb, err := router.New(router.DefaultConfig())
	if err != nil {
		return nil, err
	}
	subB, err := natsplane.NewSubscriber(admin, natsplane.SubscriberConfig{RouterID: "bench-recovery-b", Durable: true, SnapshotThreshold: res.SnapshotThreshold}, rb)
	if err != nil {
		return nil, err
	}
	for _, w := range ws {
		rb.AddWorker(router.WorkerInfo{ID: w.gen.w.ID, DPSize: 1})
		subB.WorkerAdded(natsplane.Instance{WorkerID: w.gen.w.ID, URL: "http://127.0.0.1", DPSize: 1})
	}
	t0 := time.Now()
	if err := subB.Start(ctx); err != nil {
		return nil, err
	}
	res.DurableStartS = time.Since(t0).Seconds()
	ok := waitFor(ctx, 60*time.Second, time.Millisecond, func() bool {
		return subB.Stats().StreamSeq >= res.StreamLastSeq && rb.Stats().IndexedPairs == want
	}, func() {
		fmt.Fprintf(progress, "recovery: new replica holds %s of %s blocks\n", Thousands(float64(rb.Stats().IndexedPairs)), Thousands(float64(want)))
	})
	res.DurableS = time.Since(t0).Seconds()
	st := subB.Stats()
	subB.Close()
	if !ok {
		return nil, fmt.Errorf("durable replica: %d of %d blocks, stream seq %d of %d within 60 s", rb.Stats().IndexedPairs, want, st.StreamSeq, res.StreamLastSeq)
	}
	res.DurableSnapshotBlocks = st.SnapshotBlocksLoaded
	res.DurableStreamEvents = st.Applied - st.SnapshotBlocksLoaded
	res.DurableMeetsTarget = res.DurableS <= planeTargetRecovery.Seconds()

	fmt.Fprintln(progress, "recovery: new NATS-core router dumping every worker...")
	rc, err := router.New(router.DefaultConfig())
	if err != nil {
		return nil, err
	}
	subC, err := natsplane.NewSubscriber(admin, natsplane.SubscriberConfig{RouterID: "bench-recovery-c"}, rc)
	if err != nil {
		return nil, err
	}
	for _, w := range ws {
		rc.AddWorker(router.WorkerInfo{ID: w.gen.w.ID, DPSize: 1})
		subC.WorkerAdded(natsplane.Instance{WorkerID: w.gen.w.ID, URL: "http://127.0.0.1", DPSize: 1})
	}
	t0 = time.Now()
	if err := subC.Start(ctx); err != nil {
		return nil, err
	}
	ok = waitFor(ctx, 60*time.Second, time.Millisecond, func() bool {
		return subC.Stats().Dumps >= uint64(n) && rc.Stats().IndexedPairs == want
	}, func() {
		fmt.Fprintf(progress, "recovery: core router holds %s of %s blocks\n", Thousands(float64(rc.Stats().IndexedPairs)), Thousands(float64(want)))
	})
	res.CoreS = time.Since(t0).Seconds()
	res.CoreDumps = subC.Stats().Dumps
	subC.Close()
	if !ok {
		return nil, fmt.Errorf("core router: %d of %d blocks, %d of %d dumps within 60 s", rc.Stats().IndexedPairs, want, res.CoreDumps, n)
	}
	res.CoreMeetsTarget = res.CoreS <= planeTargetRecovery.Seconds()
	return res, nil
}

// PlaneReplicas compares one router with two replicas in front of the
// same engines.
type PlaneReplicas struct {
	Engines      int                 `json:"engines"`
	Speedup      float64             `json:"speedup_ratio"`
	Concurrency  int                 `json:"concurrency"`
	PromptTokens int                 `json:"prompt_tokens"`
	MaxTokens    int                 `json:"max_tokens"`
	Setups       []PlaneReplicaSetup `json:"setups"`
}

// PlaneReplicaSetup is one setup of the replicas measurement.
type PlaneReplicaSetup struct {
	Replicas    int     `json:"replicas"`
	ReplicaSync bool    `json:"replica_sync"`
	Requests    int     `json:"requests"`
	Errors      int     `json:"errors"`
	RequestsPS  float64 `json:"requests_per_s"`
	P50ms       float64 `json:"p50_ms"`
	P99ms       float64 `json:"p99_ms"`
	DurationS   float64 `json:"duration_s"`
}

// Prompts are one of a few shared prefixes (system prompts) and a unique
// tail, so engines report reusable blocks and the routers' index matters.
const (
	replicaPrefixes     = 8
	replicaPrefixTokens = 64
	replicaTailTokens   = 16
)

func runPlaneReplicas(ctx context.Context, cfg PlaneConfig, progress io.Writer) (*PlaneReplicas, error) {
	srv, stopNATS, err := startBenchNATS()
	if err != nil {
		return nil, err
	}
	defer stopNATS()
	fcfg := fleet.DefaultConfig()
	fcfg.NumWorkers, fcfg.SpeedupRatio = cfg.Engines, cfg.Speedup
	fcfg.Host, fcfg.HTTPPort, fcfg.KVEventsPort, fcfg.KVEventsReplayPort = "127.0.0.1", 0, 0, 0
	engines, err := fleet.Start(ctx, fcfg)
	if err != nil {
		return nil, err
	}
	defer engines.Close()
	agentConn, err := natsplane.Connect(srv.URL(), "bench-agents", nil)
	if err != nil {
		return nil, err
	}
	defer agentConn.Close()
	workers := serve.FleetWorkers(engines, fcfg)
	for _, w := range workers {
		a, err := agent.Start(ctx, agentConn, agent.Config{
			Events: w.Events, Replay: w.Replay,
			Instance: natsplane.Instance{
				WorkerID: w.ID, Name: w.Name, Model: w.Model, URL: w.URL, BlockSize: fcfg.Engine.BlockSize,
				DPSize: w.DPSize, TotalKVBlocks: w.KVBlocks, MaxNumBatchedTokens: w.MaxBatchedTokens,
			},
		})
		if err != nil {
			return nil, err
		}
		defer a.Close()
	}
	rcfg := router.DefaultConfig()
	rcfg.BlockSize = fcfg.Engine.BlockSize
	rcfg.QueueThreshold = nil // measure the routers, not admission control

	res := &PlaneReplicas{Engines: cfg.Engines, Speedup: cfg.Speedup, Concurrency: cfg.Concurrency,
		PromptTokens: replicaPrefixTokens + replicaTailTokens, MaxTokens: cfg.MaxTokens}
	for _, n := range []int{1, 2} {
		setup, err := replicaPhase(ctx, cfg, srv.URL(), rcfg, fcfg.Server.Model, len(workers), n, progress)
		if err != nil {
			return nil, fmt.Errorf("%d replica(s): %w", n, err)
		}
		res.Setups = append(res.Setups, setup)
	}
	return res, nil
}

func replicaPhase(ctx context.Context, cfg PlaneConfig, url string, rcfg router.Config, model string, engines, n int, progress io.Writer) (PlaneReplicaSetup, error) {
	setup := PlaneReplicaSetup{Replicas: n, ReplicaSync: n > 1}
	var targets []string
	for i := range n {
		// Each replica has its own connection, as separate processes would.
		nc, err := natsplane.Connect(url, fmt.Sprintf("bench-replica-%d-%d", n, i), nil)
		if err != nil {
			return setup, err
		}
		defer nc.Close()
		s, err := serve.Start(ctx, serve.Config{Router: rcfg, Addr: "127.0.0.1:0", Plane: &serve.Plane{
			Conn: nc, RouterID: fmt.Sprintf("bench-replica-%d-%d", n, i), ReplicaSync: setup.ReplicaSync, LeaseTTL: natsplane.DefaultLeaseTTL,
		}})
		if err != nil {
			return setup, err
		}
		defer s.Close()
		ready, cancel := context.WithTimeout(ctx, 10*time.Second)
		err = s.WaitWorkers(ready, func(live int) bool { return live >= engines })
		cancel()
		if err != nil {
			return setup, fmt.Errorf("engines did not join replica %d: %w", i, err)
		}
		targets = append(targets, "http://"+s.Addr())
	}
	fmt.Fprintf(progress, "replicas: %d replica(s)%s, %d clients, %v...\n", n, map[bool]string{true: " with replica sync"}[setup.ReplicaSync], cfg.Concurrency, cfg.ReplicaDuration)

	client := &http.Client{Transport: &http.Transport{MaxIdleConns: 2 * cfg.Concurrency, MaxIdleConnsPerHost: cfg.Concurrency}, Timeout: 30 * time.Second}
	defer client.CloseIdleConnections()
	prefixes := make([][]uint32, replicaPrefixes)
	prng := rand.New(rand.NewPCG(cfg.Seed, 0))
	for i := range prefixes {
		prefixes[i] = make([]uint32, replicaPrefixTokens)
		for j := range prefixes[i] {
			prefixes[i][j] = uint32(prng.IntN(128000))
		}
	}
	warmup := min(time.Second, cfg.ReplicaDuration/5)
	rngs := make([]*rand.Rand, cfg.Concurrency)
	prompts := make([][]uint32, cfg.Concurrency)
	for c := range rngs {
		rngs[c] = rand.New(rand.NewPCG(cfg.Seed, uint64(c)+1))
		prompts[c] = make([]uint32, replicaPrefixTokens+replicaTailTokens)
	}
	w, err := ClosedLoop(ctx, cfg.Concurrency, warmup, cfg.ReplicaDuration, func(ctx context.Context, c, i int) (float64, error) {
		rng, prompt := rngs[c], prompts[c]
		copy(prompt, prefixes[rng.IntN(len(prefixes))])
		for j := replicaPrefixTokens; j < len(prompt); j++ {
			prompt[j] = uint32(rng.IntN(128000))
		}
		t0 := time.Now()
		err := completeOnce(ctx, client, targets[(c+i)%len(targets)], model, prompt, cfg.MaxTokens)
		return float64(time.Since(t0).Microseconds()) / 1e3, err
	})
	if err != nil {
		return setup, err
	}
	lat, elapsed := w.Samples, w.Elapsed
	if ctx.Err() != nil {
		return setup, ctx.Err()
	}
	setup.Requests, setup.Errors, setup.DurationS = len(lat), w.Errors, elapsed.Seconds()
	setup.RequestsPS = float64(len(lat)) / elapsed.Seconds()
	setup.P50ms, setup.P99ms = Percentile(lat, 50), Percentile(lat, 99)
	if setup.Requests == 0 {
		if w.FirstErr != nil {
			return setup, fmt.Errorf("no request succeeded: %w", w.FirstErr)
		}
		return setup, errors.New("no request completed")
	}
	return setup, nil
}

func completeOnce(ctx context.Context, client *http.Client, base, model string, prompt []uint32, maxTokens int) error {
	body, _ := json.Marshal(map[string]any{"model": model, "prompt": prompt, "max_tokens": maxTokens})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("status %d: %s", resp.StatusCode, bytes.TrimSpace(b))
	}
	return nil
}

// Thousands formats x rounded, with thin groups of three digits.
func Thousands(x float64) string {
	s := fmt.Sprintf("%.0f", x)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	if neg {
		return "-" + b.String()
	}
	return b.String()
}
