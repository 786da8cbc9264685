package serve

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/router"
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

func (e *loraEngine) setAdapters(names ...string) {
	e.mu.Lock()
	e.adapters = names
	e.mu.Unlock()
}

func (e *loraEngine) servedModels() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]string(nil), e.served...)
}

// postCompletion sends a token prompt for model and returns the status and
// body.
func postCompletion(t *testing.T, s *Server, model string, p []int) (int, []byte) {
	t.Helper()
	b, _ := json.Marshal(map[string]any{"model": model, "prompt": p, "max_tokens": 1, "nvext": map[string]any{"extra_fields": []string{"worker_id"}}})
	resp, err := http.Post(s.URL()+"/v1/completions", "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, body
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
