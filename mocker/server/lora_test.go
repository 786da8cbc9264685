package server

import (
	"encoding/json"
	"net/http"
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/mocker/engine"
)

func startLoRA(t *testing.T, mods ...LoRAModule) string {
	t.Helper()
	cfg := DefaultConfig()
	cfg.MaxModelLen = 1 << 20
	cfg.LoRAModules = mods
	srv, _ := startConfig(t, 1024, 100, RealClock{}, cfg)
	return srv.URL
}

type modelCard struct {
	ID     string  `json:"id"`
	Root   string  `json:"root"`
	Parent *string `json:"parent"`
}

func listModels(t *testing.T, url string) []modelCard {
	t.Helper()
	resp, err := http.Get(url + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out struct {
		Data []modelCard `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		t.Fatal(err)
	}
	return out.Data
}

func adapterNames(cards []modelCard) []string {
	var out []string
	for _, c := range cards {
		if c.Parent != nil {
			out = append(out, c.ID)
		}
	}
	return out
}

// cachedTokens completes prompt under model and returns the prompt's
// cached tokens, or the status of a refusal.
func cachedTokens(t *testing.T, url, model string, prompt []int) (cached, status int, body []byte) {
	t.Helper()
	resp, b := post(t, url+"/v1/completions", map[string]any{"model": model, "prompt": prompt, "max_tokens": 1})
	if resp.StatusCode != http.StatusOK {
		return 0, resp.StatusCode, b
	}
	var out struct {
		Model string `json:"model"`
		Usage usage  `json:"usage"`
	}
	if err := json.Unmarshal(b, &out); err != nil {
		t.Fatal(err)
	}
	if out.Model != model {
		t.Fatalf("answer names model %q, want %q", out.Model, model)
	}
	return out.Usage.PromptTokensDetails.CachedTokens, http.StatusOK, b
}

func TestLoRAModulesAreListedWithTheirParent(t *testing.T) {
	url := startLoRA(t, LoRAModule{Name: "sql-lora", Path: "/adapters/sql"})
	cards := listModels(t, url)
	if len(cards) != 2 || cards[0].ID != "kvrouter-mock" || cards[0].Parent != nil {
		t.Fatalf("models %+v: want the base model first, without a parent", cards)
	}
	if c := cards[1]; c.ID != "sql-lora" || c.Root != "/adapters/sql" || c.Parent == nil || *c.Parent != "kvrouter-mock" {
		t.Fatalf("adapter card %+v: want id sql-lora, root its path, parent the base model", c)
	}
}

func TestLoadAndUnloadAnswerAsVLLM(t *testing.T) {
	url := startLoRA(t)
	p := ids(64, 1)
	if _, st, _ := cachedTokens(t, url, "sql-lora", p); st != http.StatusNotFound {
		t.Fatalf("an adapter not loaded: status %d, want 404", st)
	}
	for _, tc := range []struct {
		path   string
		body   map[string]any
		status int
	}{
		{"/v1/load_lora_adapter", map[string]any{"lora_name": "sql-lora"}, http.StatusBadRequest},
		{"/v1/load_lora_adapter", map[string]any{"lora_name": "sql-lora", "lora_path": "/a"}, http.StatusOK},
		{"/v1/load_lora_adapter", map[string]any{"lora_name": "sql-lora", "lora_path": "/a"}, http.StatusBadRequest},
		{"/v1/load_lora_adapter", map[string]any{"lora_name": "sql-lora", "lora_path": "/b", "load_inplace": true}, http.StatusOK},
		{"/v1/unload_lora_adapter", map[string]any{}, http.StatusBadRequest},
		{"/v1/unload_lora_adapter", map[string]any{"lora_name": "other"}, http.StatusNotFound},
	} {
		resp, b := post(t, url+tc.path, tc.body)
		if resp.StatusCode != tc.status {
			t.Fatalf("%s %v: %d %s, want %d", tc.path, tc.body, resp.StatusCode, b, tc.status)
		}
		if tc.status != http.StatusOK {
			var e apiError
			if json.Unmarshal(b, &e) != nil || e.Error.Code != tc.status || e.Error.Message == "" {
				t.Fatalf("%s %v: error body %s is not vLLM's", tc.path, tc.body, b)
			}
		}
	}
	if got := adapterNames(listModels(t, url)); !slices.Equal(got, []string{"sql-lora"}) {
		t.Fatalf("adapters listed %v, want [sql-lora]", got)
	}
	if _, st, b := cachedTokens(t, url, "sql-lora", p); st != http.StatusOK {
		t.Fatalf("the loaded adapter: %d %s", st, b)
	}
	if resp, b := post(t, url+"/v1/unload_lora_adapter", map[string]any{"lora_name": "sql-lora"}); resp.StatusCode != http.StatusOK {
		t.Fatalf("unload: %d %s", resp.StatusCode, b)
	}
	if got := adapterNames(listModels(t, url)); len(got) != 0 {
		t.Fatalf("adapters listed after the unload: %v", got)
	}
	if _, st, _ := cachedTokens(t, url, "sql-lora", p); st != http.StatusNotFound {
		t.Fatalf("an unloaded adapter: status %d, want 404", st)
	}
}

func TestAdapterBlocksAreKeyedApartFromTheBaseModel(t *testing.T) {
	url := startLoRA(t, LoRAModule{Name: "sql-lora", Path: "/a"}, LoRAModule{Name: "chat-lora", Path: "/b"})
	p := ids(20*engine.DefaultConfig().BlockSize, 3)
	if c, _, _ := cachedTokens(t, url, "sql-lora", p); c != 0 {
		t.Fatalf("first adapter request: %d cached tokens", c)
	}
	if c, _, _ := cachedTokens(t, url, "sql-lora", p); c == 0 {
		t.Fatal("the adapter's repeated prompt hit no cache")
	}
	if c, _, _ := cachedTokens(t, url, "kvrouter-mock", p); c != 0 {
		t.Fatalf("the base model matched %d tokens the adapter cached", c)
	}
	if c, _, _ := cachedTokens(t, url, "chat-lora", p); c != 0 {
		t.Fatalf("another adapter matched %d tokens the first cached", c)
	}
}
