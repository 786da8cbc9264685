package serve

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/adapters/natsplane"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/internal/agent"
	"github.com/kvrouter/kvrouter/internal/testwait"
)

// The secured deployment's example server configuration works as
// documented: agents and routers, each with their own user, run the whole
// plane (discovery, events, recovery, durable stream, replica sync), a
// client without credentials is refused, and an agent's user cannot do
// what only routers may.
func TestSecuredServerConfigRunsThePlane(t *testing.T) {
	t.Setenv("AGENT_PASSWORD", "agent-pw-for-this-test")
	t.Setenv("ROUTER_PASSWORD", "router-pw-for-this-test")
	opts, err := server.ProcessConfigFile("../../docs/nats-server-secured.conf")
	if err != nil {
		t.Fatal(err)
	}
	opts.Host, opts.Port, opts.StoreDir, opts.NoLog, opts.NoSigs = "127.0.0.1", server.RANDOM_PORT, t.TempDir(), true, true
	srv, err := server.NewServer(opts)
	if err != nil {
		t.Fatal(err)
	}
	go srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		t.Fatal("NATS server did not start")
	}
	defer func() {
		srv.Shutdown()
		srv.WaitForShutdown()
	}()
	var agentLog testwait.Buffer
	dial := func(user, password string) (*nats.Conn, error) {
		o, err := natsplane.Auth{User: user, Password: password}.Options()
		if err != nil {
			return nil, err
		}
		log := slog.New(slog.DiscardHandler)
		if user == "agent" {
			log = slog.New(slog.NewTextHandler(&agentLog, nil))
		}
		return natsplane.Connect(srv.ClientURL(), t.Name()+" "+user, log, o...)
	}
	conn := func(user, password string) *nats.Conn {
		t.Helper()
		nc, err := dial(user, password)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nc.Close)
		return nc
	}
	if nc, err := dial("", ""); !errors.Is(err, nats.ErrAuthorization) {
		if nc != nil {
			nc.Close()
		}
		t.Fatalf("connected without credentials: %v", err)
	}

	for _, durable := range []bool{false, true} {
		f := engineFleet(t)
		e := f.Engines()[0]
		a, err := agent.Start(context.Background(), conn("agent", "agent-pw-for-this-test"), agent.Config{
			Events: e.Ranks[0].Events, Replay: e.Ranks[0].Replay, LeaseTTL: testLease, ReportInterval: 100 * time.Millisecond,
			Instance: natsplane.Instance{WorkerID: 1, Name: e.Name, Model: "kvrouter-mock", URL: e.HTTPURL, BlockSize: 16, DPSize: 1, TotalKVBlocks: 16384, MaxNumBatchedTokens: 8192},
		})
		if err != nil {
			t.Fatal(err)
		}
		s, err := Start(context.Background(), Config{
			Router: router.DefaultConfig(), Addr: "127.0.0.1:0",
			Plane: &Plane{Conn: conn("router", "router-pw-for-this-test"), RouterID: "r", Durable: durable, ReplicaSync: true, LeaseTTL: testLease},
		})
		if err != nil {
			t.Fatal(err)
		}
		waitLive(t, s, 1)
		complete(t, s, prompt(0, 3, 320))
		testwait.Until(t, 10*time.Second, "the engine's blocks reached the router", func() bool { return blocksOf(s, 1) >= 20 })
		_ = s.Close()
		a.Close()
		f.Close()
	}

	stream := natsplane.Names{Namespace: natsplane.DefaultNamespace, Component: natsplane.DefaultComponent}.Stream()
	asAgent, err1 := jetstream.New(conn("agent", "agent-pw-for-this-test"))
	asRouter, err2 := jetstream.New(conn("router", "router-pw-for-this-test"))
	if err := errors.Join(err1, err2); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	if err := asAgent.DeleteStream(ctx, stream); err == nil {
		t.Fatal("an agent's user deleted the routers' event stream")
	}
	if _, err := asRouter.Stream(context.Background(), stream); err != nil {
		t.Fatalf("the routers' event stream: %v", err)
	}
	testwait.Until(t, 5*time.Second, "the agent's log to show the refused publish", func() bool {
		return strings.Contains(agentLog.String(), `level=WARN msg="NATS error" err="nats: permissions violation`)
	})
}
