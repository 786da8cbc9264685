package natsplane

import (
	"context"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/testwait"
)

type change struct {
	added   *Instance
	removed uint64
	why     string
	at      time.Time
}

func TestDiscoveryLeases(t *testing.T) {
	srv := startServer(t)
	const ttl = time.Second
	changes := make(chan change, 16)
	w, err := Watch(context.Background(), connect(t, srv.URL()), Names{}, ttl, WatchHandler{
		Added:   func(in Instance) { changes <- change{added: &in, at: time.Now()} },
		Removed: func(id uint64, why string) { changes <- change{removed: id, why: why, at: time.Now()} },
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	<-w.Ready()
	next := func() change {
		t.Helper()
		select {
		case c := <-changes:
			return c
		case <-time.After(5 * ttl):
			t.Fatal("no discovery change")
		}
		return change{}
	}
	inst := Instance{WorkerID: 7, Name: "e7", URL: "http://127.0.0.1:1", DPSize: 2, BlockSize: 16, Incarnation: 1}
	reg, err := Register(context.Background(), connect(t, srv.URL()), Names{}, inst, ttl, nil)
	if err != nil {
		t.Fatal(err)
	}
	if c := next(); c.added == nil || *c.added != inst {
		t.Fatalf("want the instance added, got %+v", c)
	}
	// Heartbeats keep it: nothing changes over three TTLs.
	select {
	case c := <-changes:
		t.Fatalf("heartbeating worker changed: %+v", c)
	case <-time.After(3 * ttl):
	}
	crashed := time.Now()
	reg.Abandon()
	c := next()
	if c.removed != 7 || c.why != "lease expired" {
		t.Fatalf("want lease expiry, got %+v", c)
	}
	if lag := c.at.Sub(crashed); lag > ttl+ttl/2 {
		t.Fatalf("removed %v after the last heartbeat; lease is %v", lag, ttl)
	}
	inst.Incarnation = 2
	reg, err = Register(context.Background(), connect(t, srv.URL()), Names{}, inst, ttl, nil)
	if err != nil {
		t.Fatal(err)
	}
	if c := next(); c.added == nil || c.added.Incarnation != 2 {
		t.Fatalf("restarted worker not added back: %+v", c)
	}
	if err := reg.Close(); err != nil {
		t.Fatal(err)
	}
	if c := next(); c.removed != 7 || c.why != "deregistered" {
		t.Fatalf("want deregistration, got %+v", c)
	}
	// Another namespace is another fleet.
	other, err := Register(context.Background(), connect(t, srv.URL()), Names{Namespace: "other"}, inst, ttl, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	select {
	case c := <-changes:
		t.Fatalf("saw another namespace's worker: %+v", c)
	case <-time.After(ttl / 2):
	}
}

func TestNamesValidate(t *testing.T) {
	for _, n := range []Names{{"a.b", "c"}, {"a", "c d"}, {"", "x"}} {
		if n.Validate() == nil {
			t.Errorf("%+v accepted", n)
		}
	}
	if err := (Names{"dynamo", "backend"}).Validate(); err != nil {
		t.Fatal(err)
	}
	if got := (Names{"dynamo", "backend"}).Stream(); got != "namespace-dynamo-component-backend-kv-events" {
		t.Fatalf("stream %q", got)
	}
}

// A NATS restart must not expire the leases of workers that keep
// heartbeating, while a worker that stops still leaves on time.
func TestDiscoveryLeasesSurviveANATSRestart(t *testing.T) {
	dir := t.TempDir()
	srv, err := StartEmbedded(EmbeddedConfig{StoreDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	port := srv.Port()
	t.Cleanup(func() { srv.Shutdown() })
	const ttl = time.Second
	changes := make(chan change, 16)
	watchConn := connect(t, srv.URL())
	w, err := Watch(context.Background(), watchConn, Names{}, ttl, WatchHandler{
		Added:   func(in Instance) { changes <- change{added: &in, at: time.Now()} },
		Removed: func(id uint64, why string) { changes <- change{removed: id, why: why, at: time.Now()} },
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	<-w.Ready()
	regConn := connect(t, srv.URL())
	var regs []*Registration
	for _, id := range []uint64{7, 8} {
		inst := Instance{WorkerID: id, Name: "e", URL: "http://127.0.0.1:1", DPSize: 1, BlockSize: 16, Incarnation: 1}
		reg, err := Register(context.Background(), regConn, Names{}, inst, ttl, nil)
		if err != nil {
			t.Fatal(err)
		}
		regs = append(regs, reg)
		select {
		case c := <-changes:
			if c.added == nil || c.added.WorkerID != id {
				t.Fatalf("want worker %d added, got %+v", id, c)
			}
		case <-time.After(5 * ttl):
			t.Fatalf("worker %d never added", id)
		}
	}
	defer regs[0].Close()

	srv.Shutdown()
	srv, err = StartEmbedded(EmbeddedConfig{Port: port, StoreDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, 10*time.Second, "both connections back", func() bool {
		return watchConn.IsConnected() && regConn.IsConnected() &&
			watchConn.Stats().Reconnects > 0 && regConn.Stats().Reconnects > 0
	})
	stopped := time.Now()
	regs[1].Abandon()
	// Over four TTLs only the abandoned worker leaves, by lease expiry.
	deadline := time.After(4 * ttl)
	removed8 := false
	for {
		select {
		case c := <-changes:
			if c.removed != 8 || c.why != "lease expired" || removed8 {
				t.Fatalf("after the restart, unexpected change %+v", c)
			}
			if lag := c.at.Sub(stopped); lag > 2*ttl {
				t.Fatalf("stopped worker removed %v after its last heartbeat; lease is %v", lag, ttl)
			}
			removed8 = true
		case <-deadline:
			if !removed8 {
				t.Fatal("a worker that stopped heartbeating was never removed")
			}
			return
		}
	}
}
