package enginesource

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvrouter/kvrouter/adapters/vllmevents"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
)

const bs = 16

func toks(blocks, salt int) []uint32 {
	out := make([]uint32, blocks*bs)
	for i := range out {
		out[i] = uint32(1000 + (i*37+salt*7919)%50000)
	}
	return out
}

// stored encodes a batch storing blocks [from, to) of tokens, engine ids
// base+i, chained below the previous block (root when from == 0).
func stored(t testing.TB, rank *int, tokens []uint32, base uint64, from, to int) []byte {
	t.Helper()
	var parent *uint64
	if from > 0 {
		parent = kv.Ptr(base + uint64(from-1))
	}
	hashes := make([]uint64, 0, to-from)
	for i := from; i < to; i++ {
		hashes = append(hashes, base+uint64(i))
	}
	return encode(t, &vllmevents.Batch{TS: 1, DPRank: rank, Events: []vllmevents.Event{&vllmevents.BlockStored{
		BlockHashes: hashes, ParentBlockHash: parent, TokenIDs: tokens[from*bs : to*bs], BlockSize: bs, Medium: "GPU",
	}}})
}

func encode(t testing.TB, b *vllmevents.Batch) []byte {
	t.Helper()
	return encodeWith(t, b, vllmevents.EncodingArray)
}

func empty(t testing.TB) []byte { return encode(t, &vllmevents.Batch{TS: 1}) }

func newRouter(t *testing.T, workers ...router.WorkerInfo) *router.Router {
	t.Helper()
	r, err := router.New(router.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range workers {
		r.AddWorker(w)
	}
	return r
}

// overlap is how many leading blocks of tokens the router thinks w holds.
func overlap(t *testing.T, r *router.Router, w kv.Worker, tokens []uint32) int {
	t.Helper()
	for _, l := range r.PotentialLoads(tokens, "") {
		if l.Worker == w {
			return l.OverlapBlocks
		}
	}
	t.Fatalf("worker %v not in the router", w)
	return 0
}

func start(t *testing.T, cfg Config, sink Sink) *Source {
	t.Helper()
	s, err := Start(context.Background(), cfg, sink)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func wait(t testing.TB, s *Source, seq uint64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := s.WaitSeq(ctx, seq); err != nil {
		last, ok := s.LastSeq()
		t.Fatalf("waiting for seq %d: %v (last %d %v, stats %+v)", seq, err, last, ok, s.Stats())
	}
}

func waitFor(t *testing.T, s *Source, what string, cond func(Stats) bool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := s.WaitFor(ctx, cond); err != nil {
		t.Fatalf("waiting for %s: %v (stats %+v)", what, err, s.Stats())
	}
}

// warmUp publishes empty batches until the source's subscription is in
// place (ZeroMQ drops what is published before), bounded by a deadline.
func warmUp(t testing.TB, p *testPub, s *Source) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for s.Stats().Received == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the subscription never reached the publisher: %+v", s.Stats())
		}
		seq := p.publish(t, empty(t), true)
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
		_ = s.WaitSeq(ctx, seq) // pacing only; the condition is Received
		cancel()
	}
	// Everything published so far has been received or replayed once the
	// next live batch is processed.
	wait(t, s, p.publish(t, empty(t), true))
}

func TestLiveEventsFeedTheRouterWithTheBatchRank(t *testing.T) {
	p := newTestPub(t, pubOpts{})
	r := newRouter(t, router.WorkerInfo{ID: 1, DPSize: 2})
	s := start(t, Config{Worker: kv.Worker{ID: 1}, Events: p.events(), Replay: p.replay()}, r)
	warmUp(t, p, s)
	before := s.Stats() // the warm-up may have met (and recovered) a gap
	rank := 1
	a := toks(4, 1)
	p.publish(t, stored(t, &rank, a, 100, 0, 2), true)
	seq := p.publish(t, stored(t, &rank, a, 100, 2, 4), true)
	wait(t, s, seq)
	if got := overlap(t, r, kv.Worker{ID: 1, DPRank: 1}, a); got != 4 {
		t.Fatalf("overlap on 1/1 = %d, want 4", got)
	}
	if got := overlap(t, r, kv.Worker{ID: 1, DPRank: 0}, a); got != 0 {
		t.Fatalf("the batch's rank must override the configured one; 1/0 has %d", got)
	}
	p.publish(t, encode(t, &vllmevents.Batch{TS: 1, DPRank: &rank, Events: []vllmevents.Event{&vllmevents.BlockRemoved{BlockHashes: []uint64{102}}}}), true)
	wait(t, s, seq+1)
	if got := overlap(t, r, kv.Worker{ID: 1, DPRank: 1}, a); got != 2 {
		t.Fatalf("after removing block 2, overlap = %d, want 2", got)
	}
	st := s.Stats()
	if st.BlocksStored != 4 || st.BlocksRemoved != 1 || st.Gaps != before.Gaps || st.Rebuilds != 0 || st.ApplyErrors != 0 || st.Malformed != 0 {
		t.Fatalf("stats %+v", st)
	}
	if last, ok := s.LastSeq(); !ok || last != seq+1 {
		t.Fatalf("LastSeq = %d, %v", last, ok)
	}
}

func TestLostMessagesAreRecoveredByReplay(t *testing.T) {
	p := newTestPub(t, pubOpts{})
	r := newRouter(t, router.WorkerInfo{ID: 1})
	w := kv.Worker{ID: 1}
	s := start(t, Config{Worker: w, Events: p.events(), Replay: p.replay()}, r)
	warmUp(t, p, s)
	before := s.Stats()
	a := toks(5, 2)
	p.publish(t, stored(t, nil, a, 200, 0, 2), true)
	p.publish(t, stored(t, nil, a, 200, 2, 3), false) // lost on the wire
	p.publish(t, stored(t, nil, a, 200, 3, 4), false) // lost on the wire
	seq := p.publish(t, stored(t, nil, a, 200, 4, 5), true)
	wait(t, s, seq)
	if got := overlap(t, r, w, a); got != 5 {
		t.Fatalf("overlap %d, want 5: the lost blocks must come back by replay", got)
	}
	st := s.Stats()
	if st.Gaps-before.Gaps != 1 || st.Recovered-before.Recovered != 1 || st.Rebuilds != 0 || st.ApplyErrors != 0 {
		t.Fatalf("stats %+v", st)
	}
	if st.Replayed-before.Replayed != 2 || st.Batches-before.Batches != 4 {
		t.Fatalf("replayed %d, batches %d; want 2 and 4", st.Replayed-before.Replayed, st.Batches-before.Batches)
	}
}

func TestGapWithoutReplayDropsTheRankAndRebuilds(t *testing.T) {
	p := newTestPub(t, pubOpts{noReplay: true})
	w, other := kv.Worker{ID: 1}, kv.Worker{ID: 2}
	r := newRouter(t, router.WorkerInfo{ID: 1}, router.WorkerInfo{ID: 2})
	s := start(t, Config{Worker: w, Events: p.events()}, r)
	warmUp(t, p, s)
	a, x := toks(3, 3), toks(2, 4)
	// Another worker's blocks, with the same content: must survive.
	if err := r.ApplyEngineStored(&router.EngineStored{Worker: other, EngineHashes: []uint64{1, 2, 3}, Tokens: a, BlockSize: bs}); err != nil {
		t.Fatal(err)
	}
	seq := p.publish(t, stored(t, nil, a, 300, 0, 2), true)
	wait(t, s, seq)
	if got := overlap(t, r, w, a); got != 2 {
		t.Fatalf("overlap %d before the loss", got)
	}
	p.publish(t, stored(t, nil, a, 300, 2, 3), false) // lost, and no replay
	seq = p.publish(t, stored(t, nil, x, 400, 0, 2), true)
	wait(t, s, seq)
	if got := overlap(t, r, w, a); got != 0 {
		t.Fatalf("after an unrecoverable gap the rank's blocks must be dropped; overlap %d", got)
	}
	if got := overlap(t, r, w, x); got != 2 {
		t.Fatalf("what came after the gap must be applied; overlap %d", got)
	}
	if got := overlap(t, r, other, a); got != 3 {
		t.Fatalf("another worker lost its blocks: overlap %d", got)
	}
	st := s.Stats()
	if st.Gaps != 1 || st.Rebuilds != 1 || st.Recovered != 0 || st.ReplayErrors != 0 {
		t.Fatalf("stats %+v", st)
	}
}

func TestReplayTooOldRebuilds(t *testing.T) {
	p := newTestPub(t, pubOpts{keep: 2})
	w := kv.Worker{ID: 1}
	r := newRouter(t, router.WorkerInfo{ID: 1})
	s := start(t, Config{Worker: w, Events: p.events(), Replay: p.replay()}, r)
	warmUp(t, p, s)
	a, x := toks(4, 5), toks(1, 6)
	seq := p.publish(t, stored(t, nil, a, 500, 0, 1), true)
	wait(t, s, seq)
	before := s.Stats() // the warm-up may already have met a gap the short ring could not cover
	for i := 1; i < 4; i++ {
		p.publish(t, stored(t, nil, a, 500, i, i+1), false) // lost; the ring keeps 2
	}
	seq = p.publish(t, stored(t, nil, x, 600, 0, 1), true)
	wait(t, s, seq)
	if got := overlap(t, r, w, a); got != 0 {
		t.Fatalf("overlap %d: a ring too old must drop the rank", got)
	}
	if got := overlap(t, r, w, x); got != 1 {
		t.Fatalf("overlap %d after the rebuild", got)
	}
	if st := s.Stats(); st.Rebuilds-before.Rebuilds != 1 || st.Recovered != before.Recovered || st.Gaps-before.Gaps != 1 {
		t.Fatalf("stats %+v", st)
	}
}

// dumpServer answers like the mocker's /kv_events/dump: the engine's
// whole cache, state(), numbered from the publisher's next batch.
func dumpServer(t *testing.T, p *testPub, state func() []byte) string {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set(vllmevents.DumpNextSeqHeader, strconv.FormatUint(p.nextSeq(), 10))
		_, _ = w.Write(state())
	}))
	t.Cleanup(srv.Close)
	return srv.URL + "/kv_events/dump"
}

func TestReplayTooOldLoadsTheEnginesDump(t *testing.T) {
	p, w, r := ringOfTwo(t)
	a, x, gone := toks(4, 5), toks(1, 6), toks(2, 7)
	var dumped atomic.Bool
	dump := dumpServer(t, p, func() []byte {
		dumped.Store(true)
		b, err := vllmevents.DecodeBatch(stored(t, nil, a, 500, 0, 4))
		if err != nil {
			t.Error(err)
		}
		xb, _ := vllmevents.DecodeBatch(stored(t, nil, x, 600, 0, 1))
		b.Events = append(b.Events, xb.Events...)
		return encode(t, b)
	})
	s := start(t, Config{Worker: w, Events: p.events(), Replay: p.replay(), Dump: dump}, r)
	warmUp(t, p, s)
	before := s.Stats()
	seq := p.publish(t, stored(t, nil, gone, 700, 0, 2), true)
	wait(t, s, seq)
	for i := range 4 {
		p.publish(t, stored(t, nil, a, 500, i, i+1), false) // lost; the ring keeps 2
	}
	p.publish(t, encode(t, &vllmevents.Batch{TS: 1, Events: []vllmevents.Event{&vllmevents.BlockRemoved{BlockHashes: []uint64{700, 701}}}}), false)
	seq = p.publish(t, stored(t, nil, x, 600, 0, 1), true)
	wait(t, s, seq)
	if !dumped.Load() {
		t.Fatal("the dump was never asked for")
	}
	if got := overlap(t, r, w, a); got != 4 {
		t.Fatalf("overlap %d of the lost blocks, want 4 from the dump", got)
	}
	if got := overlap(t, r, w, x); got != 1 {
		t.Fatalf("overlap %d of the batch after the gap", got)
	}
	if got := overlap(t, r, w, gone); got != 0 {
		t.Fatalf("blocks removed during the gap still indexed: overlap %d", got)
	}
	st := s.Stats()
	if st.Dumps-before.Dumps != 1 || st.Recovered-before.Recovered != 1 || st.Rebuilds != before.Rebuilds || st.HistoryLost != before.HistoryLost {
		t.Fatalf("stats %+v, before %+v", st, before)
	}
}

func TestReplayTimeoutRebuilds(t *testing.T) {
	p := newTestPub(t, pubOpts{hold: true}) // replay never answers
	w := kv.Worker{ID: 1}
	r := newRouter(t, router.WorkerInfo{ID: 1})
	s := start(t, Config{Worker: w, Events: p.events(), Replay: p.replay(), ReplayTimeout: 100 * time.Millisecond}, r)
	warmUp(t, p, s)
	a := toks(2, 7)
	seq := p.publish(t, stored(t, nil, a, 700, 0, 1), true)
	wait(t, s, seq)
	before := s.Stats()
	p.publish(t, stored(t, nil, a, 700, 1, 2), false)
	seq = p.publish(t, empty(t), true)
	wait(t, s, seq)
	if got := overlap(t, r, w, a); got != 0 {
		t.Fatalf("overlap %d after a failed replay", got)
	}
	st := s.Stats()
	if st.Rebuilds-before.Rebuilds != 1 || st.ReplayErrors-before.ReplayErrors != 1 || st.Gaps-before.Gaps != 1 {
		t.Fatalf("stats %+v, before %+v", st, before)
	}
}

func TestEngineRestartResets(t *testing.T) {
	p := newTestPub(t, pubOpts{})
	w := kv.Worker{ID: 1}
	r := newRouter(t, router.WorkerInfo{ID: 1})
	s := start(t, Config{Worker: w, Events: p.events(), Replay: p.replay()}, r)
	warmUp(t, p, s)
	a, y := toks(2, 8), toks(3, 9)
	seq := p.publish(t, stored(t, nil, a, 800, 0, 2), true)
	wait(t, s, seq)
	p.restart()
	p.publish(t, stored(t, nil, y, 900, 0, 2), false) // seq 0 of the new engine, missed live
	seq = p.publish(t, stored(t, nil, y, 900, 2, 3), true)
	if seq != 1 {
		t.Fatalf("restarted publisher at seq %d", seq)
	}
	waitFor(t, s, "the restart", func(st Stats) bool { return st.Resets == 1 && st.HaveSeq && st.LastSeq >= 1 })
	if got := overlap(t, r, w, a); got != 0 {
		t.Fatalf("the old engine's blocks survived its restart: overlap %d", got)
	}
	if got := overlap(t, r, w, y); got != 3 {
		t.Fatalf("the new engine's stream, caught up by replay from 0: overlap %d, want 3", got)
	}
	st := s.Stats()
	if st.Resets != 1 || st.Rebuilds != 1 {
		t.Fatalf("stats %+v", st)
	}
	if last, _ := s.LastSeq(); last != 1 {
		t.Fatalf("LastSeq %d after the restart", last)
	}
}

func TestStartupReplayAndOverlapWithLiveMessages(t *testing.T) {
	p := newTestPub(t, pubOpts{hold: true})
	w := kv.Worker{ID: 1}
	r := newRouter(t, router.WorkerInfo{ID: 1})
	a := toks(3, 10)
	p.publish(t, stored(t, nil, a, 1000, 0, 1), true) // before the router: nobody listens
	p.publish(t, stored(t, nil, a, 1000, 1, 2), true)
	s := start(t, Config{Worker: w, Events: p.events(), Replay: p.replay(), ReplayTimeout: 20 * time.Second}, r)
	// The start-up replay is held; meanwhile live batches arrive and queue.
	deadline := time.Now().Add(10 * time.Second)
	for s.Stats().Received == 0 {
		if time.Now().After(deadline) {
			t.Fatal("no live message reached the source")
		}
		p.publish(t, empty(t), true)
		select {
		case <-time.After(10 * time.Millisecond): // pacing of the probe
		case <-s.Done():
			t.Fatal("source stopped")
		}
	}
	if _, ok := s.LastSeq(); ok {
		t.Fatal("applied something while the start-up replay was held")
	}
	p.release() // the replay covers every batch, including those received live
	held := p.nextSeq() - 1
	// The subscription's join asks again once the start-up replay is done.
	waitFor(t, s, "the start-up replay", func(st Stats) bool { return st.HaveSeq && st.LastSeq >= held && st.Joins > 0 })
	seq := p.publish(t, stored(t, nil, a, 1000, 2, 3), true)
	wait(t, s, seq)
	if got := overlap(t, r, w, a); got != 3 {
		t.Fatalf("overlap %d, want 3", got)
	}
	st := s.Stats()
	if st.Batches != seq+1 || st.Replayed != seq {
		t.Fatalf("every seq must be applied exactly once: batches %d, replayed %d, want %d and %d (%+v)", st.Batches, st.Replayed, seq+1, seq, st)
	}
	if st.Duplicates != st.Received-1 || st.Duplicates == 0 || st.Gaps != 0 || st.Rebuilds != 0 || st.ApplyErrors != 0 {
		t.Fatalf("stats %+v", st)
	}
}

func TestMalformedInputIsCountedPerSource(t *testing.T) {
	bad, good := newTestPub(t, pubOpts{}), newTestPub(t, pubOpts{})
	r := newRouter(t, router.WorkerInfo{ID: 1}, router.WorkerInfo{ID: 2})
	sb := start(t, Config{Worker: kv.Worker{ID: 1}, Events: bad.events(), Replay: bad.replay()}, r)
	sg := start(t, Config{Worker: kv.Worker{ID: 2}, Events: good.events(), Replay: good.replay()}, r)
	warmUp(t, bad, sb)
	warmUp(t, good, sg)
	a := toks(2, 11)
	bad.publish(t, []byte{0xc1, 0x00}, true) // not msgpack
	unknown, err := msgpack.Marshal([]any{1.0, []any{[]any{"BlockFancy", 1}, []any{"BlockStored", []any{uint64(7)}, nil, a[:bs], bs, nil, nil, nil, nil, 1}}})
	if err != nil {
		t.Fatal(err)
	}
	bad.publish(t, unknown, true)
	negRank := -1
	bad.publish(t, encode(t, &vllmevents.Batch{TS: 1, DPRank: &negRank}), true)
	seq := bad.publish(t, stored(t, nil, a, 1100, 0, 2), true)
	gseq := good.publish(t, stored(t, nil, a, 1200, 0, 2), true)
	wait(t, sb, seq)
	wait(t, sg, gseq)
	b, g := sb.Stats(), sg.Stats()
	if b.Malformed != 2 || b.Skipped != 2 || b.OtherGroup != 1 || b.BlocksStored != 2 {
		t.Fatalf("bad source stats %+v", b)
	}
	if g.Malformed != 0 || g.Skipped != 0 || g.BlocksStored != 2 {
		t.Fatalf("good source stats %+v", g)
	}
	for _, w := range []kv.Worker{{ID: 1}, {ID: 2}} {
		if got := overlap(t, r, w, a); got != 2 {
			t.Fatalf("worker %v overlap %d", w, got)
		}
	}
}

// recSink records what it is given and refuses everything.
type recSink struct {
	mu     sync.Mutex
	stored []router.EngineStored
	events []kv.Event
}

var errRefused = errors.New("refused")

func (r *recSink) ApplyEvent(ev *kv.Event) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events = append(r.events, *ev)
	return errRefused
}

func (r *recSink) ApplyEngineStored(es *router.EngineStored) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.stored = append(r.stored, *es)
	return errRefused
}

func TestSinkErrorsAreCountedAndEventsMapped(t *testing.T) {
	p := newTestPub(t, pubOpts{})
	sink := &recSink{}
	s := start(t, Config{Worker: kv.Worker{ID: 9, DPRank: 3}, Events: p.events(), Replay: p.replay(), HashBytes: vllmevents.HashFirst8}, sink)
	warmUp(t, p, s)
	a := toks(1, 12)
	seq := p.publish(t, encode(t, &vllmevents.Batch{TS: 1, Events: []vllmevents.Event{
		&vllmevents.BlockStored{BlockHashes: []uint64{5}, ParentBlockHash: kv.Ptr(4), TokenIDs: a, BlockSize: bs, Medium: "CPU", LoRAName: "ad"},
		&vllmevents.BlockRemoved{BlockHashes: []uint64{5, 6}, Medium: "DISK"},
		&vllmevents.AllBlocksCleared{},
		&vllmevents.BlockRemoved{BlockHashes: []uint64{8}, GroupIdx: 1},
	}}), true)
	wait(t, s, seq)
	sink.mu.Lock()
	defer sink.mu.Unlock()
	w := kv.Worker{ID: 9, DPRank: 3}
	if len(sink.stored) != 1 || len(sink.events) != 2 {
		t.Fatalf("stored %+v events %+v", sink.stored, sink.events)
	}
	es := sink.stored[0]
	if es.Worker != w || es.EventID != seq || es.Tier != kv.TierHostPinned || *es.Parent != 4 || es.EngineHashes[0] != 5 || es.BlockSize != bs || es.LoRA != "ad" || len(es.Tokens) != bs {
		t.Fatalf("stored %+v", es)
	}
	rm, cl := sink.events[0], sink.events[1]
	if rm.Kind != kv.KindRemoved || rm.Worker != w || rm.Tier != kv.TierDisk || len(rm.Removed.EngineHashes) != 2 || cl.Kind != kv.KindCleared || cl.Worker != w {
		t.Fatalf("events %+v", sink.events)
	}
	if st := s.Stats(); st.ApplyErrors != 3 || st.Events != 3 || st.OtherGroup != 1 || st.Clears != 1 {
		t.Fatalf("stats %+v", st)
	}
}

func TestCloseAndContext(t *testing.T) {
	if _, err := Start(context.Background(), Config{}, &recSink{}); err == nil {
		t.Fatal("no endpoint accepted")
	}
	if _, err := Start(context.Background(), Config{Events: "tcp://127.0.0.1:1"}, nil); err == nil {
		t.Fatal("nil sink accepted")
	}
	p := newTestPub(t, pubOpts{})
	ctx, cancel := context.WithCancel(context.Background())
	s, err := Start(ctx, Config{Events: p.events(), Replay: p.replay()}, &recSink{})
	if err != nil {
		t.Fatal(err)
	}
	cancel()
	select {
	case <-s.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("the source did not stop with its context")
	}
	if err := s.WaitSeq(context.Background(), 0); !errors.Is(err, ErrClosed) {
		t.Fatalf("WaitSeq after stop: %v", err)
	}
	if first, second := s.Close(), s.Close(); first != nil || second != nil {
		t.Fatal("Close must be idempotent")
	}
	// An engine that is not there: Close still returns promptly.
	s2, err := Start(context.Background(), Config{Events: "tcp://127.0.0.1:1", Replay: "tcp://127.0.0.1:1", ReplayTimeout: time.Minute}, &recSink{})
	if err != nil {
		t.Fatal(err)
	}
	wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Millisecond)
	defer wcancel()
	if err := s2.WaitSeq(wctx, 0); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("WaitSeq: %v", err)
	}
	_ = s2.Close()
}

// clearWatch passes events to a router and, while a clear is applied,
// takes the source's Stats: what a waiter woken at that moment would see.
type clearWatch struct {
	*router.Router
	src    atomic.Pointer[Source]
	mu     sync.Mutex
	atStat []Stats
}

func (c *clearWatch) ApplyEvent(ev *kv.Event) error {
	if s := c.src.Load(); s != nil && ev.Kind == kv.KindCleared {
		c.mu.Lock()
		c.atStat = append(c.atStat, s.Stats())
		c.mu.Unlock()
	}
	return c.Router.ApplyEvent(ev)
}

// A restart must not show in Stats before the position it resets: a
// waiter for "restart seen and the new stream at seq n" woke up while the
// old incarnation's position was still published and read an index the new
// stream had not reached.
func TestRestartCountedAfterThePositionReset(t *testing.T) {
	p := newTestPub(t, pubOpts{})
	w := kv.Worker{ID: 1}
	sink := &clearWatch{Router: newRouter(t, router.WorkerInfo{ID: 1})}
	s := start(t, Config{Worker: w, Events: p.events(), Replay: p.replay()}, sink)
	sink.src.Store(s)
	warmUp(t, p, s)
	seq := p.publish(t, stored(t, nil, toks(2, 8), 800, 0, 2), true)
	wait(t, s, seq)
	p.restart()
	p.publish(t, stored(t, nil, toks(3, 9), 900, 0, 2), false)
	p.publish(t, stored(t, nil, toks(3, 9), 900, 2, 3), true)
	waitFor(t, s, "the restart", func(st Stats) bool { return st.Resets == 1 && st.HaveSeq && st.LastSeq >= 1 })
	sink.mu.Lock()
	defer sink.mu.Unlock()
	if len(sink.atStat) != 1 {
		t.Fatalf("%d clears, want the restart's", len(sink.atStat))
	}
	if st := sink.atStat[0]; st.Resets != 0 || st.Rebuilds != 0 || st.HaveSeq {
		t.Fatalf("while the restart's clear was applied, Stats showed Resets %d, Rebuilds %d and position %d (%v)", st.Resets, st.Rebuilds, st.LastSeq, st.HaveSeq)
	}
}
