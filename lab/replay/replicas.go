package replay

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrouter/kvrouter/adapters/natsplane"
	"github.com/kvrouter/kvrouter/internal/agent"
	"github.com/kvrouter/kvrouter/internal/serve"
)

// startReplicas runs a setup's router replicas as `kvrouter serve
// --nats-url ... --router-replica-sync` runs them behind a load balancer:
// an embedded NATS server, one agent per engine that registers it and
// carries its KV events and load, and n frontends of base's configuration
// that find the engines by discovery, each following every engine's events
// itself and sharing its bookings (and session bindings) with the others.
// Replica i breaks ties with seed + i. It returns the replicas' base URLs
// and a stop that ends everything it started.
func startReplicas(ctx context.Context, n int, base serve.Config, workers []serve.WorkerSpec, blockSize int, seed uint64) (urls []string, stop func(), err error) {
	var stops []func()
	stop = func() {
		for i := len(stops) - 1; i >= 0; i-- {
			stops[i]()
		}
	}
	defer func() {
		if err != nil {
			stop()
		}
	}()
	dir, err := os.MkdirTemp("", "kvrouter-replay-nats-")
	if err != nil {
		return nil, nil, err
	}
	stops = append(stops, func() { _ = os.RemoveAll(dir) })
	srv, err := natsplane.StartEmbedded(natsplane.EmbeddedConfig{StoreDir: dir})
	if err != nil {
		return nil, nil, err
	}
	stops = append(stops, srv.Shutdown)
	connect := func(name string) (*nats.Conn, error) {
		nc, err := natsplane.Connect(srv.URL(), name, nil)
		if err != nil {
			return nil, err
		}
		stops = append(stops, nc.Close)
		return nc, nil
	}
	nc, err := connect("kvrouter-replay-agents")
	if err != nil {
		return nil, nil, err
	}
	for _, w := range workers {
		a, err := agent.Start(ctx, nc, agent.Config{
			Events: w.Events, Replay: w.Replay, ReportInterval: 100 * time.Millisecond,
			Instance: natsplane.Instance{
				WorkerID: w.ID, Name: w.Name, Model: w.Model, URL: w.URL, BlockSize: blockSize,
				DPSize: w.DPSize, TotalKVBlocks: w.KVBlocks, MaxNumBatchedTokens: w.MaxBatchedTokens, Role: w.Role, Device: w.Device,
			},
		})
		if err != nil {
			return nil, nil, fmt.Errorf("agent of %s: %w", w.Name, err)
		}
		stops = append(stops, a.Close)
	}
	for i := range n {
		id := fmt.Sprintf("replica-%d", i)
		rc, err := connect("kvrouter-replay-" + id)
		if err != nil {
			return nil, nil, err
		}
		cfg := base
		cfg.Workers = nil
		cfg.Router.Rand = newLockedRand(seed + uint64(i))
		cfg.Plane = &serve.Plane{Conn: rc, RouterID: id, ReplicaSync: true}
		s, err := serve.Start(ctx, cfg)
		if err != nil {
			return nil, nil, fmt.Errorf("%s: %w", id, err)
		}
		stops = append(stops, func() { _ = s.Close() })
		ready, cancel := context.WithTimeout(ctx, 15*time.Second)
		err = s.WaitWorkers(ready, func(live int) bool { return live == len(workers) })
		cancel()
		if err != nil {
			return nil, nil, fmt.Errorf("%s: engines did not join routing: %w", id, err)
		}
		urls = append(urls, "http://"+s.Addr())
	}
	return urls, stop, nil
}
