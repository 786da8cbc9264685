package router

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/load"
	"github.com/kvrouter/kvrouter/core/sched"
)

// syncPrompt is a prompt of n 16-token blocks whose first shared blocks are
// common to every prompt of the same prefix.
func syncPrompt(prefix, shared, salt, n int) []uint32 {
	out := make([]uint32, 0, n*16)
	for b := range n {
		src := 1_000_000 + salt
		if b < shared {
			src = prefix
		}
		for i := range 16 {
			out = append(out, uint32(src*7919+b*16+i))
		}
	}
	return out
}

var syncWorkers = []WorkerInfo{{ID: 1, DPSize: 2}, {ID: 2}, {ID: 3}}

func newSyncRouter(t *testing.T, edit func(*Config)) *Router {
	t.Helper()
	cfg := DefaultConfig()
	if edit != nil {
		edit(&cfg)
	}
	r, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	for _, w := range syncWorkers {
		r.AddWorker(w)
	}
	return r
}

// updateLog records what an observer saw.
type updateLog struct {
	mu sync.Mutex
	u  []LoadUpdate
}

func (l *updateLog) add(u LoadUpdate) { l.mu.Lock(); l.u = append(l.u, u); l.mu.Unlock() }
func (l *updateLog) kinds() map[LoadUpdateKind]int {
	l.mu.Lock()
	defer l.mu.Unlock()
	m := map[LoadUpdateKind]int{}
	for _, u := range l.u {
		m[u.Kind]++
	}
	return m
}

func book(t *testing.T, r *Router, id string, toks []uint32, ov sched.Overrides) {
	t.Helper()
	if _, err := r.BestWorker(context.Background(), &Request{ID: id, Tokens: toks, Overrides: ov}); err != nil {
		t.Fatal(err)
	}
}

func TestReplicaSeesTheSameLoads(t *testing.T) {
	no := false
	cases := []struct {
		name string
		run  func(t *testing.T, a *Router)
		want map[LoadUpdateKind]int
	}{
		{"queries book nothing", func(t *testing.T, a *Router) {
			for i := range 5 {
				if _, err := a.BestWorker(context.Background(), &Request{Tokens: syncPrompt(1, 4, i, 8)}); err != nil {
					t.Fatal(err)
				}
			}
		}, map[LoadUpdateKind]int{}},
		{"bookings with shared prefixes", func(t *testing.T, a *Router) {
			for i := range 20 {
				book(t, a, fmt.Sprint("r", i), syncPrompt(i%3, 6, i, 10+i), sched.Overrides{})
			}
		}, map[LoadUpdateKind]int{LoadAdd: 20}},
		{"per-request overrides", func(t *testing.T, a *Router) {
			book(t, a, "noreuse", syncPrompt(1, 6, 1, 12), sched.Overrides{AssumeKVReuse: &no})
			book(t, a, "noprefill", syncPrompt(1, 6, 2, 12), sched.Overrides{TrackPrefillTokens: &no})
			book(t, a, "plain", syncPrompt(1, 6, 3, 12), sched.Overrides{})
		}, map[LoadUpdateKind]int{LoadAdd: 3}},
		{"prefill completed", func(t *testing.T, a *Router) {
			for i := range 10 {
				book(t, a, fmt.Sprint("r", i), syncPrompt(1, 4, i, 9), sched.Overrides{})
			}
			for i := 0; i < 10; i += 2 {
				a.MarkPrefillCompleted(fmt.Sprint("r", i))
				a.MarkPrefillCompleted(fmt.Sprint("r", i)) // changes nothing: not sent
			}
			a.MarkPrefillCompleted("unknown")
		}, map[LoadUpdateKind]int{LoadAdd: 10, LoadPrefillDone: 5}},
		{"free", func(t *testing.T, a *Router) {
			for i := range 10 {
				book(t, a, fmt.Sprint("r", i), syncPrompt(2, 5, i, 7), sched.Overrides{})
			}
			a.MarkPrefillCompleted("r1")
			for i := range 6 {
				a.Free(fmt.Sprint("r", i))
			}
			a.Free("r0")
			a.Free("unknown")
		}, map[LoadUpdateKind]int{LoadAdd: 10, LoadPrefillDone: 1, LoadFree: 6}},
		{"duplicate booking is not sent", func(t *testing.T, a *Router) {
			book(t, a, "dup", syncPrompt(1, 2, 1, 4), sched.Overrides{})
			if _, err := a.BestWorker(context.Background(), &Request{ID: "dup", Tokens: syncPrompt(1, 2, 1, 4)}); !errors.Is(err, ErrDuplicateID) {
				t.Fatalf("second booking of an id: %v", err)
			}
		}, map[LoadUpdateKind]int{LoadAdd: 1}},
		{"concurrent", func(t *testing.T, a *Router) {
			var wg sync.WaitGroup
			for g := range 8 {
				wg.Go(func() {
					for i := range 40 {
						id := fmt.Sprint("g", g, "-", i)
						if _, err := a.BestWorker(context.Background(), &Request{ID: id, Tokens: syncPrompt(i%4, 5, g*100+i, 8)}); err != nil {
							t.Error(err)
							return
						}
						if i%2 == 0 {
							a.MarkPrefillCompleted(id)
						}
						if i%3 == 0 {
							a.Free(id)
						}
					}
				})
			}
			wg.Wait()
		}, map[LoadUpdateKind]int{LoadAdd: 320, LoadPrefillDone: 160, LoadFree: 8 * 14}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			a, b := newSyncRouter(t, nil), newSyncRouter(t, nil)
			var sent updateLog
			a.SetLoadObserver(func(u LoadUpdate) {
				sent.add(u)
				if err := b.ApplyRemoteLoad(u); err != nil {
					t.Errorf("B refused %v: %v", u.Kind, err)
				}
			})
			b.SetLoadObserver(func(u LoadUpdate) { t.Errorf("B echoed a remote %v", u.Kind) })

			tc.run(t, a)

			if got := sent.kinds(); !mapsEqual(got, tc.want) {
				t.Errorf("updates sent %v, want %v", got, tc.want)
			}
			if la, lb := a.Loads(), b.Loads(); !slices.Equal(la, lb) {
				t.Errorf("loads differ:\nA %+v\nB %+v", la, lb)
			}
			if na, nb := a.Stats().Load.Active, b.Stats().Load.Active; na != nb {
				t.Errorf("active requests: A %d, B %d", na, nb)
			}
		})
	}
}

func mapsEqual(a, b map[LoadUpdateKind]int) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

func TestApplyRemoteLoadRefuses(t *testing.T) {
	r := newSyncRouter(t, nil)
	r.SetLoadObserver(func(u LoadUpdate) { t.Errorf("remote update observed: %v", u.Kind) })
	if err := r.ApplyRemoteLoad(LoadUpdate{Kind: LoadAdd, Request: load.Request{ID: "x", Worker: kv.Worker{ID: 2}, Blocks: []uint64{1, 2}, ISL: 32}}); err != nil {
		t.Fatal(err)
	}
	before := r.Loads()
	cases := []struct {
		name string
		u    LoadUpdate
		want error
	}{
		{"unknown worker", LoadUpdate{Kind: LoadAdd, Request: load.Request{ID: "y", Worker: kv.Worker{ID: 9}, ISL: 16}}, ErrUnknownWorker},
		{"unknown rank", LoadUpdate{Kind: LoadAdd, Request: load.Request{ID: "y", Worker: kv.Worker{ID: 1, DPRank: 2}, ISL: 16}}, ErrDPRankRange},
		{"duplicate id", LoadUpdate{Kind: LoadAdd, Request: load.Request{ID: "x", Worker: kv.Worker{ID: 3}, ISL: 16}}, ErrDuplicateID},
		{"prefill of unknown id", LoadUpdate{Kind: LoadPrefillDone, ID: "y"}, ErrUnknownRequest},
		{"free of unknown id", LoadUpdate{Kind: LoadFree, ID: "y"}, ErrUnknownRequest},
		{"unknown kind", LoadUpdate{Kind: 0, ID: "x"}, nil},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := r.ApplyRemoteLoad(tc.u)
			if err == nil || (tc.want != nil && !errors.Is(err, tc.want)) {
				t.Fatalf("got %v, want %v", err, tc.want)
			}
			if got := r.Loads(); !slices.Equal(got, before) {
				t.Fatalf("a refused update changed the loads: %+v, was %+v", got, before)
			}
		})
	}
}

func TestObservedBookingsAreSafeToKeep(t *testing.T) {
	a := newSyncRouter(t, nil)
	var log updateLog
	a.SetLoadObserver(log.add)
	no := false
	type want struct {
		blocks  []uint64
		prefill bool
	}
	wants := map[string]want{}
	for i := range 200 {
		id, toks := fmt.Sprint("r", i), syncPrompt(i%5, 3, i, 1+i%17)
		ov := sched.Overrides{}
		if i%2 == 1 {
			ov.TrackPrefillTokens = &no
		}
		// Bookings reuse pooled hash buffers: a query in between must not
		// disturb what earlier updates hold either.
		book(t, a, id, toks, ov)
		if _, err := a.BestWorker(context.Background(), &Request{Tokens: syncPrompt(9, 0, i, 20)}); err != nil {
			t.Fatal(err)
		}
		_, seq := blockhash.New(16, "").Hashes(toks)
		wants[id] = want{seq, i%2 == 0}
	}
	if len(log.u) != len(wants) {
		t.Fatalf("%d updates for %d bookings", len(log.u), len(wants))
	}
	for _, u := range log.u {
		w := wants[u.Request.ID]
		if u.Kind != LoadAdd || !slices.Equal(u.Request.Blocks, w.blocks) {
			t.Fatalf("update of %s holds blocks %x, want %x", u.Request.ID, u.Request.Blocks, w.blocks)
		}
		if u.Request.TrackPrefill == nil || *u.Request.TrackPrefill != w.prefill {
			t.Fatalf("update of %s lost its prefill override", u.Request.ID)
		}
	}
}

func TestRemoteReleaseDispatchesTheLocalQueue(t *testing.T) {
	q := 1.0
	b := newSyncRouter(t, func(c *Config) { c.QueueThreshold = &q })
	for _, w := range syncWorkers {
		w.MaxNumBatchedTokens = 64
		b.AddWorker(w)
	}
	var own updateLog
	b.SetLoadObserver(own.add)
	queued := make(chan string, 1)
	b.onQueued = func(id string) { queued <- id }
	// Another replica fills every rank's prefill budget.
	for i, w := range []kv.Worker{{ID: 1}, {ID: 1, DPRank: 1}, {ID: 2}, {ID: 3}} {
		u := LoadUpdate{Kind: LoadAdd, Request: load.Request{ID: fmt.Sprint("remote", i), Worker: w, ISL: 160}}
		if err := b.ApplyRemoteLoad(u); err != nil {
			t.Fatal(err)
		}
	}
	done := make(chan error, 1)
	go func() {
		_, err := b.BestWorker(context.Background(), &Request{ID: "local", Tokens: syncPrompt(1, 0, 1, 2)})
		done <- err
	}()
	<-queued
	if err := b.ApplyRemoteLoad(LoadUpdate{Kind: LoadPrefillDone, ID: "remote2"}); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if len(own.u) != 1 || own.u[0].Kind != LoadAdd || own.u[0].Request.ID != "local" {
		t.Fatalf("observer saw %+v, want only the local booking", own.u)
	}
}
