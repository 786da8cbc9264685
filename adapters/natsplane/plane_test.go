package natsplane

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/core/sched"
	"github.com/kvrouter/kvrouter/internal/testwait"
)

func startServer(t *testing.T) *Embedded {
	t.Helper()
	srv, err := StartEmbedded(EmbeddedConfig{StoreDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	return srv
}

func connect(t *testing.T, url string) *nats.Conn {
	t.Helper()
	nc, err := Connect(url, t.Name(), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return nc
}

func newRouter(t *testing.T, workers ...uint64) *router.Router {
	t.Helper()
	r, err := router.New(router.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range workers {
		r.AddWorker(router.WorkerInfo{ID: w, DPSize: 1})
	}
	return r
}

// startPublishers starts one publisher per worker, each on its own
// connection, as separate agents would be.
func startPublishers(t *testing.T, url string, ids ...uint64) []*Publisher {
	t.Helper()
	pubs := make([]*Publisher, 0, len(ids))
	for _, id := range ids {
		p, err := NewPublisher(connect(t, url), PublisherConfig{Worker: id})
		if err != nil {
			t.Fatal(err)
		}
		pubs = append(pubs, p)
	}
	return pubs
}

// startSubscriber starts a router fed by the plane; workers are announced
// before Start, as serve does with the workers discovery lists.
func startSubscriber(t *testing.T, url string, cfg SubscriberConfig, workers ...uint64) (*Subscriber, *router.Router) {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelWarn}))
	}
	r := newRouter(t, workers...)
	sub, err := NewSubscriber(connect(t, url), cfg, r)
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range workers {
		sub.WorkerAdded(Instance{WorkerID: w, URL: "http://x", DPSize: 1})
	}
	if err := sub.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sub.Close)
	return sub, r
}

// canonical orders a dump by worker rank, keeping each rank's own order:
// an index dump is deterministic per rank, but ranks come in shard order.
func canonical(events []kv.Event) []string {
	type line struct {
		w   kv.Worker
		i   int
		txt string
	}
	lines := make([]line, 0, len(events))
	for i, ev := range events {
		ev.EventID = 0
		b, _ := json.Marshal(ev)
		lines = append(lines, line{ev.Worker, i, string(b)})
	}
	slices.SortStableFunc(lines, func(a, b line) int {
		return cmp.Or(cmp.Compare(a.w.ID, b.w.ID), cmp.Compare(a.w.DPRank, b.w.DPRank))
	})
	out := make([]string, len(lines))
	for i, l := range lines {
		out[i] = l.txt
	}
	return out
}

// truth is every worker's own account of its blocks.
func truth(pubs ...*Publisher) []string {
	var all []kv.Event
	for _, p := range pubs {
		for _, rank := range p.log.Ranks() {
			evs, _ := p.Dump(rank)
			all = append(all, evs...)
		}
	}
	return canonical(all)
}

// workload produces a worker's KV events: chains stored under random known
// blocks (or the root), removals of random blocks, now and then a clear.
// Chains go to every storage tier, and device blocks are offloaded (the
// same block stored on a lower tier), so that every path a dump takes
// must carry the tier.
type workload struct {
	worker uint64
	rng    *rand.Rand
	held   []heldBlock
	next   uint64
}

type heldBlock struct {
	hash, local uint64
	parent      *uint64
	tier        kv.StorageTier
}

var workloadTiers = []kv.StorageTier{kv.TierDevice, kv.TierDevice, kv.TierDevice, kv.TierHostPinned, kv.TierDisk, kv.TierExternal}

func newWorkload(worker uint64, seed uint64) *workload {
	return &workload{worker: worker, rng: rand.New(rand.NewPCG(seed, worker)), next: worker << 32}
}

func (g *workload) event() kv.Event {
	w := kv.Worker{ID: g.worker}
	switch p := g.rng.IntN(100); {
	case p < 25 && len(g.held) > 0:
		i := g.rng.IntN(len(g.held))
		b := g.held[i]
		g.held = slices.Delete(g.held, i, i+1)
		ev := kv.RemovedEvent(w, 0, b.hash)
		ev.Tier = b.tier
		return ev
	case p < 35 && len(g.held) > 0:
		// Offload a block to a lower tier, under the parent it has.
		b := g.held[g.rng.IntN(len(g.held))]
		b.tier = workloadTiers[3+g.rng.IntN(3)]
		g.held = append(g.held, b)
		ev := kv.StoredEvent(w, 0, b.parent, kv.Block{EngineHash: b.hash, LocalHash: b.local})
		ev.Tier = b.tier
		return ev
	case p == 99:
		g.held = g.held[:0]
		return kv.ClearedEvent(w, 0)
	}
	var parent *uint64
	if len(g.held) > 0 && g.rng.IntN(3) > 0 {
		parent = kv.Ptr(g.held[g.rng.IntN(len(g.held))].hash)
	}
	tier := workloadTiers[g.rng.IntN(len(workloadTiers))]
	blocks := make([]kv.Block, 1+g.rng.IntN(8))
	up := parent
	for i := range blocks {
		g.next++
		blocks[i] = kv.Block{EngineHash: g.next, LocalHash: uint64(g.rng.IntN(50))}
		g.held = append(g.held, heldBlock{hash: g.next, local: blocks[i].LocalHash, parent: up, tier: tier})
		up = kv.Ptr(g.next)
	}
	ev := kv.StoredEvent(w, 0, parent, blocks...)
	ev.Tier = tier
	return ev
}

type lossy struct {
	mu  sync.Mutex
	rng *rand.Rand
	pct int
	// from..to (1-based publish counts) are all lost, for ring overflows.
	n, from, to int
}

func (l *lossy) lose() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.n++
	if l.n >= l.from && l.n <= l.to {
		return true
	}
	return l.rng.IntN(100) < l.pct
}

// workloads continue each publisher's history across publishAll calls.
var workloads sync.Map // *Publisher → *workload

func publishAll(t *testing.T, pubs []*Publisher, n int) {
	t.Helper()
	for i, p := range pubs {
		v, _ := workloads.LoadOrStore(p, newWorkload(p.cfg.Worker, uint64(i)+1))
		g := v.(*workload)
		for range n {
			_ = p.Publish(g.event()) // a removal of a block the index dropped is refused, as by an engine
		}
		if err := p.nc.Flush(); err != nil {
			t.Fatal(err)
		}
	}
}

func TestCorePlaneConvergesUnderLossAndRingOverflow(t *testing.T) {
	tests := []struct {
		name      string
		lossPct   int
		burstFrom int
		burstTo   int
		rounds    int
		wantDumps bool
	}{
		{name: "10% of events lost", lossPct: 10, rounds: 10},
		{name: "a loss longer than the ring", burstFrom: 200, burstTo: 200 + 1500, rounds: 1, wantDumps: true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			srv := startServer(t)
			ids := []uint64{11, 12, 13, 14}
			var pubs []*Publisher
			for _, id := range ids {
				loss := &lossy{rng: rand.New(rand.NewPCG(id, 7)), pct: tc.lossPct, from: tc.burstFrom, to: tc.burstTo}
				p, err := NewPublisher(connect(t, srv.URL()), PublisherConfig{Worker: id, Loss: loss.lose})
				if err != nil {
					t.Fatal(err)
				}
				pubs = append(pubs, p)
			}
			sub, r := startSubscriber(t, srv.URL(), SubscriberConfig{RouterID: "r1"}, ids...)
			// A start-up dump served after the burst would carry the lost
			// events, and the subscriber would never see a gap.
			testwait.Until(t, 10*time.Second, "start-up dumps", func() bool { return sub.Stats().Dumps >= uint64(len(ids)) })
			// Rounds of events, each followed by convergence, keep most
			// gaps within the ring, where ranges recover them.
			for range tc.rounds {
				publishAll(t, pubs, 3000/tc.rounds)
				want := truth(pubs...)
				// Losses at the very end are only revealed by load reports.
				testwait.Until(t, 20*time.Second, "router index equals the workers' blocks", func() bool {
					for _, p := range pubs {
						_ = p.PublishLoad(LoadReport{})
					}
					return slices.Equal(canonical(r.DumpEvents()), want)
				})
			}
			var lost uint64
			for _, p := range pubs {
				lost += p.Stats().Lost
			}
			if lost == 0 {
				t.Fatal("the test lost nothing")
			}
			st := sub.Stats()
			if st.Gaps == 0 || st.RecoveryFailures != 0 {
				t.Fatalf("stats %+v: want gaps and no failed recovery", st)
			}
			if tc.wantDumps && st.Dumps <= uint64(len(ids)) {
				t.Fatalf("ring overflow not recovered by dump: %+v", st)
			}
			if !tc.wantDumps && st.RangesRecovered == 0 {
				t.Fatalf("no range recovery: %+v", st)
			}
			t.Logf("lost %d of %d; %+v", lost, 4*3000, st)
		})
	}
}

// onEveryTier fails unless a dump's lines hold blocks of every tier.
func onEveryTier(t *testing.T, lines []string) {
	t.Helper()
	for _, tier := range []kv.StorageTier{kv.TierDevice, kv.TierHostPinned, kv.TierDisk, kv.TierExternal} {
		if !slices.ContainsFunc(lines, func(l string) bool { return strings.Contains(l, `"storage_tier":"`+string(tier)+`"`) }) {
			t.Fatalf("the workers hold no %s block: the test would not see a tier dropped", tier)
		}
	}
}

func TestCorePlaneNewRouterDumpsEveryWorker(t *testing.T) {
	srv := startServer(t)
	ids := []uint64{21, 22}
	pubs := startPublishers(t, srv.URL(), ids...)
	publishAll(t, pubs, 500) // nobody listens yet
	_, r := startSubscriber(t, srv.URL(), SubscriberConfig{RouterID: "late"}, ids...)
	want := truth(pubs...)
	onEveryTier(t, want)
	testwait.Until(t, 10*time.Second, "dumped state", func() bool { return slices.Equal(canonical(r.DumpEvents()), want) })
	publishAll(t, pubs, 200) // and live events follow on
	want = truth(pubs...)
	testwait.Until(t, 10*time.Second, "live state", func() bool { return slices.Equal(canonical(r.DumpEvents()), want) })
}

func TestMalformedMessagesAreCountedAndSkipped(t *testing.T) {
	srv := startServer(t)
	nc := connect(t, srv.URL())
	sub, r := startSubscriber(t, srv.URL(), SubscriberConfig{RouterID: "r"}, 31)
	names := Names{}.orDefault()
	for _, junk := range []string{"", "{", `{"worker_id":31,"event":{"event_id":1,"data":"exploded"}}`, "\x00\xff"} {
		if err := nc.Publish(names.KVEvents(), []byte(junk)); err != nil {
			t.Fatal(err)
		}
	}
	_ = nc.Publish(names.KVMetrics(), []byte("not json"))
	p := startPublishers(t, srv.URL(), 31)[0]
	if _, err := nc.Request(names.Recovery(31), []byte("{bad"), 200*time.Millisecond); err == nil {
		t.Fatal("a malformed recovery request was answered")
	}
	if p.Stats().MalformedRequests != 1 {
		t.Fatalf("malformed recovery request not counted: %+v", p.Stats())
	}
	publishAll(t, []*Publisher{p}, 50)
	want := truth(p)
	testwait.Until(t, 10*time.Second, "junk skipped, good events applied", func() bool {
		return sub.Stats().Malformed == 5 && slices.Equal(canonical(r.DumpEvents()), want)
	})
}

func TestDumpCodecRoundTripAndCorruption(t *testing.T) {
	evs := []kv.Event{
		kv.StoredEvent(kv.Worker{ID: 1, DPRank: 2}, 0, nil, kv.Block{EngineHash: 5, LocalHash: 6}),
		kv.StoredEvent(kv.Worker{ID: 1<<63 + 1}, 0, kv.Ptr(5), kv.Block{EngineHash: 7, LocalHash: 8}),
		kv.RemovedEvent(kv.Worker{ID: 1<<63 + 1}, 0, 5),
	}
	b, err := EncodeDump(nil, evs)
	if err != nil {
		t.Fatal(err)
	}
	var got []kv.Event
	if err := DecodeDump(b, func(ev *kv.Event) error {
		c := *ev
		c.Stored.Blocks = slices.Clone(ev.Stored.Blocks)
		c.Removed.EngineHashes = slices.Clone(ev.Removed.EngineHashes)
		if ev.Stored.Parent != nil {
			c.Stored.Parent = kv.Ptr(*ev.Stored.Parent)
		}
		got = append(got, c)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(canonical(got), canonical(evs)) {
		t.Fatalf("round trip: %v", got)
	}
	for i, bad := range [][]byte{nil, []byte("KVD0"), b[:len(b)-1], append(slices.Clone(b[:4+12]), append([]byte{7}, b[4+13:4+37]...)...)} {
		if err := DecodeDump(bad, func(*kv.Event) error { return nil }); err == nil {
			t.Errorf("corrupt dump %d accepted", i)
		}
	}
	if _, err := EncodeDump(nil, []kv.Event{kv.ClearedEvent(kv.Worker{}, 0)}); err == nil {
		t.Fatal("non-store event encoded")
	}
}

// Engines' own KV usage, reported over the plane, makes them busy.
func TestLoadReportsDriveBusyDetection(t *testing.T) {
	srv := startServer(t)
	cfg := router.DefaultConfig()
	half := 0.5
	cfg.Busy = sched.BusyThreshold{ActiveDecodeBlocks: &half}
	r, err := router.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	sub, err := NewSubscriber(connect(t, srv.URL()), SubscriberConfig{RouterID: "r"}, r)
	if err != nil {
		t.Fatal(err)
	}
	pubs := startPublishers(t, srv.URL(), 61, 62)
	for _, id := range []uint64{61, 62} {
		r.AddWorker(router.WorkerInfo{ID: id, DPSize: 1, TotalKVBlocks: 1000})
		sub.WorkerAdded(Instance{WorkerID: id, URL: "http://x", DPSize: 1})
	}
	if err := sub.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(sub.Close)
	_ = pubs[0].PublishLoad(LoadReport{LoadKnown: true, KVUsage: 0.9})
	_ = pubs[1].PublishLoad(LoadReport{LoadKnown: true, KVUsage: 0.1})
	testwait.Until(t, 5*time.Second, "reports applied", func() bool { return sub.Stats().LoadReports == 2 })
	for range 20 {
		d, err := r.BestWorker(context.Background(), &router.Request{Tokens: make([]uint32, 64)})
		if err != nil || d.Worker.ID != 62 {
			t.Fatalf("routed to %v (%v); worker 61 reports 90%% KV usage", d.Worker, err)
		}
	}
	_ = pubs[1].PublishLoad(LoadReport{LoadKnown: true, KVUsage: 0.95})
	testwait.Until(t, 5*time.Second, "every worker busy", func() bool {
		_, err := r.BestWorker(context.Background(), &router.Request{Tokens: make([]uint32, 64)})
		return errors.Is(err, sched.ErrAllBusy)
	})
}

func BenchmarkDumpCodec(b *testing.B) {
	evs := make([]kv.Event, 100_000)
	for i := range evs {
		evs[i] = kv.StoredEvent(kv.Worker{ID: uint64(i % 64)}, 0, kv.Ptr(uint64(i)), kv.Block{EngineHash: uint64(i + 1), LocalHash: uint64(i * 7)})
	}
	data, _ := EncodeDump(nil, evs)
	b.Run("encode", func(b *testing.B) {
		buf := make([]byte, 0, len(data))
		for b.Loop() {
			buf, _ = EncodeDump(buf[:0], evs)
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(evs)), "ns/block")
	})
	b.Run("decode", func(b *testing.B) {
		for b.Loop() {
			_ = DecodeDump(data, func(*kv.Event) error { return nil })
		}
		b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(evs)), "ns/block")
	})
}

func TestEmbeddedServerOnAPortInUseSaysSo(t *testing.T) {
	srv := startServer(t)
	_, err := StartEmbedded(EmbeddedConfig{StoreDir: t.TempDir(), Port: srv.Port()})
	if err == nil || !strings.Contains(err.Error(), "cannot listen") {
		t.Fatalf("want a clear error, got %v", err)
	}
}

// A snapshot carries each block's storage tier: a replica rebuilt from it
// credits host and disk blocks as the engines published them.
func TestDumpCodecCarriesTheTier(t *testing.T) {
	var evs []kv.Event
	for i, tier := range []kv.StorageTier{kv.TierDevice, kv.TierHostPinned, kv.TierDisk, kv.TierExternal} {
		st := kv.StoredEvent(kv.Worker{ID: 3}, 0, kv.Ptr(uint64(i)), kv.Block{EngineHash: uint64(10 + i), LocalHash: 1})
		rm := kv.RemovedEvent(kv.Worker{ID: 3}, 0, uint64(i))
		st.Tier, rm.Tier = tier, tier
		evs = append(evs, st, rm)
	}
	b, err := EncodeDump(nil, evs)
	if err != nil {
		t.Fatal(err)
	}
	var got []kv.StorageTier
	if err := DecodeDump(b, func(ev *kv.Event) error { got = append(got, ev.Tier); return nil }); err != nil {
		t.Fatal(err)
	}
	for i := range evs {
		if got[i] != evs[i].Tier {
			t.Fatalf("event %d: tier %q, want %q", i, got[i], evs[i].Tier)
		}
	}
	bad := evs[0]
	bad.Tier = "floppy"
	if _, err := EncodeDump(nil, []kv.Event{bad}); err == nil {
		t.Fatal("unknown tier encoded")
	}
}
