package natsplane_test

import (
	"context"
	"errors"
	"reflect"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/adapters/natsplane"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/core/sched"
)

// What a replica publishes decodes, on another, to the same change.
func TestSessionUpdateRoundTrip(t *testing.T) {
	for _, u := range []sched.SessionUpdate{
		{Kind: sched.SessionBound, ID: "s", Worker: kv.Worker{ID: 3, DPRank: 1}, TTL: 90 * time.Second, Seq: 1},
		{Kind: sched.SessionRefreshed, ID: "s", Worker: kv.Worker{ID: 3, DPRank: 1}, TTL: 1500 * time.Millisecond, Seq: 2},
		{Kind: sched.SessionClosed, ID: "s", Seq: 2},
	} {
		b, err := natsplane.EncodeSessionUpdate("a", u)
		if err != nil {
			t.Fatal(err)
		}
		from, got, err := natsplane.DecodeSessionUpdate(b)
		if err != nil || from != "a" || !reflect.DeepEqual(got, u) {
			t.Fatalf("%s: decoded %q %+v, %v; want %+v", b, from, got, err, u)
		}
	}
	if _, _, err := natsplane.DecodeSessionUpdate([]byte("{")); !errors.Is(err, natsplane.ErrUndecodable) {
		t.Fatalf("a broken message: %v, want ErrUndecodable", err)
	}
	for _, m := range []string{
		`{"router_id":"b","kind":"bind","session_id":"s","sequence":1}`,                      // no worker
		`{"router_id":"b","kind":"bind","worker_id":1,"sequence":1}`,                         // no session
		`{"kind":"close","session_id":"s"}`,                                                  // no sender
		`{"router_id":"b","kind":"open","session_id":"s","worker_id":1}`,                     // unknown kind
		`{"router_id":"b","kind":"bind","session_id":"s","worker_id":1,"ttl_secs":-1}`,       // negative TTL
		`{"router_id":"b","kind":"refresh","session_id":"s","worker_id":1,"ttl_secs":1e300}`, // beyond a duration
	} {
		if _, _, err := natsplane.DecodeSessionUpdate([]byte(m)); err == nil || errors.Is(err, natsplane.ErrUndecodable) {
			t.Errorf("%s: %v, want a malformed-message error", m, err)
		}
	}
}

// ssReplica is a router replica with session sync on its own connection.
type ssReplica struct {
	rsReplica
	ss *natsplane.SessionSync
}

func ssStart(t *testing.T, srv *natsplane.Embedded, id string) ssReplica {
	t.Helper()
	rep := rsStart(t, srv, id)
	ss, err := natsplane.StartSessionSync(rep.nc, natsplane.ReplicaSyncConfig{Names: rsNames, RouterID: id}, rep.r)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ss.Close() })
	return ssReplica{rep, ss}
}

// route books a request of session "s" on rep, and returns how it went.
func (rep ssReplica) route(t *testing.T, id string, action sched.SessionAction, tokens []uint32) router.Decision {
	t.Helper()
	d, err := rep.r.BestWorker(context.Background(), &router.Request{ID: id, Tokens: tokens,
		Session: &sched.SessionControl{ID: "s", Action: action, Timeout: time.Minute}})
	if err != nil {
		t.Fatal(err)
	}
	rep.r.Free(id)
	return d
}

// pinned asks rep, without booking, where session "s" goes and whether by
// its binding.
func (rep ssReplica) pinned(t *testing.T) (kv.Worker, bool) {
	t.Helper()
	d, err := rep.r.BestWorker(context.Background(), &router.Request{Tokens: rsPrompt(7, 2), Session: &sched.SessionControl{ID: "s"}})
	if err != nil {
		t.Fatal(err)
	}
	return d.Worker, d.Via == sched.ViaSession
}

func TestSessionSyncSharesBindingsAndCloses(t *testing.T) {
	srv := rsServer(t)
	a, b := ssStart(t, srv, "router-a"), ssStart(t, srv, "router-b")

	// a binds the session; b, which has never seen it, follows it.
	first := a.route(t, "1", sched.SessionOpen, rsPrompt(1, 4)).Worker
	rsWait(t, "b to learn the binding", func() bool { return b.ss.Stats().Applied == 1 }, a.nc)
	if w, ok := b.pinned(t); !ok || w != first {
		t.Fatalf("b routes the session to %v (by binding: %v), a bound it to %v", w, ok, first)
	}
	// A use on b reaches a as a refresh; a close on b unbinds a.
	if d := b.route(t, "2", sched.SessionUse, rsPrompt(2, 4)); d.Worker != first || d.Via != sched.ViaSession {
		t.Fatalf("b's use: %+v", d)
	}
	if d := b.route(t, "3", sched.SessionClose, rsPrompt(3, 4)); d.Worker != first || d.Via != sched.ViaSession {
		t.Fatalf("b's close: %+v", d)
	}
	rsWait(t, "a to apply b's use and close", func() bool { return a.ss.Stats().Applied == 2 }, b.nc)
	if w, ok := a.pinned(t); ok {
		t.Fatalf("a still routes the closed session by its binding, to %v", w)
	}
	for name, rep := range map[string]ssReplica{"a": a, "b": b} {
		// A replica hears its own messages back; the last may still be on
		// its way when the other replica has applied it.
		rsWait(t, name+" to ignore its own echoes", func() bool {
			st := rep.ss.Stats()
			return st.Ignored == st.Published
		})
		if st := rep.ss.Stats(); st.Malformed != 0 || st.ApplyErrors != 0 || st.PublishErrors != 0 {
			t.Errorf("stats %+v", st)
		}
	}

	// A binding to an engine the replica does not know, and malformed
	// messages, are counted and skipped.
	peer := rsConn(t, srv, "peer")
	for _, m := range []string{
		`{"router_id":"x","kind":"bind","session_id":"t","worker_id":99,"sequence":1}`,
		`{"router_id":"x","kind":"bind","session_id":"t"}`,
		`nonsense`,
	} {
		if err := peer.Publish(rsNames.SessionAffinity(), []byte(m)); err != nil {
			t.Fatal(err)
		}
	}
	rsWait(t, "the peer's messages", func() bool {
		st := a.ss.Stats()
		return st.ApplyErrors == 1 && st.Malformed == 2
	}, peer)
}
