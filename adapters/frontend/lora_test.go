package frontend

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/lora"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/internal/testwait"
)

// loraFake is a fake vLLM engine that loads adapters through
// /v1/load_lora_adapter (after gate, when set, is closed) and records the
// model of every completion.
type loraFake struct {
	id   uint64
	srv  *httptest.Server
	gate chan struct{}
	// noRuntimeLoading answers the load as vLLM without
	// VLLM_ALLOW_RUNTIME_LORA_UPDATING: FastAPI's 404.
	noRuntimeLoading bool

	mu       sync.Mutex
	adapters []string
	loads    []string // the bodies of the load calls
	served   []string
}

func (f *loraFake) handle(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	switch r.URL.Path {
	case "/v1/load_lora_adapter":
		if f.gate != nil {
			<-f.gate
		}
		if f.noRuntimeLoading {
			w.WriteHeader(http.StatusNotFound)
			_, _ = io.WriteString(w, `{"detail":"Not Found"}`)
			return
		}
		var req struct {
			Name string `json:"lora_name"`
		}
		_ = json.Unmarshal(body, &req)
		f.mu.Lock()
		f.loads = append(f.loads, string(body))
		f.adapters = append(f.adapters, req.Name)
		f.mu.Unlock()
		_, _ = io.WriteString(w, "Success: LoRA adapter '"+req.Name+"' added successfully.")
	case "/v1/completions":
		var req struct {
			Model string `json:"model"`
		}
		_ = json.Unmarshal(body, &req)
		f.mu.Lock()
		f.served = append(f.served, req.Model)
		f.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"c","object":"text_completion","choices":[{"index":0,"text":"x","finish_reason":"length"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}`)
	default:
		http.NotFound(w, r)
	}
}

func (f *loraFake) snapshot() (adapters, loads, served []string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.adapters), slices.Clone(f.loads), slices.Clone(f.served)
}

// loraEnv runs a frontend over fake engines 1..n of model "base", engine
// i holding held[i-1]; Reread refreshes the registry from the fakes.
type loraEnv struct {
	*env
	fakes []*loraFake
}

func newLoRAEnv(t *testing.T, n int, held map[uint64][]string, cfg LoRA) *loraEnv {
	t.Helper()
	le := &loraEnv{}
	cfg.Reread = func(_ context.Context, id uint64) { le.reread(id) }
	le.env = newEnv(t, envOpts{frontend: func(c *Config) { c.LoRA = cfg }})
	for i := range n {
		f := &loraFake{id: uint64(i + 1), adapters: held[uint64(i+1)]}
		f.srv = httptest.NewServer(http.HandlerFunc(f.handle))
		t.Cleanup(f.srv.Close)
		le.fakes = append(le.fakes, f)
		le.add(Worker{ID: f.id, Name: "engine-" + string(rune('0'+f.id)), BaseURL: f.srv.URL, Model: "base", DPSize: 1, Adapters: slices.Clone(f.adapters)})
	}
	return le
}

// reread copies engine id's adapters into the registry, as serve's
// re-read of /v1/models does.
func (le *loraEnv) reread(id uint64) {
	adapters, _, _ := le.fakes[id-1].snapshot()
	le.mu.Lock()
	defer le.mu.Unlock()
	for i := range le.workers {
		if le.workers[i].ID == id {
			le.workers[i].Adapters = adapters
		}
	}
}

func (le *loraEnv) complete(model string, salt int) (*http.Response, []byte) {
	le.t.Helper()
	return le.post("/v1/completions", map[string]any{"model": model, "prompt": tokens(64, salt), "max_tokens": 1})
}

func TestAdapterRequestsGoOnlyToTheEnginesHoldingIt(t *testing.T) {
	le := newLoRAEnv(t, 4, map[uint64][]string{2: {"sql-lora"}, 4: {"sql-lora", "chat-lora"}}, LoRA{})
	for i := range 40 {
		if resp, body := le.complete("sql-lora", i); resp.StatusCode != http.StatusOK {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, body)
		}
	}
	le.settle()
	for _, f := range le.fakes {
		_, _, served := f.snapshot()
		holds := f.id == 2 || f.id == 4
		if !holds && len(served) > 0 {
			t.Fatalf("engine %d, without the adapter, was sent %d of its requests", f.id, len(served))
		}
		if holds && len(served) == 0 {
			t.Fatalf("engine %d holds the adapter and was sent none of 40 requests: load is not balanced among the holders", f.id)
		}
		for _, m := range served {
			if m != "sql-lora" {
				t.Fatalf("engine %d was sent model %q: the body's model must stay the adapter's name", f.id, m)
			}
		}
	}
	// The base model is still served by every engine.
	if resp, body := le.complete("base", 99); resp.StatusCode != http.StatusOK {
		t.Fatalf("the base model: %d %s", resp.StatusCode, body)
	}
}

func TestAdapterNoEngineHoldsIs404WithoutDynamicLoading(t *testing.T) {
	le := newLoRAEnv(t, 2, nil, LoRA{Modules: map[string]LoRAModule{"sql-lora": {Name: "sql-lora", Path: "/adapters/sql"}}})
	resp, body := le.complete("sql-lora", 1)
	if code := openAIError(t, resp, body, http.StatusNotFound); code != "model_not_found" {
		t.Fatalf("code %q, want model_not_found", code)
	}
	for _, want := range []string{"no engine has the LoRA adapter `sql-lora` loaded", "--lora-dynamic-loading"} {
		if !strings.Contains(string(body), want) {
			t.Fatalf("the message does not say %q: %s", want, body)
		}
	}
	for _, f := range le.fakes {
		if _, loads, _ := f.snapshot(); len(loads) > 0 {
			t.Fatalf("engine %d was asked to load the adapter without dynamic loading", f.id)
		}
	}
}

func TestDynamicLoadingPlacesTheAdapterByRendezvousHashingThenRoutesIt(t *testing.T) {
	le := newLoRAEnv(t, 4, nil, LoRA{DynamicLoading: true, Modules: map[string]LoRAModule{
		"sql-lora": {Name: "sql-lora", Path: "/adapters/sql"}, "chat-lora": {Name: "chat-lora", Path: "/adapters/chat", Base: "base"},
	}})
	if resp, body := le.complete("unknown-lora", 1); resp.StatusCode != http.StatusNotFound || !strings.Contains(string(body), "--lora-modules unknown-lora=PATH") {
		t.Fatalf("an adapter without a path: %d %s, want 404 naming --lora-modules", resp.StatusCode, body)
	}
	for _, name := range []string{"sql-lora", "chat-lora"} {
		want, _ := lora.Choose(name, []uint64{1, 2, 3, 4})
		for i := range 5 {
			if resp, body := le.complete(name, i); resp.StatusCode != http.StatusOK {
				t.Fatalf("%s request %d: %d %s", name, i, resp.StatusCode, body)
			}
		}
		for _, f := range le.fakes {
			_, loads, served := f.snapshot()
			n := 0
			for _, l := range loads {
				if strings.Contains(l, `"lora_name":"`+name+`"`) {
					n++
					if !strings.Contains(l, `"lora_path":"/adapters/`) {
						t.Fatalf("load without the module's path: %s", l)
					}
				}
			}
			m := 0
			for _, s := range served {
				if s == name {
					m++
				}
			}
			switch {
			case f.id == want && (n != 1 || m != 5):
				t.Fatalf("%s: the engine hashing chose, %d, had %d loads and %d requests, want 1 and 5", name, f.id, n, m)
			case f.id != want && (n != 0 || m != 0):
				t.Fatalf("%s: engine %d, not the one hashing chose (%d), had %d loads and %d requests", name, f.id, want, n, m)
			}
		}
	}
	le.settle()
}

func TestConcurrentFirstRequestsLoadTheAdapterOnce(t *testing.T) {
	le := newLoRAEnv(t, 3, nil, LoRA{DynamicLoading: true, Modules: map[string]LoRAModule{"sql-lora": {Name: "sql-lora", Path: "/adapters/sql"}}})
	want, _ := lora.Choose("sql-lora", []uint64{1, 2, 3})
	gate := make(chan struct{})
	le.fakes[want-1].gate = gate
	const n = 16
	var wg sync.WaitGroup
	statuses := make([]int, n)
	for i := range n {
		wg.Go(func() {
			resp, _ := le.complete("sql-lora", i)
			statuses[i] = resp.StatusCode
		})
	}
	// Every request is in the frontend, waiting on the one load, before
	// the engine answers it.
	testwait.Until(t, 10*time.Second, "every request waiting for the load", func() bool {
		le.fe.loras.mu.Lock()
		defer le.fe.loras.mu.Unlock()
		l := le.fe.loras.pending["sql-lora"]
		return l != nil && l.waiters == n
	})
	close(gate)
	wg.Wait()
	for i, st := range statuses {
		if st != http.StatusOK {
			t.Fatalf("request %d: status %d", i, st)
		}
	}
	total := 0
	for _, f := range le.fakes {
		_, loads, _ := f.snapshot()
		total += len(loads)
	}
	if total != 1 {
		t.Fatalf("%d concurrent first requests made %d loads, want 1", n, total)
	}
	le.settle()
}

func TestAnEngineThatCannotLoadAdaptersIsExplained(t *testing.T) {
	le := newLoRAEnv(t, 1, nil, LoRA{DynamicLoading: true, Modules: map[string]LoRAModule{"sql-lora": {Name: "sql-lora", Path: "/adapters/sql"}}})
	le.fakes[0].noRuntimeLoading = true
	resp, body := le.complete("sql-lora", 1)
	if code := openAIError(t, resp, body, http.StatusBadGateway); code != "lora_load_failed" {
		t.Fatalf("code %q, want lora_load_failed", code)
	}
	if !strings.Contains(string(body), "VLLM_ALLOW_RUNTIME_LORA_UPDATING") {
		t.Fatalf("the message does not say how to enable loading: %s", body)
	}
}

func TestRouterAPIRoutesAnAdapterToItsHolders(t *testing.T) {
	le := newLoRAEnv(t, 3, map[uint64][]string{3: {"sql-lora"}}, LoRA{})
	for _, body := range []map[string]any{
		{"model": "sql-lora", "tokens": tokens(64, 1)},
		{"model": "base", "lora_name": "sql-lora", "tokens": tokens(64, 2)},
	} {
		resp, out := le.post("/router/best_worker", body)
		var d struct {
			WorkerID uint64 `json:"worker_id"`
		}
		if resp.StatusCode != http.StatusOK || json.Unmarshal(out, &d) != nil || d.WorkerID != 3 {
			t.Fatalf("best_worker %v: %d %s, want engine 3, the only holder", body, resp.StatusCode, out)
		}
		resp, out = le.post("/router/potential_loads", body)
		var loads []struct {
			WorkerID uint64 `json:"worker_id"`
		}
		if resp.StatusCode != http.StatusOK || json.Unmarshal(out, &loads) != nil || len(loads) != 1 || loads[0].WorkerID != 3 {
			t.Fatalf("potential_loads %v: %d %s, want engine 3 only", body, resp.StatusCode, out)
		}
	}
	if resp, out := le.post("/router/best_worker", map[string]any{"model": "chat-lora", "tokens": tokens(8, 1)}); resp.StatusCode != http.StatusNotFound {
		t.Fatalf("an adapter no engine holds: %d %s, want 404", resp.StatusCode, out)
	}
}

func TestDynamicLoadingNeverPlacesAnAdapterOnAPrefillEngine(t *testing.T) {
	le := newLoRAEnv(t, 2, nil, LoRA{DynamicLoading: true, Modules: map[string]LoRAModule{"sql-lora": {Name: "sql-lora", Path: "/adapters/sql"}}})
	hashed, _ := lora.Choose("sql-lora", []uint64{1, 2})
	le.router.AddWorker(router.WorkerInfo{ID: hashed, Model: "base", DPSize: 1, TotalKVBlocks: 4096, Role: router.RolePrefill})
	if resp, body := le.complete("sql-lora", 1); resp.StatusCode != http.StatusOK {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	if _, loads, _ := le.fakes[hashed-1].snapshot(); len(loads) != 0 {
		t.Fatalf("the adapter was loaded on engine %d, a prefill engine", hashed)
	}
}
