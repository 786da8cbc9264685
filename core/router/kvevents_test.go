package router

import (
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/sched"
)

// evSim drives a router through a scripted life of its engines, and keeps
// the reference: which blocks each worker's events announced.
type evSim struct {
	t     *testing.T
	r     *Router
	c     *clock
	exact map[uint64]map[uint64]bool // worker → sequence hashes its events stored
}

type evStep struct {
	name string
	do   func(s *evSim)
}

var (
	promptA = tokens(1, 0, 1, 6)
	promptB = tokens(2, 0, 2, 4)
	short   = tokens(3, 0, 3, 1)[:bs-1] // no full block
)

func bookOn(id string, wk uint64, toks []uint32) evStep {
	return evStep{"book " + id, func(s *evSim) {
		s.t.Helper()
		d, err := s.r.BestWorker(ctx(), &Request{ID: id, Tokens: toks, Target: &kv.Worker{ID: wk}})
		if err != nil || d.Worker.ID != wk {
			s.t.Fatalf("book %s on %d: %+v, %v", id, wk, d, err)
		}
	}}
}

func prefilled(id string) evStep {
	return evStep{"prefill " + id, func(s *evSim) { s.r.MarkPrefillCompleted(id) }}
}

func freed(id string) evStep { return evStep{"free " + id, func(s *evSim) { s.r.Free(id) }} }

func served(wk uint64) evStep {
	return evStep{"served", func(s *evSim) { s.r.Served(kv.Worker{ID: wk}) }}
}

func advance(d time.Duration) evStep {
	return evStep{"advance " + d.String(), func(s *evSim) { s.c.advance(d) }}
}

// stored is the worker's engine announcing toks.
func stored(wk uint64, toks []uint32) evStep {
	return evStep{"event", func(s *evSim) {
		store(s.t, s.r, kv.Worker{ID: wk}, toks)
		if s.exact[wk] == nil {
			s.exact[wk] = map[uint64]bool{}
		}
		_, seq := blockhash.New(bs, "").Hashes(toks)
		for _, h := range seq {
			s.exact[wk][h] = true
		}
	}}
}

func reregister(wk uint64) evStep {
	return evStep{"re-register", func(s *evSim) {
		s.r.RemoveWorker(wk)
		delete(s.exact, wk)
		s.r.AddWorker(WorkerInfo{ID: wk, TotalKVBlocks: 16384, MaxNumBatchedTokens: 8192})
	}}
}

// expect checks worker wk's state, the overlap the router sees for each
// prompt there, and that its exact index holds what its events stored and
// nothing else.
func expect(wk uint64, want EventsState, overlaps map[*[]uint32]int) evStep {
	return evStep{fmt.Sprintf("expect %d %v", wk, want), func(s *evSim) {
		s.t.Helper()
		w := kv.Worker{ID: wk}
		if got := s.r.KVEvents(w); got != want {
			s.t.Fatalf("worker %d: state %v, want %v", wk, got, want)
		}
		missing := slices.ContainsFunc(s.r.Eventless(), func(e Eventless) bool { return e.Worker == w })
		if missing != (want == EventsMissing) {
			s.t.Fatalf("worker %d: listed as eventless %v, state %v", wk, missing, want)
		}
		for toks, n := range overlaps {
			for _, l := range s.r.PotentialLoads(*toks, "") {
				if l.Worker == w && l.OverlapBlocks != n {
					s.t.Fatalf("worker %d: overlap %d with a %d-block prompt, want %d", wk, l.OverlapBlocks, len(*toks)/bs, n)
				}
			}
		}
		held := map[uint64]bool{}
		for _, h := range s.r.HeldBlocks(w) {
			held[h] = true
		}
		if len(held) != len(s.exact[wk]) {
			s.t.Fatalf("worker %d: exact index holds %d blocks, its events stored %d", wk, len(held), len(s.exact[wk]))
		}
		for h := range s.exact[wk] {
			if !held[h] {
				s.t.Fatalf("worker %d: exact index lacks block %x its events stored", wk, h)
			}
		}
	}}
}

func TestKVEventsModeSwitchPerWorker(t *testing.T) {
	const grace = 10 * time.Second
	A, B := &promptA, &promptB
	cases := []struct {
		name  string
		edit  func(*Config)
		steps []evStep
	}{
		{"events arrive in time: exact throughout, predictions never read", nil, []evStep{
			bookOn("a", 1, promptA), prefilled("a"), stored(1, promptB), advance(grace),
			expect(1, EventsReceived, map[*[]uint32]int{A: 0, B: 4}),
			bookOn("a2", 1, promptA), prefilled("a2"), advance(time.Minute),
			expect(1, EventsReceived, map[*[]uint32]int{A: 0, B: 4}),
		}},
		{"no events: exact, then predicted after the grace period, then exact again once events come", nil, []evStep{
			expect(1, EventsAwaited, nil),
			bookOn("a", 1, promptA), prefilled("a"), freed("a"),
			advance(grace - time.Millisecond),
			expect(1, EventsAwaited, map[*[]uint32]int{A: 0}),
			advance(time.Millisecond),
			expect(1, EventsMissing, map[*[]uint32]int{A: 6, B: 0}),
			bookOn("b", 1, promptB),
			expect(1, EventsMissing, map[*[]uint32]int{A: 6, B: 4}),
			// The events start: predictions go, only what they store counts.
			stored(1, promptB),
			expect(1, EventsReceived, map[*[]uint32]int{A: 0, B: 4}),
			bookOn("a2", 1, promptA), prefilled("a2"), advance(time.Hour),
			expect(1, EventsReceived, map[*[]uint32]int{A: 0, B: 4}),
		}},
		{"another worker's events leave the silent one predicted", nil, []evStep{
			bookOn("a", 1, promptA), prefilled("a"), stored(0, promptB), advance(grace),
			expect(1, EventsMissing, map[*[]uint32]int{A: 6, B: 0}),
			expect(0, EventsReceived, map[*[]uint32]int{A: 0, B: 4}),
		}},
		{"an event refused by the index still proves the events arrive", nil, []evStep{
			bookOn("a", 1, promptA), prefilled("a"), advance(grace),
			expect(1, EventsMissing, map[*[]uint32]int{A: 6}),
			{"removal of an unknown block", func(s *evSim) {
				ev := kv.RemovedEvent(kv.Worker{ID: 1}, 0, 12345)
				_ = s.r.ApplyEvent(&ev)
			}},
			expect(1, EventsReceived, map[*[]uint32]int{A: 0}),
		}},
		{"a cleared event, as routers synthesise when rebuilding a rank, proves nothing", nil, []evStep{
			bookOn("a", 1, promptA), prefilled("a"),
			{"clear", func(s *evSim) {
				ev := kv.ClearedEvent(kv.Worker{ID: 1}, 0)
				_ = s.r.ApplyEvent(&ev)
			}},
			advance(grace),
			expect(1, EventsMissing, map[*[]uint32]int{A: 6}),
		}},
		{"a request that never completed its prefill proves nothing", nil, []evStep{
			bookOn("a", 1, promptA), freed("a"), advance(time.Hour),
			expect(1, EventsAwaited, map[*[]uint32]int{A: 0}),
		}},
		{"a prompt without a full block proves nothing", nil, []evStep{
			bookOn("s", 1, short), prefilled("s"), advance(time.Hour),
			expect(1, EventsAwaited, nil),
		}},
		{"outside evidence starts the grace period", nil, []evStep{
			bookOn("a", 1, promptA), served(1), advance(grace),
			expect(1, EventsMissing, map[*[]uint32]int{A: 6}),
		}},
		{"the grace period runs from the first evidence only", nil, []evStep{
			bookOn("a", 1, promptA), prefilled("a"), advance(grace / 2),
			bookOn("b", 1, promptB), prefilled("b"), advance(grace / 2),
			expect(1, EventsMissing, map[*[]uint32]int{A: 6, B: 4}),
		}},
		{"an engine that leaves and comes back is awaited again, without its predictions", nil, []evStep{
			bookOn("a", 1, promptA), prefilled("a"), advance(grace),
			expect(1, EventsMissing, map[*[]uint32]int{A: 6}),
			reregister(1),
			expect(1, EventsAwaited, map[*[]uint32]int{A: 0}),
			bookOn("a2", 1, promptA), prefilled("a2"), advance(grace),
			expect(1, EventsMissing, map[*[]uint32]int{A: 6}),
		}},
		{"grace 0 turns detection off", func(c *Config) { c.KVEventsGrace = 0 }, []evStep{
			bookOn("a", 1, promptA), prefilled("a"), advance(time.Hour),
			expect(1, EventsNotFollowed, map[*[]uint32]int{A: 0}),
		}},
		{"a mode that ignores caches expects no events", func(c *Config) { c.Mode = sched.ModeRoundRobin }, []evStep{
			bookOn("a", 1, promptA), prefilled("a"), advance(grace),
			expect(1, EventsNotFollowed, nil),
		}},
		{"approximate mode expects no events", func(c *Config) { c.KVEvents = false }, []evStep{
			bookOn("a", 1, promptA), prefilled("a"), advance(grace),
			expect(1, EventsNotFollowed, map[*[]uint32]int{A: 6}),
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			r, c := newRouter(t, 2, tc.edit)
			s := &evSim{t: t, r: r, c: c, exact: map[uint64]map[uint64]bool{}}
			for i, st := range tc.steps {
				t.Logf("step %d: %s", i, st.name)
				st.do(s)
			}
		})
	}
}

// A repeated prompt follows its prediction to the silent engine, as in
// approximate mode, once that engine is known to be silent.
func TestSilentEngineKeepsItsConversations(t *testing.T) {
	r, c := newRouter(t, 2, nil)
	prompts := make([][]uint32, 8)
	for i := range prompts {
		prompts[i] = tokens(100+i, 0, 100+i, 8)
		id := fmt.Sprint("first-", i)
		if _, err := r.BestWorker(ctx(), &Request{ID: id, Tokens: prompts[i], Target: &kv.Worker{ID: 1}}); err != nil {
			t.Fatal(err)
		}
		r.MarkPrefillCompleted(id)
		r.Free(id)
	}
	c.advance(DefaultKVEventsGrace)
	for i, p := range prompts {
		d, err := route(r, fmt.Sprint("again-", i), p)
		if err != nil {
			t.Fatal(err)
		}
		if d.Worker.ID != 1 || d.OverlapBlocks != 8 {
			t.Fatalf("repeat %d went to %+v with %d blocks cached, want worker 1 with 8", i, d.Worker, d.OverlapBlocks)
		}
		r.Free(fmt.Sprint("again-", i))
	}
}

func TestNegativeKVEventsGraceIsRefused(t *testing.T) {
	cfg := DefaultConfig()
	cfg.KVEventsGrace = -time.Second
	if _, err := New(cfg); err == nil {
		t.Fatal("a negative grace period was accepted")
	}
}

// Bookings, events, completions and reads at once: run under -race.
func TestKVEventsWatchConcurrently(t *testing.T) {
	r, c := newRouter(t, 4, nil)
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 200 {
				id := fmt.Sprint(g, "-", i)
				toks := tokens(i%7, 2, g*1000+i, 4)
				if _, err := route(r, id, toks); err != nil {
					t.Error(err)
					return
				}
				r.MarkPrefillCompleted(id)
				r.Free(id)
				switch {
				case g == 0 && i == 100:
					store(t, r, w(0), toks)
				case g == 1 && i%50 == 0:
					c.advance(5 * time.Second)
				case g == 2:
					_ = r.Eventless()
					_ = r.KVEvents(w(3))
				case g == 3 && i == 150:
					r.RemoveWorker(3)
					r.AddWorker(WorkerInfo{ID: 3})
				}
			}
		}()
	}
	wg.Wait()
	if got := r.KVEvents(w(0)); got != EventsReceived {
		t.Fatalf("worker 0 sent events, state %v", got)
	}
	for _, e := range r.Eventless() {
		if e.Worker == w(0) {
			t.Fatal("worker 0 sent events and is listed as eventless")
		}
	}
	if held := len(r.HeldBlocks(w(1))); held != 0 {
		t.Fatalf("worker 1 sent no events, its exact index holds %d blocks", held)
	}
}
