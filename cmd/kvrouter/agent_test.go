package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/adapters/natsplane"
	"github.com/kvrouter/kvrouter/internal/testwait"
)

func TestAgentCommandNeedsEngineAndNATS(t *testing.T) {
	t.Setenv("NATS_SERVER", "")
	if _, err := runCmd(t, "agent", "--nats-url", "nats://127.0.0.1:1"); err == nil || !strings.Contains(err.Error(), "--engine-url") {
		t.Fatalf("want --engine-url required, got %v", err)
	}
	if _, err := runCmd(t, "agent", "--engine-url", "http://127.0.0.1:1"); err == nil || !strings.Contains(err.Error(), "--nats-url") {
		t.Fatalf("want --nats-url required, got %v", err)
	}
}

// The agent command registers an engine for as long as it runs, and
// deregisters it when stopped.
func TestAgentCommandRegistersTheEngine(t *testing.T) {
	srv, err := natsplane.StartEmbedded(natsplane.EmbeddedConfig{StoreDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()
	cfg, e := mockEngine(t)

	nc, err := natsplane.Connect(srv.URL(), "test", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	added, removed := make(chan natsplane.Instance, 4), make(chan uint64, 4)
	w, err := natsplane.Watch(context.Background(), nc, natsplane.Names{Namespace: "agents"}, time.Second, natsplane.WatchHandler{
		Added:   func(in natsplane.Instance) { added <- in },
		Removed: func(id uint64, _ string) { removed <- id },
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	var out lockedBuffer
	go func() {
		root := newRootCmd()
		root.SetOut(&out)
		root.SetErr(&out)
		root.SetArgs([]string{"agent", "--nats-url", srv.URL(), "--namespace", "agents", "--lease-ttl", "1s",
			"--engine-url", e.HTTPURL, "--events", e.Ranks[0].Events, "--replay", e.Ranks[0].Replay,
			"--model", cfg.Server.Model, "--worker-id", "77", "--num-gpu-blocks", "16384"})
		done <- root.ExecuteContext(ctx)
	}()
	select {
	case in := <-added:
		if in.WorkerID != 77 || in.URL != e.HTTPURL || in.TotalKVBlocks != 16384 || in.BlockSize != 16 {
			t.Fatalf("registered %+v", in)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the agent never registered its engine")
	}
	// Routers see the key before the agent has its acknowledgement: stop
	// it only once it has started.
	testwait.Until(t, 10*time.Second, "the agent reports its registration", func() bool { return strings.Contains(out.String(), "registered on") })
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	select {
	case id := <-removed:
		if id != 77 {
			t.Fatalf("removed %d", id)
		}
	case <-time.After(500 * time.Millisecond): // well inside the lease: deregistered, not expired
		t.Fatal("the stopped agent did not deregister its engine")
	}
}
