package natsplane_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrouter/kvrouter/adapters/natsplane"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
)

var rsNames = natsplane.Names{Namespace: "rs", Component: "backend"}

func rsServer(t *testing.T) *natsplane.Embedded {
	t.Helper()
	srv, err := natsplane.StartEmbedded(natsplane.EmbeddedConfig{StoreDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	return srv
}

func rsConn(t *testing.T, srv *natsplane.Embedded, name string) *nats.Conn {
	t.Helper()
	nc, err := natsplane.Connect(srv.URL(), name, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// rsReplica is one router replica with replica sync on its own connection.
type rsReplica struct {
	nc   *nats.Conn
	r    *router.Router
	sync *natsplane.ReplicaSync
}

func rsStart(t *testing.T, srv *natsplane.Embedded, id string) rsReplica {
	t.Helper()
	r, err := router.New(router.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	r.AddWorker(router.WorkerInfo{ID: 1, DPSize: 2})
	r.AddWorker(router.WorkerInfo{ID: 2})
	r.AddWorker(router.WorkerInfo{ID: 3})
	nc := rsConn(t, srv, id)
	s, err := natsplane.StartReplicaSync(nc, natsplane.ReplicaSyncConfig{Names: rsNames, RouterID: id}, r)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return rsReplica{nc, r, s}
}

// rsWait polls cond until it holds, flushing the connections first so that
// what they published has reached the server.
func rsWait(t *testing.T, what string, cond func() bool, conns ...*nats.Conn) {
	t.Helper()
	for _, nc := range conns {
		if err := nc.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	tick := time.NewTicker(2 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		<-tick.C
	}
}

func rsPrompt(seed, blocks int) []uint32 {
	out := make([]uint32, blocks*16)
	for i := range out {
		// The first half of the blocks is shared by prompts of the same seed%4.
		src := seed
		if i < len(out)/2 {
			src = seed % 4
		}
		out[i] = uint32(src*104729 + i)
	}
	return out
}

func TestReplicasConvergeOnTheSameLoads(t *testing.T) {
	srv := rsServer(t)
	a, b := rsStart(t, srv, "router-a"), rsStart(t, srv, "router-b")

	var wg sync.WaitGroup
	for _, rep := range []rsReplica{a, b} {
		for g := range 4 {
			wg.Go(func() {
				for i := range 50 {
					// Both replicas use the same ids: the sync must keep them apart.
					id := fmt.Sprintf("req-%d-%d", g, i)
					if _, err := rep.r.BestWorker(context.Background(), &router.Request{ID: id, Tokens: rsPrompt(g*50+i, 4+i%9)}); err != nil {
						t.Error(err)
						return
					}
					if i%2 == 0 {
						rep.r.MarkPrefillCompleted(id)
					}
					if i%3 == 0 {
						rep.r.Free(id)
					}
				}
			})
		}
	}
	wg.Wait()

	// Every goroutine booked 50, completed 25 prefills and freed 17.
	const sent = 4 * (50 + 25 + 17)
	rsWait(t, "both replicas to process each other's updates", func() bool {
		sa, sb := a.sync.Stats(), b.sync.Stats()
		return sa.Published+sa.PublishErrors == sent && sb.Published+sb.PublishErrors == sent &&
			sa.Applied+sa.ApplyErrors == sb.Published && sb.Applied+sb.ApplyErrors == sa.Published &&
			sa.Ignored == sa.Published && sb.Ignored == sb.Published
	}, a.nc, b.nc)

	for _, rep := range []rsReplica{a, b} {
		if st := rep.sync.Stats(); st.Published != sent || st.PublishErrors != 0 || st.ApplyErrors != 0 || st.Malformed != 0 || st.Dropped != 0 {
			t.Errorf("stats %+v, want %d published and no errors", st, sent)
		}
	}
	if la, lb := a.r.Loads(), b.r.Loads(); !slices.Equal(la, lb) {
		t.Errorf("loads differ:\nA %+v\nB %+v", la, lb)
	}
	// Each replica holds its own 4×(50−17) requests and the other's.
	if na, nb := a.r.Stats().Load.Active, b.r.Stats().Load.Active; na != 2*4*33 || nb != na {
		t.Errorf("active requests: A %d, B %d, want %d each", na, nb, 2*4*33)
	}
}

func TestReplicaSyncSkipsMalformedMessages(t *testing.T) {
	srv := rsServer(t)
	a := rsStart(t, srv, "router-a")
	peer := rsConn(t, srv, "peer")
	msgs := []string{
		`not json`,
		`{"kind":"add","request_id":"1","worker_id":1}`,                           // no router_id
		`{"router_id":"x","kind":"explode","request_id":"1"}`,                     // unknown kind
		`{"router_id":"x","kind":"add","request_id":"1"}`,                         // no worker
		`{"router_id":"x/y","kind":"free","request_id":"1"}`,                      // ambiguous sender
		`{"router_id":"x","kind":"add","request_id":"1","worker_id":1,"isl":"?"}`, // wrong type
		`{"router_id":"x","kind":"add","request_id":"2","worker_id":99,"isl":16}`, // unknown worker
		`{"router_id":"x","kind":"free","request_id":"3"}`,                        // unknown request
		`{"router_id":"x","kind":"add","request_id":"1","worker_id":2,"isl":64,"sequence_hashes":[1,2,3,4]}`,
	}
	for _, m := range msgs {
		if err := peer.Publish(rsNames.ActiveSequences(), []byte(m)); err != nil {
			t.Fatal(err)
		}
	}
	rsWait(t, "the peer's messages", func() bool {
		st := a.sync.Stats()
		return st.Malformed+st.ApplyErrors+st.Applied == uint64(len(msgs))
	}, peer)
	if st := a.sync.Stats(); st.Malformed != 6 || st.ApplyErrors != 2 || st.Applied != 1 {
		t.Fatalf("stats %+v, want 6 malformed, 2 apply errors, 1 applied", st)
	}
	if l := a.r.Loads(); l[2].Worker != (kv.Worker{ID: 2}) || l[2].ActiveRequests != 1 || l[2].ActiveDecodeBlocks != 4 {
		t.Fatalf("the valid booking was not applied: %+v", l)
	}

	// It keeps working both ways.
	if _, err := a.r.BestWorker(context.Background(), &router.Request{ID: "1", Tokens: rsPrompt(1, 2)}); err != nil {
		t.Fatal(err)
	}
	if err := peer.Publish(rsNames.ActiveSequences(), []byte(`{"router_id":"x","kind":"free","request_id":"1"}`)); err != nil {
		t.Fatal(err)
	}
	rsWait(t, "the peer's free and the local booking", func() bool {
		st := a.sync.Stats()
		return st.Applied == 2 && st.Ignored == 1
	}, peer)
	if st := a.sync.Stats(); st.Published != 1 || a.r.Stats().Load.Active != 1 {
		t.Fatalf("stats %+v with %d active, want 1 published and only the local request", st, a.r.Stats().Load.Active)
	}
}

func TestReplicaSyncIgnoresItsOwnMessages(t *testing.T) {
	srv := rsServer(t)
	a := rsStart(t, srv, "router-a")
	for i := range 3 {
		if _, err := a.r.BestWorker(context.Background(), &router.Request{ID: fmt.Sprint(i), Tokens: rsPrompt(i, 3)}); err != nil {
			t.Fatal(err)
		}
	}
	a.r.MarkPrefillCompleted("0")
	a.r.Free("1")
	rsWait(t, "own messages to come back", func() bool { return a.sync.Stats().Ignored == 5 })
	if st := a.sync.Stats(); st.Published != 5 || st.Applied != 0 || st.ApplyErrors != 0 {
		t.Fatalf("stats %+v, want 5 published and ignored, nothing applied", st)
	}
	if n := a.r.Stats().Load.Active; n != 2 {
		t.Fatalf("%d active requests, want 2: own updates must not be booked twice", n)
	}

	if err := a.sync.Close(); err != nil {
		t.Fatal(err)
	}
	a.r.Free("0")
	if st := a.sync.Stats(); st.Published != 5 {
		t.Fatalf("published %d after Close", st.Published)
	}
}

// A prefill booking counts no active blocks on its prefill worker, on
// every replica.
func TestReplicaSyncCarriesPrefillBookings(t *testing.T) {
	srv := rsServer(t)
	a, b := rsStart(t, srv, "router-a"), rsStart(t, srv, "router-b")
	for _, rep := range []rsReplica{a, b} {
		rep.r.AddWorker(router.WorkerInfo{ID: 4, Role: router.RolePrefill})
	}
	d, err := a.r.BestWorker(context.Background(), &router.Request{ID: "p", Tokens: rsPrompt(1, 8), Prefill: true})
	if err != nil || d.Worker.ID != 4 {
		t.Fatalf("prefill booked on %v, %v", d.Worker, err)
	}
	rsWait(t, "the booking to reach the other replica", func() bool { return b.sync.Stats().Applied == 1 }, a.nc)
	if la, lb := a.r.Loads(), b.r.Loads(); !slices.Equal(la, lb) {
		t.Fatalf("loads differ:\nA %+v\nB %+v", la, lb)
	}
	for _, l := range b.r.Loads() {
		if l.Worker.ID == 4 && (l.ActiveDecodeBlocks != 0 || l.ActivePrefillTokens != 8*16) {
			t.Fatalf("prefill worker's load on the other replica: %+v", l)
		}
	}
}
