package router

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/index"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/sched"
)

const bs = 16

// tokens builds a prompt of n blocks whose first shared blocks come from
// prefix and the rest from salt, so prompts share exactly what they should.
func tokens(prefix, shared, salt, n int) []uint32 {
	out := make([]uint32, 0, n*bs)
	for b := range n {
		src := salt
		if b < shared {
			src = prefix
		}
		for i := range bs {
			out = append(out, uint32(src*100003+b*bs+i))
		}
	}
	return out
}

// store feeds the router the event a worker emits after caching toks.
func store(t testing.TB, r *Router, w kv.Worker, toks []uint32) {
	t.Helper()
	ev := storedEvent(w, toks)
	if err := r.ApplyEvent(&ev); err != nil {
		t.Fatal(err)
	}
}

// storedEvent is the event of w storing toks from the root.
func storedEvent(w kv.Worker, toks []uint32) kv.Event {
	local := blockhash.New(bs, "").LocalHashes(toks)
	blocks := make([]kv.Block, len(local))
	for i, l := range local {
		blocks[i] = kv.Block{EngineHash: l ^ 0x5eed ^ w.ID<<40, LocalHash: l}
	}
	return kv.StoredEvent(w, 0, nil, blocks...)
}

type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

func newRouter(t testing.TB, workers int, edit func(*Config)) (*Router, *clock) {
	t.Helper()
	c := &clock{t: time.Unix(1_000_000, 0)}
	cfg := DefaultConfig()
	cfg.BlockSize = bs
	cfg.Now = c.now
	cfg.Rand = rand.New(rand.NewPCG(1, 2))
	if edit != nil {
		edit(&cfg)
	}
	r, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	for id := range workers {
		r.AddWorker(WorkerInfo{ID: uint64(id), TotalKVBlocks: 16384, MaxNumBatchedTokens: 8192})
	}
	return r, c
}

// lockedRand makes a seeded source safe for the concurrent tests.
type lockedRand struct {
	mu sync.Mutex
	r  *rand.Rand
}

func (l *lockedRand) IntN(n int) int   { l.mu.Lock(); defer l.mu.Unlock(); return l.r.IntN(n) }
func (l *lockedRand) Float64() float64 { l.mu.Lock(); defer l.mu.Unlock(); return l.r.Float64() }
func w(id uint64) kv.Worker            { return kv.Worker{ID: id} }
func ctx() context.Context             { return context.Background() }
func route(r *Router, id string, toks []uint32) (Decision, error) {
	return r.BestWorker(ctx(), &Request{ID: id, Tokens: toks})
}

func TestRequestGoesToWorkerHoldingItsPrefix(t *testing.T) {
	r, _ := newRouter(t, 4, nil)
	store(t, r, w(2), tokens(7, 40, 7, 40))
	store(t, r, w(1), tokens(7, 10, 7, 10))
	d, err := r.BestWorker(ctx(), &Request{Tokens: tokens(7, 40, 99, 50)})
	if err != nil {
		t.Fatal(err)
	}
	if d.Worker != w(2) || d.OverlapBlocks != 40 || d.PromptBlocks != 50 {
		t.Fatalf("decision %+v, want worker 2 with 40 of 50 blocks cached", d)
	}
	if d.Timings.Total <= 0 || d.Timings.Hash <= 0 {
		t.Fatalf("timings not measured: %+v", d.Timings)
	}
	if st := r.Stats(); st.Booked != 0 || d.Timings.Book != 0 {
		t.Fatal("a query must not book")
	}
}

// Each data-parallel rank is matched on its own blocks: the rank holding
// the prefix wins, not its engine's rank 0 nor a neighbour's rank.
func TestRequestGoesToTheRankHoldingItsPrefix(t *testing.T) {
	r, _ := newRouter(t, 0, nil)
	r.AddWorker(WorkerInfo{ID: 3, DPSize: 3})
	r.AddWorker(WorkerInfo{ID: 4, DPSize: 2})
	for _, tc := range []struct {
		holder kv.Worker
		salt   int
	}{{kv.Worker{ID: 3, DPRank: 2}, 11}, {kv.Worker{ID: 4, DPRank: 1}, 12}, {kv.Worker{ID: 3}, 13}} {
		store(t, r, tc.holder, tokens(tc.salt, 30, tc.salt, 30))
		d, err := r.BestWorker(ctx(), &Request{Tokens: tokens(tc.salt, 30, 99, 32)})
		if err != nil {
			t.Fatal(err)
		}
		if d.Worker != tc.holder || d.OverlapBlocks != 30 {
			t.Fatalf("decision %+v, want rank %v with 30 blocks cached", d, tc.holder)
		}
	}
}

func TestHotPrefixBurstSpreads(t *testing.T) {
	// Dynamo issue #737: one cached prefix must not attract the whole
	// burst; each booking raises the holder's cost until others win.
	for _, tc := range []struct {
		name      string
		predicted time.Duration
		// holderAhead: without prediction only the holder has the prefix
		// for the whole burst, so it takes strictly the most; with it,
		// every worker that took one request of the burst is predicted to
		// hold the prefix too, and the rest spreads on load alone.
		holderAhead bool
	}{
		{"events only", 0, true},
		{"predict-on-route", DefaultPredictedTTL, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, _ := newRouter(t, 4, func(c *Config) { c.PredictedTTL = tc.predicted })
			store(t, r, w(0), tokens(1, 32, 1, 32))
			count := map[kv.Worker]int{}
			for i := range 64 {
				d, err := route(r, fmt.Sprint(i), tokens(1, 32, 1000+i, 64))
				if err != nil {
					t.Fatal(err)
				}
				count[d.Worker]++
			}
			if len(count) != 4 {
				t.Fatalf("burst used %d of 4 workers: %v", len(count), count)
			}
			for i := uint64(1); i < 4; i++ {
				if count[w(0)] < count[w(i)] || (tc.holderAhead && count[w(0)] == count[w(i)]) {
					t.Fatalf("the prefix holder should take the most: %v", count)
				}
			}
			for i := range 64 {
				r.MarkPrefillCompleted(fmt.Sprint(i))
				r.Free(fmt.Sprint(i))
			}
			for _, l := range r.Loads() {
				if l.ActiveDecodeBlocks != 0 || l.ActivePrefillTokens != 0 || l.ActiveRequests != 0 {
					t.Fatalf("load left after every request ended: %+v", l)
				}
			}
		})
	}
}

func TestBookingLifecycleAndIdempotentFree(t *testing.T) {
	r, _ := newRouter(t, 2, nil)
	d, err := route(r, "a", tokens(3, 0, 3, 10))
	if err != nil {
		t.Fatal(err)
	}
	load := func() WorkerLoad {
		for _, l := range r.Loads() {
			if l.Worker == d.Worker {
				return l
			}
		}
		t.Fatal("chosen worker missing")
		return WorkerLoad{}
	}
	if l := load(); l.ActivePrefillTokens != 160 || l.ActiveDecodeBlocks != 10 {
		t.Fatalf("after booking: %+v", l)
	}
	// Booking is timed as a part of scheduling.
	if tm := d.Timings; tm.Book <= 0 || tm.Book > tm.Schedule {
		t.Fatalf("booking took %v of a %v schedule", tm.Book, tm.Schedule)
	}
	if _, err := route(r, "a", tokens(3, 0, 3, 10)); !errors.Is(err, ErrDuplicateID) {
		t.Fatalf("duplicate id: %v", err)
	}
	r.MarkPrefillCompleted("a")
	if l := load(); l.ActivePrefillTokens != 0 || l.ActiveDecodeBlocks != 10 {
		t.Fatalf("after first token: %+v", l)
	}
	if !r.Free("a") || r.Free("a") {
		t.Fatal("Free must succeed once and then be a no-op")
	}
	if l := load(); l.ActiveDecodeBlocks != 0 || l.ActiveRequests != 0 {
		t.Fatalf("after free: %+v", l)
	}
}

func TestBusyThresholdsAreLiveAndAllBusyFails(t *testing.T) {
	r, _ := newRouter(t, 2, nil)
	send := func(id string, n int) error {
		_, err := r.BestWorker(ctx(), &Request{ID: id, Model: "m", Tokens: tokens(n, 0, n, 8)})
		return err
	}
	if err := send("x", 1); err != nil {
		t.Fatal(err)
	}
	if err := send("y", 2); err != nil {
		t.Fatal(err)
	}
	limit := 10
	if _, err := r.Thresholds().Set("m", sched.BusyThreshold{ActivePrefillTokens: &limit}); err != nil {
		t.Fatal(err)
	}
	if err := send("z", 3); !errors.Is(err, sched.ErrAllBusy) {
		t.Fatalf("want ErrAllBusy, got %v", err)
	}
	r.MarkPrefillCompleted("x")
	if err := send("z", 3); err != nil {
		t.Fatalf("a worker freed up: %v", err)
	}
	if r.Stats().AllBusy != 1 {
		t.Fatalf("all-busy not counted: %+v", r.Stats())
	}
}

func TestQueueHoldsUntilCapacityAndCancelLeaksNothing(t *testing.T) {
	r, _ := newRouter(t, 1, func(c *Config) {
		q := 1.0
		c.QueueThreshold = &q
	})
	r.AddWorker(WorkerInfo{ID: 0, TotalKVBlocks: 1000, MaxNumBatchedTokens: 100})
	queued := make(chan string, 2)
	r.onQueued = func(id string) { queued <- id }
	if _, err := route(r, "big", tokens(1, 0, 1, 10)); err != nil { // 160 > 1.0 × 100
		t.Fatal(err)
	}
	got := make(chan Decision, 1)
	go func() {
		d, err := route(r, "waiting", tokens(2, 0, 2, 4))
		if err != nil {
			t.Error(err)
		}
		got <- d
	}()
	cctx, cancel := context.WithCancel(ctx())
	gaveUp := make(chan error, 1)
	go func() {
		_, err := r.BestWorker(cctx, &Request{ID: "impatient", Tokens: tokens(3, 0, 3, 4)})
		gaveUp <- err
	}()
	<-queued
	<-queued
	cancel()
	if err := <-gaveUp; !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled waiter: %v", err)
	}
	select {
	case <-got:
		t.Fatal("dispatched while the worker was saturated")
	default:
	}
	r.MarkPrefillCompleted("big")
	d := <-got
	if d.Worker != w(0) {
		t.Fatalf("dispatched to %v", d.Worker)
	}
	r.Free("big")
	r.Free("waiting")
	if st := r.Stats(); st.QueuePending != 0 || st.Load.Active != 0 || st.Queued != 2 {
		t.Fatalf("after the queue drained: %+v", st)
	}
}

// A single-threaded caller never blocks: the queued request's decision
// comes from inside the call that frees capacity, stamped with the
// injected clock.
func TestSubmitQueuesWithoutBlockingAndDispatchesFromFree(t *testing.T) {
	r, c := newRouter(t, 1, func(c *Config) {
		q := 1.0
		c.QueueThreshold = &q
	})
	r.AddWorker(WorkerInfo{ID: 0, TotalKVBlocks: 1000, MaxNumBatchedTokens: 100})
	var dispatched []Decision
	record := func(d Decision, err error) {
		if err != nil {
			t.Error(err)
		}
		dispatched = append(dispatched, d)
	}
	if _, queued, err := r.Submit(&Request{ID: "big", Tokens: tokens(1, 0, 1, 10)}, record); err != nil || queued {
		t.Fatalf("first request: queued %v, %v", queued, err)
	}
	for _, id := range []string{"second", "third"} {
		if _, queued, err := r.Submit(&Request{ID: id, Tokens: tokens(2, 0, 2, 4)}, record); err != nil || !queued {
			t.Fatalf("%s: queued %v, %v", id, queued, err)
		}
	}
	if _, _, err := r.Submit(&Request{ID: "second", Tokens: tokens(2, 0, 2, 4)}, record); !errors.Is(err, ErrDuplicateID) {
		t.Fatalf("a queued id again: %v", err)
	}
	if _, _, err := r.Submit(&Request{Tokens: tokens(2, 0, 2, 4)}, record); err == nil {
		t.Fatal("Submit without an id books nothing and must fail")
	}
	c.advance(3 * time.Second)
	r.MarkPrefillCompleted("big")
	if len(dispatched) != 2 || dispatched[0].Worker != w(0) || dispatched[0].Queued != 3*time.Second {
		t.Fatalf("dispatched %+v", dispatched)
	}
	for _, id := range []string{"big", "second", "third"} {
		r.Free(id)
	}
	if st := r.Stats(); st.QueuePending != 0 || st.Load.Active != 0 || st.Queued != 2 {
		t.Fatalf("after the queue drained: %+v", st)
	}
}

func TestApproximateModeLearnsFromDecisionsAndForgets(t *testing.T) {
	r, c := newRouter(t, 4, func(c *Config) { c.KVEvents = false })
	first, err := route(r, "a", tokens(5, 30, 1, 30))
	if err != nil {
		t.Fatal(err)
	}
	r.Free("a")
	d, err := r.BestWorker(ctx(), &Request{Tokens: tokens(5, 30, 2, 40)})
	if err != nil || d.Worker != first.Worker || d.OverlapBlocks != 30 {
		t.Fatalf("follow-up %+v (%v), want %v with 30 cached", d, err, first.Worker)
	}
	c.advance(121 * time.Second)
	d, _ = r.BestWorker(ctx(), &Request{Tokens: tokens(5, 30, 2, 40)})
	if d.OverlapBlocks != 0 {
		t.Fatalf("prediction outlived its TTL: %+v", d)
	}
	ev := kv.ClearedEvent(w(0), 0)
	if err := r.ApplyEvent(&ev); !errors.Is(err, ErrEventsDisabled) {
		t.Fatalf("events in approximate mode: %v", err)
	}
}

func TestPredictOnRouteColocatesSiblings(t *testing.T) {
	// Each sibling has its first token before the next arrives, but no
	// engine has published the blocks yet: only prediction can see them.
	for _, tc := range []struct {
		ttl      time.Duration
		together bool
	}{{0, false}, {5 * time.Second, true}} {
		r, _ := newRouter(t, 4, func(c *Config) { c.PredictedTTL = tc.ttl })
		seen := map[kv.Worker]bool{}
		for i := range 4 {
			d, err := route(r, fmt.Sprint(i), tokens(9, 64, 100+i, 66))
			if err != nil {
				t.Fatal(err)
			}
			r.MarkPrefillCompleted(fmt.Sprint(i))
			seen[d.Worker] = true
		}
		if together := len(seen) == 1; together != tc.together {
			t.Fatalf("ttl %v: siblings went to %d workers", tc.ttl, len(seen))
		}
	}
}

func TestBadEventsAreCountedAndRefused(t *testing.T) {
	r, _ := newRouter(t, 1, nil)
	r.AddWorker(WorkerInfo{ID: 5, DPSize: 2})
	tests := []struct {
		ev  kv.Event
		err error
	}{
		{kv.ClearedEvent(w(77), 0), ErrUnknownWorker},
		{kv.ClearedEvent(kv.Worker{ID: 5, DPRank: 2}, 0), ErrDPRankRange},
		{kv.StoredEvent(kv.Worker{ID: 5, DPRank: 1}, 0, kv.Ptr(1)), nil}, // empty: index error below
	}
	for _, tc := range tests {
		err := r.ApplyEvent(&tc.ev)
		if tc.err != nil && !errors.Is(err, tc.err) {
			t.Fatalf("%v: got %v want %v", tc.ev.Worker, err, tc.err)
		}
	}
	st := r.Stats()
	if st.UnknownWorkerEvents != 1 || st.DPRankEvents != 1 || st.Index.EmptyStored != 1 {
		t.Fatalf("counters %+v", st)
	}
}

func TestRemoveWorkerDropsItsState(t *testing.T) {
	r, _ := newRouter(t, 2, nil)
	store(t, r, w(1), tokens(4, 20, 4, 20))
	if _, err := r.BestWorker(ctx(), &Request{ID: "a", Tokens: tokens(4, 20, 4, 20)}); err != nil {
		t.Fatal(err)
	}
	r.RemoveWorker(1)
	d, err := r.BestWorker(ctx(), &Request{Tokens: tokens(4, 20, 4, 20)})
	if err != nil || d.Worker != w(0) || d.OverlapBlocks != 0 {
		t.Fatalf("after removal: %+v %v", d, err)
	}
	if st := r.Stats(); st.IndexedPairs != 0 || st.Load.Active != 0 {
		t.Fatalf("state of a removed worker survived: %+v", st)
	}
	if r.Free("a") {
		t.Fatal("the removed worker's booking should be gone already")
	}
}

func TestDirectModeAndSessions(t *testing.T) {
	r, _ := newRouter(t, 3, func(c *Config) { c.Mode = sched.ModeDirect })
	if _, err := route(r, "a", tokens(1, 0, 1, 2)); !errors.Is(err, sched.ErrNoTarget) {
		t.Fatalf("direct without target: %v", err)
	}
	target := w(2)
	d, err := r.BestWorker(ctx(), &Request{ID: "b", Tokens: tokens(1, 0, 1, 2), Target: &target})
	if err != nil || d.Worker != target || d.Via != sched.ViaTarget {
		t.Fatalf("direct: %+v %v", d, err)
	}

	r, c := newRouter(t, 3, nil)
	open := &sched.SessionControl{ID: "s1", Action: sched.SessionOpen, Timeout: time.Minute}
	first, err := r.BestWorker(ctx(), &Request{ID: "1", Tokens: tokens(1, 0, 1, 2), Session: open})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 5 {
		// Book load on the pinned worker: scoring would move away, the pin must not.
		use := &sched.SessionControl{ID: "s1"}
		d, err := r.BestWorker(ctx(), &Request{ID: fmt.Sprint("u", i), Tokens: tokens(50+i, 0, 50+i, 30), Session: use})
		if err != nil || d.Worker != first.Worker || d.Via != sched.ViaSession {
			t.Fatalf("session request %d: %+v %v", i, d, err)
		}
		c.advance(50 * time.Second) // sliding TTL: each use renews the minute
	}
	c.advance(61 * time.Second)
	d, _ = r.BestWorker(ctx(), &Request{Tokens: tokens(1, 0, 1, 2), Session: &sched.SessionControl{ID: "s1"}})
	if d.Via == sched.ViaSession {
		t.Fatal("pin outlived its TTL")
	}
}

func TestDumpRebuildsAnEquivalentRouter(t *testing.T) {
	r, _ := newRouter(t, 3, nil)
	for i := range 30 {
		store(t, r, w(uint64(i%3)), tokens(i%5, 8+i%7, 1000+i, 12+i%9))
	}
	r2, _ := newRouter(t, 3, nil)
	for _, ev := range r.DumpEvents() {
		if err := r2.ApplyEvent(&ev); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 40 {
		toks := tokens(i%5, 10, 2000+i, 20)
		a, b := r.PotentialLoads(toks, ""), r2.PotentialLoads(toks, "")
		if fmt.Sprint(a) != fmt.Sprint(b) {
			t.Fatalf("loads differ after replay:\n%v\n%v", a, b)
		}
	}
}

func TestZeroCreditBuildsNoIndex(t *testing.T) {
	zero := 0.0
	r, _ := newRouter(t, 2, func(c *Config) { c.Routing.LegacyOverlapWeight = &zero })
	if r.exact != nil || r.approx != nil || r.Warning() == "" {
		t.Fatal("legacy weight 0 must disable the index and warn")
	}
	store(t, r, w(0), tokens(1, 4, 1, 4))
	if r.Stats().IgnoredEvents != 1 {
		t.Fatal("events must be ignored without an index")
	}
	la, _ := newRouter(t, 2, func(c *Config) { c.LoadAware = true })
	if la.exact != nil || la.approx != nil {
		t.Fatal("load-aware preset keeps no index")
	}
}

func TestConcurrentRoutingEventsAndFrees(t *testing.T) {
	r, _ := newRouter(t, 8, func(c *Config) { c.Rand = &lockedRand{r: rand.New(rand.NewPCG(3, 4))} })
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 300 {
				id := fmt.Sprint(g, "-", i)
				d, err := route(r, id, tokens(i%6, 16, g*1000+i, 24))
				if err != nil {
					t.Error(err)
					return
				}
				if i%3 == 0 {
					// Stores and clears of one worker race here, which no
					// single event source does: the index applies a long
					// store in chunks, and a clear landing between two
					// refuses the rest as hanging from a block the worker
					// no longer holds. Any other error is a failure.
					ev := storedEvent(d.Worker, tokens(i%6, 16, g*1000+i, 24))
					if err := r.ApplyEvent(&ev); err != nil && !errors.Is(err, index.ErrUnknownParent) {
						t.Error(err)
						return
					}
				}
				r.MarkPrefillCompleted(id)
				r.Free(id)
			}
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := range 200 {
			ev := kv.ClearedEvent(w(uint64(i%8)), 0)
			_ = r.ApplyEvent(&ev)
			r.PotentialLoads(tokens(1, 16, 1, 20), "")
		}
	}()
	wg.Wait()
	if st := r.Stats(); st.Load.Active != 0 || st.Booked != 1200 {
		t.Fatalf("after the storm: %+v", st)
	}
}

func TestEngineStoredIsHashedByTheRouterAndShortBlocksDropped(t *testing.T) {
	r, _ := newRouter(t, 1, nil)
	toks := tokens(8, 4, 8, 4)
	ok := EngineStored{Worker: w(0), EngineHashes: []uint64{1, 2, 3, 4}, Tokens: toks, BlockSize: bs}
	if err := r.ApplyEngineStored(&ok); err != nil {
		t.Fatal(err)
	}
	d, _ := r.BestWorker(ctx(), &Request{Tokens: toks})
	if d.OverlapBlocks != 4 {
		t.Fatalf("engine-side blocks not matched: %+v", d)
	}
	short := EngineStored{Worker: w(0), Parent: kv.Ptr(4), EngineHashes: []uint64{6, 7}, Tokens: tokens(9, 0, 9, 1), BlockSize: bs}
	if err := r.ApplyEngineStored(&short); !errors.Is(err, ErrMisSizedBlocks) {
		t.Fatalf("tokens for one of two blocks: %v", err)
	}
	if st := r.Stats(); st.MisSizedBlocks != 1 || st.IndexedPairs != 5 {
		t.Fatalf("mis-sized %d (want 1), pairs %d (want 5)", st.MisSizedBlocks, st.IndexedPairs)
	}
}

func TestEngineReportsMakeBusyAndLeaveWithTheEngine(t *testing.T) {
	cfg := DefaultConfig()
	half := 0.5
	cfg.Busy = sched.BusyThreshold{ActiveDecodeBlocks: &half}
	r, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	r.AddWorker(WorkerInfo{ID: 1, DPSize: 1})
	req := &Request{Tokens: make([]uint32, 64)}
	r.SetEngineLoad(kv.Worker{ID: 1}, sched.EngineLoad{KVUsage: 0.9})
	if _, err := r.BestWorker(context.Background(), req); !errors.Is(err, sched.ErrAllBusy) {
		t.Fatalf("an engine reporting 90%% KV usage over a 50%% threshold was not busy: %v", err)
	}
	r.RemoveWorker(1)
	r.AddWorker(WorkerInfo{ID: 1, DPSize: 1})
	if _, err := r.BestWorker(context.Background(), req); err != nil {
		t.Fatalf("a returning engine is judged on its departed self's report: %v", err)
	}
}

func TestOnlyTheNamedWorkersAreChosen(t *testing.T) {
	r, _ := newRouter(t, 3, nil)
	store(t, r, w(2), tokens(5, 20, 5, 20))
	for i := range 20 {
		d, err := r.BestWorker(ctx(), &Request{ID: fmt.Sprint("x", i), Tokens: tokens(5, 20, 5, 20), Only: []uint64{0, 1}})
		if err != nil {
			t.Fatal(err)
		}
		if d.Worker == w(2) {
			t.Fatalf("request %d went to %v, which is not among the allowed", i, d.Worker)
		}
	}
	if _, err := r.BestWorker(ctx(), &Request{Tokens: tokens(5, 1, 5, 1), Only: []uint64{}}); !errors.Is(err, ErrNoWorkers) {
		t.Fatalf("no worker allowed: err %v, want ErrNoWorkers", err)
	}
}

func TestExcludedWorkersAreNeverChosen(t *testing.T) {
	r, _ := newRouter(t, 3, nil)
	store(t, r, w(2), tokens(5, 20, 5, 20))
	for i := range 20 {
		d, err := r.BestWorker(ctx(), &Request{ID: fmt.Sprint("x", i), Tokens: tokens(5, 20, 5, 20), Exclude: []uint64{2, 0}})
		if err != nil {
			t.Fatal(err)
		}
		if d.Worker != w(1) {
			t.Fatalf("request %d went to %v; 0 and 2 are excluded", i, d.Worker)
		}
	}
	if _, err := r.BestWorker(ctx(), &Request{Tokens: tokens(5, 1, 5, 1), Exclude: []uint64{0, 1, 2}}); !errors.Is(err, ErrNoWorkers) {
		t.Fatalf("every worker excluded: err %v, want ErrNoWorkers", err)
	}
}

// TestReleaseDropsLongPromptBuffers: the pooled hash buffers of an ordinary
// prompt are kept for the next request, a huge prompt's are not.
func TestReleaseDropsLongPromptBuffers(t *testing.T) {
	r, _ := newRouter(t, 1, nil)
	for _, tc := range []struct {
		blocks int
		kept   bool
	}{{512, true}, {8000, true}, {maxPooledBlocks + 1, false}} { // 8000: a 128 K-token prompt at 16 a block
		p, err := r.prepare(&Request{Tokens: make([]uint32, tc.blocks*bs)})
		if err != nil {
			t.Fatal(err)
		}
		if len(p.seq) != tc.blocks {
			t.Fatalf("%d blocks hashed, want %d", len(p.seq), tc.blocks)
		}
		release(p)
		if p.local != nil || p.seq != nil {
			t.Errorf("%d-block prompt: a released request keeps its hash lists", tc.blocks)
		}
		if kept := p.own[0] != nil && p.own[1] != nil; kept != tc.kept {
			t.Errorf("%d-block prompt: buffers kept = %v, want %v", tc.blocks, kept, tc.kept)
		}
	}
}
