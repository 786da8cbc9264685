package serve

import (
	"context"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/core/sched"
	"github.com/kvrouter/kvrouter/internal/testwait"
)

// boundTo asks s, without booking, where session id goes by its binding;
// 0 when s holds no binding for it.
func boundTo(t *testing.T, s *Server, id string) uint64 {
	t.Helper()
	d, err := s.Router().BestWorker(context.Background(), &router.Request{Model: "kvrouter-mock", Tokens: []uint32{1, 2, 3}, Session: &sched.SessionControl{ID: id}})
	if err != nil {
		t.Fatal(err)
	}
	if d.Via != sched.ViaSession {
		return 0
	}
	return d.Worker.ID
}

// awaitBinding gives a binding up to 20 s to reach s; the engine the
// next turn goes to then tells whether it did.
func awaitBinding(t *testing.T, s *Server, id string, want uint64) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for boundTo(t, s, id) != want && time.Now().Before(deadline) {
		<-tick.C
	}
}

// Two replicas behind a client that alternates between them keep a
// session on the engine its first request was bound to, although each
// turn's prompt is cached on another engine, where a replica that did not
// know the binding would send it; a close on one replica unbinds the
// session on the other.
func TestSessionStaysOnOneEngineAcrossReplicas(t *testing.T) {
	srv := natsServer(t, t.TempDir(), 0)
	defer srv.Shutdown()
	const engines = 3
	// A lease that lapses on a loaded machine would move the session off
	// its engine, rightly: this test is not about leases.
	const lease = 10 * time.Second
	for i := range engines {
		defer startAgentLeased(t, srv.URL(), uint64(i+1), engineFleet(t), lease).Close()
	}
	replicas := []*Server{planeServerLeased(t, srv.URL(), "a", false, true, lease), planeServerLeased(t, srv.URL(), "b", false, true, lease)}
	for _, s := range replicas {
		waitLive(t, s, engines)
	}

	bound := sessionTurn(t, replicas[0], "conv", "open", prompt(0, 1, 64))
	other := bound%engines + 1
	// turn warms other with p, until both replicas index it there, then
	// sends p as the session's next turn through replica r.
	turn := func(r int, action string, p []int) uint64 {
		t.Helper()
		before := blocksOf(replicas[1-r], other)
		if got := completeOn(t, replicas[1-r], p, other); got != other {
			t.Fatalf("warming went to %d, not %d", got, other)
		}
		testwait.Until(t, 30*time.Second, "both replicas index the warmed prompt", func() bool {
			return blocksOf(replicas[0], other) >= before+len(p)/16 && blocksOf(replicas[1], other) >= before+len(p)/16
		})
		return sessionTurn(t, replicas[r], "conv", action, p)
	}
	for i := 1; i <= 6; i++ {
		r := i % 2
		// The binding is published as the request is routed: a load
		// balancer's next request may overtake it, which this test does
		// not measure.
		awaitBinding(t, replicas[r], "conv", bound)
		if got := turn(r, "", prompt(0, 100+i, 64)); got != bound {
			t.Fatalf("turn %d through replica %d went to engine %d; the session is bound to %d", i, r, got, bound)
		}
	}

	// Closed through b, the session is unbound on a too: its next turn
	// there follows the cache.
	awaitBinding(t, replicas[1], "conv", bound)
	if got := sessionTurn(t, replicas[1], "conv", "close", prompt(0, 200, 64)); got != bound {
		t.Fatalf("the close went to engine %d; the session is bound to %d", got, bound)
	}
	testwait.Until(t, 10*time.Second, "a unbinds the closed session", func() bool { return boundTo(t, replicas[0], "conv") == 0 })
	if got := turn(0, "", prompt(0, 300, 64)); got != other {
		t.Fatalf("after the close a turn went to %d, not to %d which caches its prompt", got, other)
	}
}
