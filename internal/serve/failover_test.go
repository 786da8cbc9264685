package serve

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/adapters/enginesource"
	"github.com/kvrouter/kvrouter/core/outlier"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/internal/testwait"
	"github.com/kvrouter/kvrouter/mocker/fleet"
)

// startServerProbing starts the frontend probing engines every so often:
// passive ejection, not the probe, must keep traffic off a dead engine.
func startServerProbing(t *testing.T, every time.Duration, workers ...WorkerSpec) *Server {
	t.Helper()
	return startServerWith(t, Config{Router: router.DefaultConfig(), Workers: workers, HealthInterval: every})
}

func waitIdle(t *testing.T, s *Server) {
	t.Helper()
	testwait.Until(t, 10*time.Second, "the router's load back to zero", func() bool {
		for _, l := range s.Router().Loads() {
			if l.ActiveRequests != 0 || l.ActiveDecodeBlocks != 0 || l.ActivePrefillTokens != 0 {
				return false
			}
		}
		return true
	})
}

// Two engines, looping clients, one engine killed: the requests that
// start after the kill all but never fail, and the load accounting ends at
// zero.
func TestKilledEngineCostsAlmostNoRequests(t *testing.T) {
	a, b := engineFleet(t), engineFleet(t)
	s := startServerProbing(t, 2*time.Second, spec(1, a), spec(2, b))

	const clients = 16
	var (
		killed    atomic.Bool
		before    atomic.Int64 // requests done before the kill
		after     atomic.Int64 // requests started after it
		afterFail atomic.Int64
		stop      = make(chan struct{})
		wg        sync.WaitGroup
		mu        sync.Mutex
		failures  []string
	)
	for c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				startedAfter := killed.Load()
				_, err := tryComplete(s, prompt(64, c*100000+i, 96))
				switch {
				case !startedAfter:
					before.Add(1)
				case err != nil:
					after.Add(1)
					afterFail.Add(1)
					mu.Lock()
					failures = append(failures, err.Error())
					mu.Unlock()
				default:
					after.Add(1)
				}
			}
		}()
	}
	testwait.Until(t, 30*time.Second, "traffic on both engines", func() bool { return before.Load() >= 200 })
	a.Close() // as kill -9: listener and connections gone at once
	killed.Store(true)
	testwait.Until(t, 60*time.Second, "2,000 requests after the kill", func() bool { return after.Load() >= 2000 })
	close(stop)
	wg.Wait()

	n, failed := after.Load(), afterFail.Load()
	t.Logf("after the kill: %d of %d requests failed (%.3f %%)", failed, n, 100*float64(failed)/float64(n))
	if failed*1000 > n {
		t.Fatalf("%d of %d requests started after the kill failed (> 0.1 %%); first: %v", failed, n, failures[:min(3, len(failures))])
	}
	if ws := s.Router().Workers(); len(ws) != 1 || ws[0].ID != 2 {
		t.Fatalf("the dead engine is still in routing: %+v", ws)
	}
	waitIdle(t, s)
}

// An engine that refuses a connection leaves routing with that request,
// long before its health probe would notice, and comes back through the
// probe once it answers again.
func TestARefusingEngineLeavesAtOnceAndReturnsThroughTheProbe(t *testing.T) {
	fleets := map[uint64]*fleet.Fleet{1: engineFleet(t), 2: engineFleet(t)}
	// Long enough that a loaded machine's slow request (0.5 s was seen)
	// stays under it: the refusal, not the probe, must take the engine
	// out.
	const probeEvery = 3 * time.Second
	s := startServerProbing(t, probeEvery, spec(1, fleets[1]), spec(2, fleets[2]))

	p := prompt(0, 7, 640) // 40 blocks
	cached := complete(t, s, p)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := s.Sources(cached)[0].WaitFor(ctx, func(st enginesource.Stats) bool { return st.BlocksStored >= 40 }); err != nil {
		t.Fatal(err)
	}
	other := 3 - cached
	dead := fleets[cached].Engines()[0]
	fleets[cached].Close()

	// The router prefers the engine caching the prompt; it refuses, the
	// request goes to the other, and the refusing engine is out.
	killedAt := time.Now()
	if got := complete(t, s, p); got != other {
		t.Fatalf("served by %d, want %d", got, other)
	}
	if ws := s.Router().Workers(); len(ws) != 1 || ws[0].ID != other {
		t.Fatalf("router workers %+v right after the refusal", ws)
	}
	if live := s.liveWorkers(); len(live) != 1 || live[0].ID != other {
		t.Fatalf("live workers %+v right after the refusal", live)
	}
	if waited := time.Since(killedAt); waited >= probeEvery {
		t.Fatalf("took %v, the probe could have done it", waited)
	}
	waitIdle(t, s)

	restartOnItsPorts(t, dead)
	back, cancelBack := context.WithTimeout(context.Background(), 10*probeEvery)
	defer cancelBack()
	if err := s.WaitWorkers(back, func(live int) bool { return live == 2 }); err != nil {
		t.Fatalf("the engine did not come back through the probe: %v", err)
	}
	if ws := s.Router().Workers(); len(ws) != 2 {
		t.Fatalf("router workers %+v after the engine came back", ws)
	}
}

// With --migration-limit 1 a stream whose engine dies mid-way continues on
// the other engine: the client reads one well-formed stream with every
// token it asked for.
func TestStreamContinuesOnAnotherEngine(t *testing.T) {
	for _, chat := range []bool{false, true} {
		a, b := engineFleetAt(t, 2), engineFleetAt(t, 2)
		s := startServerWith(t, Config{Router: router.DefaultConfig(), Workers: []WorkerSpec{spec(1, a), spec(2, b)}, HealthInterval: 50 * time.Millisecond, MigrationLimit: 1})
		fleets := map[uint64]*fleet.Fleet{1: a, 2: b}

		const maxTokens = 200
		body := map[string]any{"model": "kvrouter-mock", "max_tokens": maxTokens, "stream": true, "nvext": map[string]any{"extra_fields": []string{"worker_id"}}}
		path := "/v1/completions"
		if chat {
			path = "/v1/chat/completions"
			body["messages"] = []map[string]string{{"role": "user", "content": "tell me a long story"}}
		} else {
			body["prompt"] = "once upon a time"
		}
		raw, _ := json.Marshal(body)
		resp, err := http.Post("http://"+s.Addr()+path, "application/json", bytes.NewReader(raw))
		if err != nil {
			t.Fatal(err)
		}
		events := readEvents(t, resp.Body, func(first map[string]any) {
			// Kill the engine serving the stream once it has begun.
			id := uint64(first["nvext"].(map[string]any)["worker_id"].(float64))
			fleets[id].Close()
		})
		resp.Body.Close()
		if len(events) < 2 || events[len(events)-1] != "[DONE]" {
			t.Fatalf("chat=%v: the stream does not end with [DONE]: %q", chat, events)
		}
		ids, roles, tokens := map[string]bool{}, 0, 0
		for _, ev := range events[:len(events)-1] {
			var ch struct {
				ID      string          `json:"id"`
				Error   json.RawMessage `json:"error"`
				Choices []struct {
					Text  *string `json:"text"`
					Delta *struct {
						Role    *string `json:"role"`
						Content *string `json:"content"`
					} `json:"delta"`
				} `json:"choices"`
			}
			if err := json.Unmarshal([]byte(ev), &ch); err != nil || ch.Error != nil {
				t.Fatalf("chat=%v: event %q", chat, ev)
			}
			ids[ch.ID] = true
			for _, c := range ch.Choices {
				if c.Delta != nil && c.Delta.Role != nil {
					roles++
				}
				if (c.Text != nil && *c.Text != "") || (c.Delta != nil && c.Delta.Content != nil && *c.Delta.Content != "") {
					tokens++
				}
			}
		}
		if len(ids) != 1 || tokens != maxTokens || (chat && roles != 1) {
			t.Fatalf("chat=%v: ids %v, %d tokens (want %d), %d role deltas", chat, ids, tokens, maxTokens, roles)
		}
		if got := metricsHave(t, s, `kvrouter_frontend_model_migration_total{migration_type="ongoing_request",model="kvrouter-mock"} 1`); !got {
			t.Fatalf("chat=%v: the migration is not counted", chat)
		}
		waitIdle(t, s)
	}
}

// metricsHave reports whether /metrics has the line.
func metricsHave(t *testing.T, s *Server, line string) bool {
	t.Helper()
	resp, err := http.Get("http://" + s.Addr() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return bytes.Contains(body, []byte(line))
}

// readEvents reads a stream's data payloads, calling onFirst with the
// first chunk.
func readEvents(t *testing.T, r io.Reader, onFirst func(map[string]any)) []string {
	t.Helper()
	var out []string
	data, err := io.ReadAll(&firstChunkHook{r: r, onFirst: onFirst, t: t})
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range bytes.Split(data, []byte("\n")) {
		if v, ok := bytes.CutPrefix(line, []byte("data: ")); ok {
			out = append(out, string(v))
		}
	}
	return out
}

// firstChunkHook passes a stream through and calls onFirst once the first
// data event has arrived whole.
type firstChunkHook struct {
	t       *testing.T
	r       io.Reader
	buf     []byte
	onFirst func(map[string]any)
	done    bool
}

func (h *firstChunkHook) Read(p []byte) (int, error) {
	n, err := h.r.Read(p)
	if !h.done {
		h.buf = append(h.buf, p[:n]...)
		if end := bytes.Index(h.buf, []byte("\n\n")); end >= 0 {
			h.done = true
			var first map[string]any
			if json.Unmarshal(bytes.TrimPrefix(h.buf[:end], []byte("data: ")), &first) != nil {
				h.t.Errorf("first event %q", h.buf[:end])
			} else {
				h.onFirst(first)
			}
		}
	}
	return n, err
}

// An engine that answers /health but never answers a request: every
// request still succeeds, on the other engines, and the engine is ejected
// from routing, with its metric and its /health entry.
func TestHealthyButHungEngineIsEjected(t *testing.T) {
	a, b := engineFleet(t), engineFleet(t)
	stop := make(chan struct{})
	hung := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/health" {
			return
		}
		select {
		case <-r.Context().Done():
		case <-stop:
		}
	}))
	t.Cleanup(hung.Close)
	t.Cleanup(func() { close(stop) })
	s := startServerWith(t, Config{
		Router: router.DefaultConfig(), Workers: []WorkerSpec{spec(1, a), spec(2, b), {ID: 3, Name: "hung", URL: hung.URL, Model: "kvrouter-mock"}},
		HealthInterval: 50 * time.Millisecond, EngineResponseTimeout: 3 * time.Second,
		Outlier: outlier.Config{Consecutive: 2, BaseEjection: time.Minute},
	})
	start := time.Now()
	for i := 0; i < 20 || !metricsHave(t, s, `kvrouter_worker_ejections_total{worker_id="3"} 1`); i++ {
		if i == 200 {
			t.Fatal("the hung engine was not ejected after 200 requests")
		}
		if _, err := tryComplete(s, prompt(0, i, 64)); err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
	}
	if took := time.Since(start); took > 40*time.Second {
		t.Fatalf("took %v", took)
	}
	resp, err := http.Get(s.URL() + "/health")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if !bytes.Contains(body, []byte(`"ejected":{"reason":"timeout"`)) || !bytes.Contains(body, []byte(`"status":"degraded"`)) {
		t.Fatalf("/health: %s", body)
	}
	if !metricsHave(t, s, "kvrouter_workers_ejected 1") {
		t.Fatal("kvrouter_workers_ejected is not 1")
	}
	waitIdle(t, s)
}
