package server

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
)

// cache_salt reaches the engine: a prompt is served from cache only for
// the salt it was cached under, as vLLM does; a salt that is not a
// non-empty string is refused.
func TestCacheSaltSeparatesTheCache(t *testing.T) {
	srv, _ := start(t, 256, 100)
	prompt := ids(320, 4)
	cached := func(salt any) int {
		t.Helper()
		resp, body := post(t, srv.URL+"/v1/completions", map[string]any{"prompt": prompt, "max_tokens": 1, "cache_salt": salt})
		var c struct {
			Usage usage `json:"usage"`
		}
		if resp.StatusCode != 200 || json.Unmarshal(body, &c) != nil {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
		return c.Usage.PromptTokensDetails.CachedTokens
	}
	for i, step := range []struct {
		salt   any
		cached bool
	}{{"a", false}, {"a", true}, {"b", false}, {nil, false}, {"b", true}, {nil, true}} {
		if got := cached(step.salt); (got > 0) != step.cached {
			t.Errorf("step %d, salt %v: %d tokens cached, want cached=%v", i, step.salt, got, step.cached)
		}
	}
	for _, bad := range []string{`""`, `5`, `["a"]`} {
		resp, err := http.Post(srv.URL+"/v1/completions", "application/json", strings.NewReader(`{"prompt": [1, 2], "cache_salt": `+bad+`}`))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadRequest {
			t.Errorf("cache_salt %s: status %d, want 400", bad, resp.StatusCode)
		}
	}
}
