package serve

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrouter/kvrouter/adapters/natsplane"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/internal/agent"
	"github.com/kvrouter/kvrouter/internal/testwait"
	"github.com/kvrouter/kvrouter/mocker/fleet"
)

func natsServer(t *testing.T, dir string, port int) *natsplane.Embedded {
	t.Helper()
	srv, err := natsplane.StartEmbedded(natsplane.EmbeddedConfig{StoreDir: dir, Port: port})
	if err != nil {
		t.Fatal(err)
	}
	return srv
}

func natsConn(t *testing.T, url string) *nats.Conn {
	t.Helper()
	nc, err := natsplane.Connect(url, t.Name(), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return nc
}

const testLease = time.Second

func startAgent(t *testing.T, url string, id uint64, f *fleet.Fleet) *agent.Agent {
	t.Helper()
	return startAgentLeased(t, url, id, f, testLease)
}

func startAgentLeased(t *testing.T, url string, id uint64, f *fleet.Fleet, lease time.Duration) *agent.Agent {
	t.Helper()
	e := f.Engines()[0]
	a, err := agent.Start(context.Background(), natsConn(t, url), agent.Config{
		Events: e.Ranks[0].Events, Replay: e.Ranks[0].Replay, LeaseTTL: lease, ReportInterval: 100 * time.Millisecond,
		Instance: natsplane.Instance{WorkerID: id, Name: e.Name, Model: "kvrouter-mock", URL: e.HTTPURL, BlockSize: 16, DPSize: 1, TotalKVBlocks: 16384, MaxNumBatchedTokens: 8192},
	})
	if err != nil {
		t.Fatal(err)
	}
	return a
}

func planeServer(t *testing.T, url, id string, durable, sync bool) *Server {
	t.Helper()
	return planeServerLeased(t, url, id, durable, sync, testLease)
}

func planeServerLeased(t *testing.T, url, id string, durable, sync bool, lease time.Duration) *Server {
	t.Helper()
	s, err := Start(context.Background(), Config{
		Router: router.DefaultConfig(), Addr: "127.0.0.1:0",
		Plane: &Plane{Conn: natsConn(t, url), RouterID: id, Durable: durable, ReplicaSync: sync, LeaseTTL: lease},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func waitLive(t *testing.T, s *Server, n int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*testLease+5*time.Second)
	defer cancel()
	if err := s.WaitWorkers(ctx, func(live int) bool { return live == n }); err != nil {
		t.Fatalf("want %d engines in routing: %v", n, err)
	}
}

func blocksOf(s *Server, worker uint64) int {
	n := 0
	for _, ev := range s.Router().DumpEvents() {
		if ev.Worker.ID == worker && ev.Kind == kv.KindStored {
			n++
		}
	}
	return n
}

func TestPlaneEnginesFollowTheirLease(t *testing.T) {
	srv := natsServer(t, t.TempDir(), 0)
	defer srv.Shutdown()
	a, b := engineFleet(t), engineFleet(t)
	agentA := startAgent(t, srv.URL(), 1, a)
	agentB := startAgent(t, srv.URL(), 2, b)
	defer agentB.Close()
	s := planeServer(t, srv.URL(), "r1", false, false)
	waitLive(t, s, 2)

	p := prompt(0, 7, 640) // 40 blocks
	first := complete(t, s, p)
	testwait.Until(t, 10*time.Second, "the engine's blocks reached the router through NATS", func() bool { return blocksOf(s, first) >= 40 })
	for i := range 3 {
		if got := complete(t, s, append(p, prompt(0, 60+i, 32)...)); got != first {
			t.Fatalf("follow-up went to %d; %d caches its prefix", got, first)
		}
	}

	// Kill the agent of the engine that holds the prefix: it leaves within
	// the lease, blocks and all, and traffic goes to the other engine.
	killed, other, agentKilled := uint64(1), uint64(2), agentA
	if first == 2 {
		killed, other, agentKilled = 2, 1, agentB
	}
	start := time.Now()
	agentKilled.Kill()
	waitLive(t, s, 1)
	if took := time.Since(start); took > 2*testLease {
		t.Fatalf("dead agent's engine left routing after %v; lease %v", took, testLease)
	}
	if n := blocksOf(s, killed); n != 0 {
		t.Fatalf("%d blocks of the departed engine still indexed", n)
	}
	if got := complete(t, s, p); got != other {
		t.Fatalf("routed to %d after its agent died", got)
	}

	// A restarted agent brings the engine back with what it caches.
	f := a
	if killed == 2 {
		f = b
	}
	restarted := startAgent(t, srv.URL(), killed, f)
	defer restarted.Close()
	waitLive(t, s, 2)
	testwait.Until(t, 10*time.Second, "the restarted engine's cache re-indexed", func() bool { return blocksOf(s, killed) >= 40 })
	if agentA != agentKilled {
		agentA.Close()
	}
}

func TestReplicaSyncKeepsReplicasLoadsEqual(t *testing.T) {
	srv := natsServer(t, t.TempDir(), 0)
	defer srv.Shutdown()
	// At the modelled speed requests stay in flight for a while.
	for i, f := range []*fleet.Fleet{engineFleetAt(t, 1), engineFleetAt(t, 1)} {
		defer startAgent(t, srv.URL(), uint64(i+1), f).Close()
	}
	replicas := []*Server{planeServer(t, srv.URL(), "a", false, true), planeServer(t, srv.URL(), "b", false, true)}
	for _, s := range replicas {
		waitLive(t, s, 2)
	}
	const clients = 8
	var wg sync.WaitGroup
	for i := range clients {
		wg.Go(func() {
			s := replicas[i%2]
			body := `{"model":"kvrouter-mock","prompt":` + mustJSON(prompt(0, 100+i, 256)) + `,"max_tokens":300,"ignore_eos":true}`
			resp, err := http.Post("http://"+s.Addr()+"/v1/completions", "application/json", strings.NewReader(body))
			if err != nil {
				t.Error(err)
				return
			}
			resp.Body.Close()
		})
	}
	active := func(s *Server) (n int) {
		for _, l := range s.Router().Loads() {
			n += l.ActiveRequests
		}
		return n
	}
	// While the requests are in flight both replicas see all of them,
	// with the same per-worker loads.
	testwait.Until(t, 10*time.Second, "both replicas see every request", func() bool {
		return active(replicas[0]) == clients && active(replicas[1]) == clients
	})
	la, lb := replicas[0].Router().Loads(), replicas[1].Router().Loads()
	for i := range la {
		if la[i].Worker != lb[i].Worker || la[i].ActiveRequests != lb[i].ActiveRequests || la[i].ActiveDecodeBlocks != lb[i].ActiveDecodeBlocks {
			t.Fatalf("replicas disagree:\n%+v\n%+v", la, lb)
		}
	}
	wg.Wait()
	testwait.Until(t, 10*time.Second, "both replicas freed every request", func() bool {
		return active(replicas[0]) == 0 && active(replicas[1]) == 0
	})
}

func TestNATSRestartLosesNothingAndRoutingGoesOn(t *testing.T) {
	for _, durable := range []bool{false, true} {
		name := "core"
		if durable {
			name = "durable"
		}
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			srv := natsServer(t, dir, 0)
			port := srv.Port()
			a, b := engineFleet(t), engineFleet(t)
			defer startAgent(t, srv.URL(), 1, a).Close()
			defer startAgent(t, srv.URL(), 2, b).Close()
			s := planeServer(t, srv.URL(), "r", durable, false)
			waitLive(t, s, 2)
			p1 := prompt(0, 11, 320)
			w1 := complete(t, s, p1)
			testwait.Until(t, 10*time.Second, "indexed before the outage", func() bool { return blocksOf(s, w1) >= 20 })

			srv.Shutdown()
			testwait.Until(t, 5*time.Second, "health reports the outage", func() bool { return health(t, s) == "degraded" })
			// Degraded, not down: probes keep the replica in service.
			for _, p := range []string{"/health", "/ready", "/live"} {
				if code := statusOf(t, s, p); code != http.StatusOK {
					t.Fatalf("%s during the NATS outage: %d", p, code)
				}
			}
			// Routing goes on, on the last known state.
			if got := complete(t, s, append(p1, prompt(0, 12, 32)...)); got != w1 {
				t.Fatalf("during the outage a follow-up went to %d, not to %d", got, w1)
			}
			p2 := prompt(0, 13, 480)
			w2 := complete(t, s, p2) // its events wait in the agent's buffer

			srv = natsServer(t, dir, port)
			defer srv.Shutdown()
			testwait.Until(t, 15*time.Second, "health back to ok", func() bool { return health(t, s) == "ok" })
			testwait.Until(t, 15*time.Second, "events published during the outage arrive", func() bool { return blocksOf(s, w2) >= 30 })
			waitLive(t, s, 2)
			if got := complete(t, s, append(p2, prompt(0, 14, 32)...)); got != w2 {
				t.Fatalf("after the restart a follow-up went to %d, not to %d", got, w2)
			}
		})
	}
}

func health(t *testing.T, s *Server) string {
	resp, err := http.Get("http://" + s.Addr() + "/health")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out struct{ Status string }
	_ = json.NewDecoder(resp.Body).Decode(&out)
	return out.Status
}

func statusOf(t *testing.T, s *Server, path string) int {
	resp, err := http.Get("http://" + s.Addr() + path)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

func mustJSON(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}
