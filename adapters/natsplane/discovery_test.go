package natsplane

import (
	"context"
	"testing"
	"time"
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
