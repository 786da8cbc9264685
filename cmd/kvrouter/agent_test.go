package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/adapters/natsplane"
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
	// Buffered beyond what a run sends: a loaded machine can let the lease
	// lapse between heartbeats, which removes and re-adds the engine.
	added, removed := make(chan natsplane.Instance, 64), make(chan string, 64)
	w, err := natsplane.Watch(context.Background(), nc, natsplane.Names{Namespace: "agents"}, time.Second, natsplane.WatchHandler{
		Added: func(in natsplane.Instance) { added <- in },
		Removed: func(id uint64, why string) {
			if id == 77 {
				removed <- why
			}
		},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		root := newRootCmd()
		var out bytes.Buffer
		root.SetOut(&out)
		root.SetErr(&out)
		root.SetArgs([]string{"agent", "--nats-url", srv.URL(), "--namespace", "agents", "--lease-ttl", "1s",
			"--engine-url", e.HTTPURL, "--events", e.Ranks[0].Events, "--replay", e.Ranks[0].Replay,
			"--model", cfg.Server.Model, "--worker-id", "77", "--num-gpu-blocks", "16384",
			"--model-path", "meta-llama/Llama-3.1-8B-Instruct"})
		done <- root.ExecuteContext(ctx)
	}()
	select {
	case in := <-added:
		if in.WorkerID != 77 || in.URL != e.HTTPURL || in.TotalKVBlocks != 16384 || in.BlockSize != 16 || in.Tokenizer != "meta-llama/Llama-3.1-8B-Instruct" {
			t.Fatalf("registered %+v", in)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the agent never registered its engine")
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	// Deregistered, not left to expire: the reason tells them apart, where
	// a time well inside the lease would depend on the machine's load.
	deadline := time.After(10 * time.Second)
	for {
		select {
		case why := <-removed:
			if why == "deregistered" {
				return
			}
		case <-deadline:
			t.Fatal("the stopped agent did not deregister its engine")
		}
	}
}

// A stop that lands while the agent is still registering its engine is a
// clean exit, and leaves no engine behind for routers.
func TestAgentCommandStoppedDuringStartExitsCleanly(t *testing.T) {
	srv, err := natsplane.StartEmbedded(natsplane.EmbeddedConfig{StoreDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	root := newRootCmd()
	var out bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&out)
	root.SetArgs([]string{"agent", "--nats-url", srv.URL(), "--namespace", "stopped", "--engine-url", "http://127.0.0.1:1", "--worker-id", "5"})
	if err := root.ExecuteContext(ctx); err != nil {
		t.Fatalf("stopped during start-up: want a clean exit, got %v\n%s", err, out.String())
	}

	nc, err := natsplane.Connect(srv.URL(), "test", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	var registered []natsplane.Instance
	w, err := natsplane.Watch(context.Background(), nc, natsplane.Names{Namespace: "stopped"}, time.Minute, natsplane.WatchHandler{
		Added:   func(in natsplane.Instance) { registered = append(registered, in) },
		Removed: func(uint64, string) {},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	<-w.Ready()
	w.Close()
	if len(registered) != 0 {
		t.Fatalf("an agent stopped during start-up left %+v registered", registered)
	}
}
