package serve

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/internal/testwait"
	"github.com/kvrouter/kvrouter/mocker/fleet"
)

type testClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *testClock) now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *testClock) advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// silentFleet starts one fast simulated engine that publishes no KV events.
func silentFleet(t *testing.T) *fleet.Fleet {
	t.Helper()
	cfg := fleet.DefaultConfig()
	cfg.SpeedupRatio = 100
	cfg.HTTPPort, cfg.KVEventsPort, cfg.KVEventsReplayPort = 0, 0, 0
	cfg.NoKVEvents = true
	f, err := fleet.Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Close)
	return f
}

// routerOnTestClock is the default router configuration on a clock the
// test advances.
func routerOnTestClock() (router.Config, *testClock) {
	clock := &testClock{t: time.Unix(1_000_000, 0)}
	cfg := router.DefaultConfig()
	cfg.Now = clock.now
	return cfg, clock
}

// completeOn sends a completion, pinned to worker target when it is not 0,
// and returns the worker that served it.
func completeOn(t *testing.T, s *Server, p []int, target uint64) uint64 {
	t.Helper()
	nvext := map[string]any{"extra_fields": []string{"worker_id"}}
	if target != 0 {
		nvext["backend_instance_id"] = target
	}
	b, _ := json.Marshal(map[string]any{"model": "kvrouter-mock", "prompt": p, "max_tokens": 2, "nvext": nvext})
	resp, err := http.Post(s.URL()+"/v1/completions", "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	var out struct {
		NVExt struct {
			WorkerID uint64 `json:"worker_id"`
		} `json:"nvext"`
	}
	if resp.StatusCode != http.StatusOK || json.Unmarshal(body, &out) != nil {
		t.Fatalf("completion: %d %s", resp.StatusCode, body)
	}
	return out.NVExt.WorkerID
}

type healthBody struct {
	Status  string   `json:"status"`
	Reasons []string `json:"reasons"`
	Workers []struct {
		ID       uint64 `json:"id"`
		KVEvents string `json:"kv_events"`
	} `json:"workers"`
}

func getHealth(t *testing.T, s *Server) healthBody {
	t.Helper()
	resp, err := http.Get(s.URL() + "/health")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var h healthBody
	if err := json.NewDecoder(resp.Body).Decode(&h); err != nil {
		t.Fatal(err)
	}
	return h
}

func (h healthBody) kvEvents(id uint64) string {
	for _, w := range h.Workers {
		if w.ID == id {
			return w.KVEvents
		}
	}
	return "(no such worker)"
}

// missingGauge reads kvrouter_worker_kv_events_missing of a worker's rank 0
// from /metrics; -1 when it has no series.
func missingGauge(t *testing.T, s *Server, id uint64) float64 {
	t.Helper()
	resp, err := http.Get(s.URL() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	series := fmt.Sprintf(`kvrouter_worker_kv_events_missing{dp_rank="0",worker_id="%d"} `, id)
	for line := range strings.Lines(string(body)) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), series); ok {
			var f float64
			fmt.Sscan(v, &f)
			return f
		}
	}
	return -1
}

// An engine started without KV events, beside one with them: once it has
// served for the grace period without an event it is reported (log,
// /health, metric) and routed by the prompts sent to it, so conversations
// stay where their cache is; when its events start it goes back to the
// exact index, its predictions dropped, and the reports clear.
func TestEngineWithoutKVEventsIsReportedRoutedByPredictionAndSwitchesBack(t *testing.T) {
	withEvents, silent := engineFleet(t), silentFleet(t)
	rcfg, clock := routerOnTestClock()
	// What is checked is the fallback for a silent engine; predict-on-route
	// would credit every engine its recent decisions on top of it.
	rcfg.PredictedTTL = 0
	var logs testwait.Buffer
	a, b := spec(1, withEvents), spec(2, silent)
	a.Name, b.Name = "with-events", "silent"
	s := startServerWith(t, Config{
		Router: rcfg, Workers: []WorkerSpec{a, b}, HealthInterval: 20 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo})),
	})
	r := s.Router()
	silentRank := kv.Worker{ID: 2}

	// Eight conversations, alternately on each engine.
	prompts := make([][]int, 8)
	for i := range prompts {
		prompts[i] = prompt(0, 10+i, 128) // 8 blocks
		if got := completeOn(t, s, prompts[i], uint64(1+i%2)); got != uint64(1+i%2) {
			t.Fatalf("pinned request served by %d", got)
		}
	}
	testwait.Until(t, 10*time.Second, "the events of engine 1's four prompts", func() bool {
		return r.Stats().Index.BlocksStored >= 4*8
	})
	if h := getHealth(t, s); h.Status != "ok" || h.kvEvents(1) != "ok" || h.kvEvents(2) != "awaited" {
		t.Fatalf("within the grace period: %+v", h)
	}

	clock.advance(router.DefaultKVEventsGrace)
	h := getHealth(t, s)
	if h.Status != "degraded" || !strings.HasPrefix(h.kvEvents(2), "none received: routing by predicted cache (approximate); start vLLM with --kv-events-config") ||
		h.kvEvents(1) != "ok" || len(h.Reasons) != 1 || !strings.Contains(h.Reasons[0], "engine silent (2): kv events none received") {
		t.Fatalf("after the grace period: %+v", h)
	}
	// The fix names the engine's own events port, not vLLM's usual one.
	port := b.Events[strings.LastIndexByte(b.Events, ':')+1:]
	if fix := `"endpoint": "tcp://*:` + port + `"`; !strings.Contains(h.kvEvents(2), fix) || !strings.Contains(h.kvEvents(2), "events="+b.Events) {
		t.Errorf("the fix does not name the engine's port %s: %s", port, h.kvEvents(2))
	}
	if g1, g2 := missingGauge(t, s, 1), missingGauge(t, s, 2); g1 != 0 || g2 != 1 {
		t.Fatalf("kv_events_missing gauges: worker 1 %v, worker 2 %v; want 0 and 1", g1, g2)
	}
	testwait.Until(t, 10*time.Second, "the warning about engine 2", func() bool {
		return strings.Contains(logs.String(), `level=WARN msg="engine sends no KV events`)
	})
	for i, p := range prompts {
		if got := completeOn(t, s, p, 0); got != uint64(1+i%2) {
			t.Fatalf("conversation %d came back to worker %d; worker %d caches it", i, got, 1+i%2)
		}
	}
	if !strings.Contains(logs.String(), `tcp://*:`+port) {
		t.Errorf("the log's fix does not name port %s:\n%s", port, logs.String())
	}
	if n := strings.Count(logs.String(), "engine sends no KV events"); n != 1 {
		t.Fatalf("warned %d times, want once:\n%s", n, logs.String())
	}

	// The engine is fixed: its events start.
	silent.SetKVEvents(0, true)
	fresh := prompt(0, 99, 64) // 4 blocks
	completeOn(t, s, fresh, 2)
	testwait.Until(t, 10*time.Second, "engine 2's first event", func() bool { return r.KVEvents(silentRank) == router.EventsReceived })
	if h := getHealth(t, s); h.Status != "ok" || h.kvEvents(2) != "ok" || len(h.Reasons) != 0 {
		t.Fatalf("once the events come: %+v", h)
	}
	if g := missingGauge(t, s, 2); g != 0 {
		t.Fatalf("kv_events_missing gauge of worker 2 is %v once its events come", g)
	}
	testwait.Until(t, 10*time.Second, "the all-clear in the log", func() bool {
		return strings.Contains(logs.String(), "engine's KV events arrived")
	})
	for _, l := range r.PotentialLoads(toUint32(prompts[1]), "") {
		if l.Worker == silentRank && l.OverlapBlocks != 0 {
			t.Fatalf("a predicted conversation still counts %d blocks on the exact index of worker 2", l.OverlapBlocks)
		}
	}
	testwait.Until(t, 10*time.Second, "the fresh prompt in worker 2's exact index", func() bool {
		for _, l := range r.PotentialLoads(toUint32(fresh), "") {
			if l.Worker == silentRank {
				return l.OverlapBlocks == 4
			}
		}
		return false
	})
}

func toUint32(p []int) []uint32 {
	out := make([]uint32, len(p))
	for i, v := range p {
		out[i] = uint32(v)
	}
	return out
}

// An engine that only other routers send work to is caught by its
// prefix-cache query counter, where the router reads engines' /metrics.
func TestEngineWithoutKVEventsIsCaughtByItsPrefixCacheQueries(t *testing.T) {
	silent := silentFleet(t)
	rcfg, clock := routerOnTestClock()
	rcfg.Mode = "llm-d-precise"
	s := startServerWith(t, Config{Router: rcfg, Workers: []WorkerSpec{spec(1, silent)}, HealthInterval: 20 * time.Millisecond, EngineMetricsInterval: 5 * time.Millisecond})
	w := kv.Worker{ID: 1}
	n := 0
	testwait.Until(t, 10*time.Second, "engine 1 reported without events", func() bool {
		n++
		if err := sendCompletion(silent.Engines()[0].HTTPURL, prompt(0, n, 64)); err != nil {
			t.Fatal(err)
		}
		clock.advance(router.DefaultKVEventsGrace)
		return s.Router().KVEvents(w) == router.EventsMissing
	})
	if st := s.Router().Stats(); st.Booked != 0 {
		t.Fatalf("the router booked %d requests; the evidence must come from the engine's metrics", st.Booked)
	}
}
