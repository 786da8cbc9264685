package serve

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/adapters/enginesource"
	"github.com/kvrouter/kvrouter/adapters/natsplane"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/internal/agent"
	"github.com/kvrouter/kvrouter/internal/testwait"
	"github.com/kvrouter/kvrouter/mocker/fleet"
)

// engineWithBlockSize starts one fast simulated engine of the given block
// size.
func engineWithBlockSize(t *testing.T, blockSize int) *fleet.Fleet {
	t.Helper()
	return engineFleetWith(t, func(cfg *fleet.Config) { cfg.SpeedupRatio, cfg.Engine.BlockSize = 100, blockSize })
}

func tokens32(p []int) []uint32 {
	out := make([]uint32, len(p))
	for i, v := range p {
		out[i] = uint32(v)
	}
	return out
}

// A router started with --kv-cache-block-size 64 in front of engines of
// 16- and 32-token blocks routes both by their caches, says so once per
// engine, and shows it in /health and /metrics.
func TestEnginesOfAnotherBlockSizeAreRoutedByCache(t *testing.T) {
	small, medium := engineWithBlockSize(t, 16), engineWithBlockSize(t, 32)
	var logs testwait.Buffer
	cfg := router.DefaultConfig()
	cfg.BlockSize = 64
	s := startServerWith(t, Config{Router: cfg, Workers: []WorkerSpec{spec(1, small), spec(2, medium)}, HealthInterval: 50 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	convs := map[uint64][]int{1: prompt(0, 1, 640), 2: prompt(0, 2, 640)}
	for id, conv := range convs {
		completeOn(t, s, conv, id)
		size := map[uint64]int{1: 16, 2: 32}[id]
		if err := s.Sources(id)[0].WaitFor(ctx, func(st enginesource.Stats) bool { return st.BlocksStored >= uint64(640/size) }); err != nil {
			t.Fatalf("engine %d's KV events never reached the router: %v", id, err)
		}
	}
	for round := range 3 {
		for id, conv := range convs {
			follow := append(append([]int{}, conv...), prompt(0, 100+round, 100)...)
			d, err := s.Router().BestWorker(ctx, &router.Request{Tokens: tokens32(follow)})
			if err != nil {
				t.Fatal(err)
			}
			// 640 cached tokens are 10 router blocks on either engine.
			if d.Worker.ID != id || d.OverlapBlocks != 10 {
				t.Fatalf("follow-up of engine %d's conversation: %+v, want engine %d with 10 of 11 router blocks cached", id, d, id)
			}
			completeOn(t, s, follow, 0)
		}
	}

	for _, want := range []string{
		"engine " + spec(1, small).Name + " publishes 16-token blocks, the router was started with --kv-cache-block-size 64: routing it with 16-token hashes",
		"engine " + spec(2, medium).Name + " publishes 32-token blocks, the router was started with --kv-cache-block-size 64: routing it with 32-token hashes",
	} {
		if n := strings.Count(logs.String(), want); n != 1 {
			t.Errorf("warning %q logged %d times, want once; log:\n%s", want, n, logs.String())
		}
	}

	resp, err := http.Get("http://" + s.Addr() + "/health")
	if err != nil {
		t.Fatal(err)
	}
	var health struct {
		Status    string
		BlockSize blockSizeView `json:"kv_block_size"`
	}
	err = json.NewDecoder(resp.Body).Decode(&health)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	wantHealth := blockSizeView{Router: 64, Workers: []workerSizeView{{1, 16, "events", true}, {2, 32, "events", true}}}
	if health.Status != "ok" || fmt.Sprint(health.BlockSize) != fmt.Sprint(wantHealth) {
		t.Fatalf("/health: status %q, kv_block_size %+v, want ok and %+v", health.Status, health.BlockSize, wantHealth)
	}
	for _, line := range []string{`kvrouter_worker_block_size{worker_id="1"} 16`, `kvrouter_worker_block_size{worker_id="2"} 32`,
		`kvrouter_worker_block_size_mismatch{worker_id="1"} 1`, `kvrouter_worker_block_size_mismatch{worker_id="2"} 1`} {
		if !metricsHave(t, s, line) {
			t.Errorf("/metrics lacks %s", line)
		}
	}
}

type blockSizeView struct {
	Router  int
	Workers []workerSizeView
}

type workerSizeView struct {
	ID        uint64
	BlockSize int `json:"block_size"`
	Source    string
	Mismatch  bool
}

// On the NATS plane the agent hashes the engine's blocks in the engine's
// block size and announces that size, even when started with a wrong
// --block-size; routers then match the engine with it.
func TestPlaneEngineWithAWrongBlockSizeFlagIsRoutedByCache(t *testing.T) {
	srv := natsServer(t, t.TempDir(), 0)
	defer srv.Shutdown()
	f := engineWithBlockSize(t, 16)
	e := f.Engines()[0]
	a, err := agent.Start(context.Background(), natsConn(t, srv.URL()), agent.Config{
		Events: e.Ranks[0].Events, Replay: e.Ranks[0].Replay, LeaseTTL: testLease, ReportInterval: 100 * time.Millisecond,
		Instance: natsplane.Instance{WorkerID: 1, Name: e.Name, Model: "kvrouter-mock", URL: e.HTTPURL, BlockSize: 64, DPSize: 1},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	cfg := router.DefaultConfig()
	cfg.BlockSize = 64
	var logs testwait.Buffer
	s, err := Start(context.Background(), Config{
		Router: cfg, Addr: "127.0.0.1:0", Logger: slog.New(slog.NewTextHandler(&logs, nil)),
		Plane: &Plane{Conn: natsConn(t, srv.URL()), RouterID: "r1", LeaseTTL: testLease},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	waitLive(t, s, 1)

	conv := prompt(0, 3, 640)
	completeOn(t, s, conv, 0)
	testwait.Until(t, 10*time.Second, "the engine's 16-token blocks reached the router and its block size was announced", func() bool {
		sizes := s.Router().WorkerBlockSizes()
		return blocksOf(s, 1) >= 40 && len(sizes) == 1 && sizes[0].BlockSize == 16
	})
	d, err := s.Router().BestWorker(context.Background(), &router.Request{Tokens: tokens32(append(conv, prompt(0, 9, 100)...))})
	if err != nil {
		t.Fatal(err)
	}
	if d.Worker.ID != 1 || d.OverlapBlocks != 10 {
		t.Fatalf("follow-up: %+v, want 10 router blocks cached on engine 1", d)
	}
	want := "engine " + e.Name + " announces 16-token blocks, the router was started with --kv-cache-block-size 64: routing it with 16-token hashes"
	if n := strings.Count(logs.String(), want); n != 1 {
		t.Fatalf("warning %q logged %d times, want once; log:\n%s", want, n, logs.String())
	}
}
