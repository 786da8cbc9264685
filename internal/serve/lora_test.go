package serve

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/adapters/frontend"
	"github.com/kvrouter/kvrouter/core/lora"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/internal/testwait"
	"github.com/kvrouter/kvrouter/mocker/fleet"
)

// loraEngine is a fake vLLM engine of model base that lists its adapters
// in /v1/models as vLLM does (entries whose parent is the base model) and
// records the model of every completion it is sent.
type loraEngine struct {
	base string
	srv  *httptest.Server

	mu       sync.Mutex
	adapters []string
	served   []string
}

func newLoRAEngine(t *testing.T, base string, adapters ...string) *loraEngine {
	t.Helper()
	e := &loraEngine{base: base, adapters: adapters}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /health", func(http.ResponseWriter, *http.Request) {})
	mux.HandleFunc("GET /v1/models", func(w http.ResponseWriter, _ *http.Request) {
		e.mu.Lock()
		defer e.mu.Unlock()
		data := []map[string]any{{"id": base, "object": "model", "root": base, "parent": nil}}
		for _, a := range e.adapters {
			data = append(data, map[string]any{"id": a, "object": "model", "root": "/adapters/" + a, "parent": base})
		}
		_ = json.NewEncoder(w).Encode(map[string]any{"object": "list", "data": data})
	})
	mux.HandleFunc("POST /v1/completions", func(w http.ResponseWriter, r *http.Request) {
		var req struct {
			Model string `json:"model"`
		}
		body, _ := io.ReadAll(r.Body)
		_ = json.Unmarshal(body, &req)
		e.mu.Lock()
		e.served = append(e.served, req.Model)
		e.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"cmpl-1","object":"text_completion","model":"`+req.Model+`","choices":[{"index":0,"text":"x","finish_reason":"length"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}`)
	})
	e.srv = httptest.NewServer(mux)
	t.Cleanup(e.srv.Close)
	return e
}

func (e *loraEngine) servedModels() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]string(nil), e.served...)
}

// postCompletion sends a token prompt for model and returns the status and
// body.
func postCompletion(t *testing.T, s *Server, model string, p []int) (int, string) {
	t.Helper()
	b, _ := json.Marshal(map[string]any{"model": model, "prompt": p, "max_tokens": 1})
	return postJSON(t, s.URL()+"/v1/completions", "", string(b))
}

func TestAdapterAnEngineListsIsServedByThatEngineOnly(t *testing.T) {
	holder := newLoRAEngine(t, "base", "sql-lora")
	other := newLoRAEngine(t, "base")
	s := startServerWith(t, Config{Router: router.DefaultConfig(), HealthInterval: 50 * time.Millisecond, Workers: []WorkerSpec{
		{ID: 1, Name: "holder", URL: holder.srv.URL, Model: "base"},
		{ID: 2, Name: "other", URL: other.srv.URL, Model: "base"},
	}})
	for i := range 20 {
		if code, body := postCompletion(t, s, "sql-lora", prompt(0, i, 40)); code != http.StatusOK {
			t.Fatalf("request %d for the adapter: %d %s", i, code, body)
		}
	}
	if got := other.servedModels(); len(got) != 0 {
		t.Fatalf("the engine without the adapter was sent %v", got)
	}
	if got := holder.servedModels(); len(got) != 20 {
		t.Fatalf("the holder served %d requests, want 20", len(got))
	}
}

// loraFleet starts n simulated engines (HTTP and ZMQ on free ports) and a
// router over them that re-reads their adapters every 20 ms.
func loraFleet(t *testing.T, n int, lcfg frontend.LoRA) (*Server, *fleet.Fleet) {
	t.Helper()
	fl := engineFleetWith(t, func(cfg *fleet.Config) { cfg.NumWorkers, cfg.SpeedupRatio = n, 100 })
	fcfg := fleet.DefaultConfig()
	workers := FleetWorkers(fl, fcfg)
	s := startServerWith(t, Config{Router: router.DefaultConfig(), Workers: workers, HealthInterval: 50 * time.Millisecond, LoRA: lcfg, LoRAPollInterval: 20 * time.Millisecond})
	return s, fl
}

// engineAdapters lists the adapters engine i of fl reports in /v1/models.
func engineAdapters(t *testing.T, fl *fleet.Fleet, i int) []string {
	t.Helper()
	names, err := readAdapters(context.Background(), http.DefaultClient, fl.Engines()[i].HTTPURL)
	if err != nil {
		t.Fatal(err)
	}
	return names
}

// routedAdapters lists the adapters the router knows engine id to hold.
func routedAdapters(s *Server, id uint64) []string {
	for _, w := range s.liveWorkers() {
		if w.ID == id {
			return w.Adapters
		}
	}
	return nil
}

type loraAnswer struct {
	worker, overlap, cached int
}

// completeLoRA sends prompt for model (pinned to engine pin unless 0) and
// returns the engine, the router's overlap and the engine's cached tokens.
func completeLoRA(t *testing.T, s *Server, model string, p []int, pin uint64) loraAnswer {
	t.Helper()
	nvext := map[string]any{"extra_fields": []string{"worker_id"}}
	if pin != 0 {
		nvext["backend_instance_id"] = pin
	}
	b, _ := json.Marshal(map[string]any{"model": model, "prompt": p, "max_tokens": 1, "nvext": nvext})
	code, body := postJSON(t, s.URL()+"/v1/completions", "", string(b))
	var out struct {
		Model string `json:"model"`
		NVExt struct {
			WorkerID      int `json:"worker_id"`
			OverlapBlocks int `json:"overlap_blocks"`
		} `json:"nvext"`
		Usage struct {
			Details struct {
				Cached int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if code != http.StatusOK || json.Unmarshal([]byte(body), &out) != nil {
		t.Fatalf("%s: %d %s", model, code, body)
	}
	if out.Model != model {
		t.Fatalf("answered as model %q, want %q", out.Model, model)
	}
	return loraAnswer{worker: out.NVExt.WorkerID, overlap: out.NVExt.OverlapBlocks, cached: out.Usage.Details.Cached}
}

func overlapOn(s *Server, p []int, lora string, id uint64) int {
	for _, l := range s.Router().PotentialLoads(toUint32(p), lora) {
		if l.Worker.ID == id {
			return l.OverlapBlocks
		}
	}
	return -1
}

func TestLoRAEndToEndOverMockers(t *testing.T) {
	s, fl := loraFleet(t, 3, frontend.LoRA{})
	const holder = 2
	if resp, body := postJSON(t, fl.Engines()[holder-1].HTTPURL+"/v1/load_lora_adapter", "", `{"lora_name": "sql-lora", "lora_path": "/adapters/sql"}`); resp != http.StatusOK {
		t.Fatalf("loading on the engine: %d %s", resp, body)
	}
	testwait.Until(t, 10*time.Second, "the router to read the engine's adapter", func() bool {
		return slices.Equal(routedAdapters(s, holder), []string{"sql-lora"})
	})

	// Never to an engine without the adapter (it would answer 404).
	for i := range 12 {
		if a := completeLoRA(t, s, "sql-lora", prompt(0, 100+i, 96), 0); a.worker != holder {
			t.Fatalf("request %d for the adapter went to engine %d; only %d holds it", i, a.worker, holder)
		}
	}

	// A repeated prompt hits the adapter's cache on its engine, and the
	// router matches it by the events the engine published under the
	// adapter's name; the same tokens on the base model match nothing.
	p := prompt(0, 7, 160)
	completeLoRA(t, s, "sql-lora", p, 0)
	testwait.Until(t, 10*time.Second, "the adapter's blocks in the index", func() bool { return overlapOn(s, p, "sql-lora", holder) >= 9 })
	if a := completeLoRA(t, s, "sql-lora", p, 0); a.worker != holder || a.cached == 0 || a.overlap < 9 {
		t.Fatalf("the repeated adapter prompt: %+v, want engine %d, cached tokens, 9+ overlap blocks", a, holder)
	}
	if n := overlapOn(s, p, "", holder); n != 0 {
		t.Fatalf("the base model's tokens match %d of the adapter's blocks", n)
	}
	if a := completeLoRA(t, s, "kvrouter-mock", p, holder); a.cached != 0 || a.overlap != 0 {
		t.Fatalf("the base model on the adapter's engine: %+v, want no cache and no overlap", a)
	}

	// An engine that drops the adapter stops getting its requests.
	if resp, body := postJSON(t, fl.Engines()[holder-1].HTTPURL+"/v1/unload_lora_adapter", "", `{"lora_name": "sql-lora"}`); resp != http.StatusOK {
		t.Fatalf("unloading: %d %s", resp, body)
	}
	testwait.Until(t, 10*time.Second, "the router to see the unload", func() bool { return len(routedAdapters(s, holder)) == 0 })
	if code, body := postCompletion(t, s, "sql-lora", prompt(0, 1, 32)); code != http.StatusNotFound {
		t.Fatalf("the adapter after its unload: %d %s, want 404", code, body)
	}
}

func TestDynamicLoadingOverMockersLoadsOnceWhereHashingSays(t *testing.T) {
	s, fl := loraFleet(t, 3, frontend.LoRA{DynamicLoading: true, Modules: map[string]frontend.LoRAModule{"sql-lora": {Name: "sql-lora", Path: "/adapters/sql"}}})
	want, _ := lora.Choose("sql-lora", []uint64{1, 2, 3})
	const n = 8
	var wg sync.WaitGroup
	workers := make([]int, n)
	for i := range n {
		wg.Go(func() {
			workers[i] = completeLoRA(t, s, "sql-lora", prompt(0, 200+i, 64), 0).worker
		})
	}
	wg.Wait()
	for i, w := range workers {
		if uint64(w) != want {
			t.Fatalf("request %d went to engine %d; the adapter was placed on %d", i, w, want)
		}
	}
	for i := range fl.Engines() {
		got := engineAdapters(t, fl, i)
		if uint64(i+1) == want && !slices.Equal(got, []string{"sql-lora"}) || uint64(i+1) != want && len(got) > 0 {
			t.Fatalf("engine %d holds %v; the adapter belongs on engine %d only", i+1, got, want)
		}
	}
}
