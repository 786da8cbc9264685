package enginesource

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/adapters/vllmevents"
	"github.com/kvrouter/kvrouter/adapters/zmqevents"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/mocker/fleet"
)

func startFleet(t *testing.T, dp int, enc vllmevents.Encoding) fleet.Engine {
	t.Helper()
	cfg := fleet.DefaultConfig()
	cfg.NumWorkers, cfg.DataParallelSize, cfg.SpeedupRatio, cfg.Encoding = 1, dp, 100, enc
	cfg.HTTPPort, cfg.KVEventsPort, cfg.KVEventsReplayPort = 0, 0, 0
	cfg.Engine.NumGPUBlocks = 1024
	f, err := fleet.Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Close)
	return f.Engines()[0]
}

func complete(t *testing.T, url string, prompt []uint32, rank int) {
	t.Helper()
	b, _ := json.Marshal(map[string]any{"prompt": prompt, "max_tokens": 2, "data_parallel_rank": rank})
	resp, err := http.Post(url+"/v1/completions", "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
}

// published is the last sequence number a rank has published (by replay).
func published(t *testing.T, r fleet.Rank) uint64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	msgs, err := zmqevents.Replay(ctx, r.Replay, 0, zmqevents.ReplayConfig{})
	if err != nil || len(msgs) == 0 {
		t.Fatalf("replay of rank %d: %d batches, %v", r.Rank, len(msgs), err)
	}
	return msgs[len(msgs)-1].Seq
}

func TestMockerEventsReachTheRouter(t *testing.T) {
	for _, enc := range []vllmevents.Encoding{vllmevents.EncodingArray, vllmevents.EncodingMapBatch} {
		t.Run(enc.String(), func(t *testing.T) {
			e := startFleet(t, 2, enc)
			r := newRouter(t, router.WorkerInfo{ID: 4, DPSize: 2})
			var srcs []*Source
			for _, rk := range e.Ranks {
				// Both configured as rank 0: the batches' dp_rank decides.
				srcs = append(srcs, start(t, Config{Worker: kv.Worker{ID: 4}, Events: rk.Events, Replay: rk.Replay}, r))
			}
			// Probe until both subscriptions are in place (bounded).
			deadline := time.Now().Add(10 * time.Second)
			for i := 0; srcs[0].Stats().Received == 0 || srcs[1].Stats().Received == 0; i++ {
				if time.Now().After(deadline) {
					t.Fatalf("subscriptions not in place: %+v %+v", srcs[0].Stats(), srcs[1].Stats())
				}
				for rank := range 2 {
					complete(t, e.HTTPURL, toks(1, 5000+2*i+rank), rank)
				}
			}
			p := toks(10, 1)
			complete(t, e.HTTPURL, p, 1)
			for i, rk := range e.Ranks {
				wait(t, srcs[i], published(t, rk))
			}
			if got := overlap(t, r, kv.Worker{ID: 4, DPRank: 1}, p); got != 10 {
				t.Fatalf("rank 1 overlap %d, want 10", got)
			}
			if got := overlap(t, r, kv.Worker{ID: 4, DPRank: 0}, p); got != 0 {
				t.Fatalf("rank 0 overlap %d, want 0", got)
			}
			d, err := r.BestWorker(context.Background(), &router.Request{Tokens: append(p, toks(4, 2)...)})
			if err != nil {
				t.Fatal(err)
			}
			if d.Worker != (kv.Worker{ID: 4, DPRank: 1}) || d.OverlapBlocks != 10 {
				t.Fatalf("decision %+v", d)
			}
			for _, s := range srcs {
				if st := s.Stats(); st.Malformed != 0 || st.Skipped != 0 || st.Rebuilds != 0 || st.ApplyErrors != 0 {
					t.Fatalf("stats %+v", st)
				}
			}
		})
	}
}

func TestRouterStartedAfterTheEngineLearnsItsCache(t *testing.T) {
	e := startFleet(t, 1, vllmevents.EncodingArray)
	p := toks(10, 3)
	complete(t, e.HTTPURL, p, 0)
	seq := published(t, e.Ranks[0])
	r := newRouter(t, router.WorkerInfo{ID: 4})
	s := start(t, Config{Worker: kv.Worker{ID: 4}, Events: e.Ranks[0].Events, Replay: e.Ranks[0].Replay}, r)
	wait(t, s, seq)
	if got := overlap(t, r, kv.Worker{ID: 4}, p); got != 10 {
		t.Fatalf("overlap %d, want 10", got)
	}
	if st := s.Stats(); st.Replayed != seq+1 || st.Batches != seq+1 || st.ApplyErrors != 0 {
		t.Fatalf("stats %+v", st)
	}
}

// A mocker with a host tier publishes it as vLLM's offloading connector
// does (medium CPU, no parent, no tokens); the router places those blocks
// from their device copies, so a prompt evicted from the GPU is still
// matched on the host.
func TestMockerHostTierReachesTheIndex(t *testing.T) {
	cfg := fleet.DefaultConfig()
	cfg.NumWorkers, cfg.SpeedupRatio = 1, 100
	cfg.HTTPPort, cfg.KVEventsPort, cfg.KVEventsReplayPort = 0, 0, 0
	cfg.Engine.NumGPUBlocks, cfg.Engine.NumCPUBlocks = 64, 1024
	f, err := fleet.Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Close)
	e := f.Engines()[0]
	r := newRouter(t, router.WorkerInfo{ID: 4})
	w := kv.Worker{ID: 4}
	src := start(t, Config{Worker: w, Events: e.Ranks[0].Events, Replay: e.Ranks[0].Replay}, r)
	deadline := time.Now().Add(10 * time.Second)
	for i := 0; src.Stats().Received == 0; i++ {
		if time.Now().After(deadline) {
			t.Fatalf("subscription not in place: %+v", src.Stats())
		}
		complete(t, e.HTTPURL, toks(1, 7000+i), 0)
	}
	p := toks(10, 1)
	complete(t, e.HTTPURL, p, 0)
	wait(t, src, published(t, e.Ranks[0]))
	// Only the blocks the engine stored on its GPU before its first host
	// block reached the router can be unplaced.
	unplaced, applyErrors := r.Stats().UnplacedOffloadedBlocks, src.Stats().ApplyErrors
	host := func() (int, int) {
		for _, l := range r.PotentialLoads(p, "") {
			if l.Worker == w {
				return l.OverlapBlocks, l.HostBlocks
			}
		}
		t.Fatal("worker not in the router")
		return 0, 0
	}
	if dev, h := host(); dev != 10 || h != 10 {
		t.Fatalf("after the prompt: device %d, host %d blocks, want 10 and 10", dev, h)
	}
	// Two prompts of 60 blocks push it out of the 64 GPU blocks.
	complete(t, e.HTTPURL, toks(60, 2), 0)
	complete(t, e.HTTPURL, toks(60, 3), 0)
	wait(t, src, published(t, e.Ranks[0]))
	if dev, h := host(); dev != 0 || h != 10 {
		t.Fatalf("after evicting it from the GPU: device %d, host %d blocks, want 0 and 10", dev, h)
	}
	if st, u := src.Stats(), r.Stats().UnplacedOffloadedBlocks; st.Skipped != 0 || st.ApplyErrors != applyErrors || u != unplaced {
		t.Fatalf("source stats %+v, unplaced blocks %d then %d", st, unplaced, u)
	}
}
