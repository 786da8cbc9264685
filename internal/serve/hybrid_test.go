package serve

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/adapters/enginesource"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/internal/testwait"
	"github.com/kvrouter/kvrouter/mocker/engine"
	"github.com/kvrouter/kvrouter/mocker/fleet"
)

// Mockers publishing as a hybrid model over ZMQ (--kv-cache-groups
// sliding_window:32:128,full_attention:16,mamba:64: group 0 a sliding
// window of 32-token blocks over 128 tokens) in front of a real router: it
// indexes the full-attention group only, routes follow-ups by it, keeps
// its 16-token block size, and counts the other groups' events. A router
// started later learns the same from the engine's dump.
func TestHybridMockersAreRoutedOnTheFullAttentionGroup(t *testing.T) {
	groups, err := engine.ParseKVCacheGroups("sliding_window:32:128,full_attention:16,mamba:64")
	if err != nil {
		t.Fatal(err)
	}
	hybrid := func(cfg *fleet.Config) { cfg.SpeedupRatio, cfg.Engine.KVCacheGroups = 100, groups }
	a, b := engineFleetWith(t, hybrid), engineFleetWith(t, hybrid)
	s := startServer(t, spec(1, a), spec(2, b))

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	convs := map[uint64][]int{1: prompt(0, 1, 640), 2: prompt(0, 2, 640)}
	for id, conv := range convs {
		completeOn(t, s, conv, id)
		// The step's batch holds every group's events; Stats may be read
		// while it is applied, so wait for the last group's too.
		if err := s.Sources(id)[0].WaitFor(ctx, func(st enginesource.Stats) bool {
			return st.BlocksStored >= 40 && st.Unsupported["kv_cache_spec_kind=mamba"] > 0
		}); err != nil {
			t.Fatalf("engine %d's events never reached the router: %v", id, err)
		}
	}
	follow := func(s *Server, id uint64, round int) {
		t.Helper()
		p := append(append([]int{}, convs[id]...), prompt(0, 100+round, 100)...)
		d, err := s.Router().BestWorker(ctx, &router.Request{Tokens: tokens32(p)})
		if err != nil {
			t.Fatal(err)
		}
		if d.Worker.ID != id || d.OverlapBlocks != 40 {
			t.Fatalf("follow-up of engine %d's conversation: %+v, want engine %d with its 40 full-attention blocks", id, d, id)
		}
	}
	for round := range 3 {
		for id := range convs {
			follow(s, id, round)
		}
	}
	for id := range convs {
		if got := s.Router().WorkerBlockSize(id); got != 16 {
			t.Errorf("engine %d matched with %d-token blocks, want the full-attention group's 16", id, got)
		}
		st := s.Sources(id)[0].Stats()
		if st.OtherGroup == 0 || st.Unsupported["kv_cache_spec_kind=mamba"] == 0 || len(st.Unsupported) != 1 {
			t.Errorf("engine %d: other groups %d, unsupported %v: want the sliding and mamba groups skipped, mamba counted", id, st.OtherGroup, st.Unsupported)
		}
		if line := fmt.Sprintf(`kvrouter_engine_kv_event_stream_total{dp_rank="0",what="other_group",worker_id="%d"} %d`, id, st.OtherGroup); !metricsHave(t, s, line) {
			t.Errorf("/metrics lacks %s", line)
		}
	}

	// A router started now catches up from the engine's dump.
	late := spec(1, a)
	late.Dump = a.Engines()[0].HTTPURL + "/kv_events/dump"
	s2 := startServer(t, late)
	if err := s2.Sources(1)[0].WaitFor(ctx, func(st enginesource.Stats) bool { return st.Dumps > 0 && st.BlocksStored >= 40 }); err != nil {
		t.Fatalf("no dump loaded: %v", err)
	}
	follow(s2, 1, 9)
	if got := s2.Router().WorkerBlockSize(1); got != 16 {
		t.Errorf("after the dump, engine matched with %d-token blocks, want 16", got)
	}
}

// On the NATS plane the agent next to a hybrid engine forwards its
// full-attention group only: routers match the engine with that group's
// blocks and block size.
func TestPlaneHybridEngineIsRoutedOnTheFullAttentionGroup(t *testing.T) {
	srv := natsServer(t, t.TempDir(), 0)
	defer srv.Shutdown()
	groups, err := engine.ParseKVCacheGroups("sliding_window:32:128,full_attention:16")
	if err != nil {
		t.Fatal(err)
	}
	f := engineFleetWith(t, func(cfg *fleet.Config) { cfg.SpeedupRatio, cfg.Engine.KVCacheGroups = 100, groups })
	a := startAgent(t, srv.URL(), 1, f)
	defer a.Close()
	s := planeServer(t, srv.URL(), "r1", false, false)
	waitLive(t, s, 1)

	conv := prompt(0, 4, 640)
	completeOn(t, s, conv, 0)
	testwait.Until(t, 10*time.Second, "the engine's full-attention blocks reached the router", func() bool { return blocksOf(s, 1) >= 40 })
	d, err := s.Router().BestWorker(context.Background(), &router.Request{Tokens: tokens32(append(conv, prompt(0, 9, 100)...))})
	if err != nil {
		t.Fatal(err)
	}
	if d.Worker.ID != 1 || d.OverlapBlocks != 40 || s.Router().WorkerBlockSize(1) != 16 {
		t.Fatalf("follow-up: %+v with %d-token blocks, want the 40 full-attention blocks of 16 tokens", d, s.Router().WorkerBlockSize(1))
	}
}
