package frontend

import (
	"encoding/json"
	"io"
	"net/http"
	"sync"
	"testing"

	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
)

// A request's top-level cache_salt (vLLM's field) keys its blocks: it is
// credited only with blocks cached under the same salt, on the chat and
// completion paths and in the router API, and reaches the engine as the
// client sent it. A salt that is not a non-empty string is refused as vLLM
// refuses it.
func TestCacheSaltKeysTheRequestsBlocks(t *testing.T) {
	e := newEnv(t, envOpts{router: func(c *router.Config) { c.PredictedTTL = 0 }})
	var mu sync.Mutex
	var seen [][]byte
	e.fake(70, "m", 1, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		seen = append(seen, b)
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"object":"text_completion","choices":[]}`)
	})
	prompt := tokens(64, 1)
	if err := e.router.ApplyEngineStored(&router.EngineStored{
		Worker: kv.Worker{ID: 70}, EngineHashes: []uint64{1, 2, 3, 4}, Tokens: prompt, BlockSize: 16, Salt: "tenant-a",
	}); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		salt any
		want int
	}{{"tenant-a", 4}, {"tenant-b", 0}, {nil, 0}} {
		raw, _ := json.Marshal(map[string]any{"model": "m", "prompt": prompt, "max_tokens": 1, "cache_salt": tc.salt, "nvext": extra})
		resp, body := e.post("/v1/completions", string(raw))
		if resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
		if nv := nvextOf(t, body); nv == nil || *nv.OverlapBlocks != tc.want {
			t.Errorf("cache_salt %v: nvext %s, want %d blocks credited", tc.salt, body, tc.want)
		}
		mu.Lock()
		var got map[string]any
		if err := json.Unmarshal(seen[len(seen)-1], &got); err != nil || got["cache_salt"] != tc.salt {
			t.Errorf("forwarded %s: cache_salt not as sent (%v)", seen[len(seen)-1], tc.salt)
		}
		mu.Unlock()
		resp, body = e.post("/router/potential_loads", map[string]any{"tokens": prompt, "model": "m", "cache_salt": tc.salt})
		var pl []potentialLoad
		if err := json.Unmarshal(body, &pl); err != nil || resp.StatusCode != 200 || len(pl) != 1 || pl[0].OverlapBlocks != tc.want {
			t.Errorf("cache_salt %v: potential loads %d %s, want %d blocks", tc.salt, resp.StatusCode, body, tc.want)
		}
	}
	for _, bad := range []string{`5`, `""`, `["a"]`, `{"a":1}`} {
		for _, path := range []string{"/v1/completions", "/v1/chat/completions", "/router/best_worker"} {
			body := `{"model":"m","prompt":[1,2],"messages":[{"role":"user","content":"x"}],"tokens":[1,2],"cache_salt":` + bad + `}`
			resp, got := e.post(path, body)
			if code := openAIError(t, resp, got, http.StatusBadRequest); code != "invalid_cache_salt" {
				t.Errorf("%s cache_salt %s: code %q (%s)", path, bad, code, got)
			}
		}
	}
	e.settle()
}

// The prefill half of a disaggregated request is routed by its salt too,
// and reaches the prefill engine with it.
func TestDisaggPrefillIsRoutedByTheCacheSalt(t *testing.T) {
	e := newEnv(t, envOpts{router: func(c *router.Config) { c.PredictedTTL = 0 }})
	plain, salted, decode := &seenBodies{}, &seenBodies{}, &seenBodies{}
	e.fakeRole(1, router.RolePrefill, fakeVLLMPrefill(plain, http.StatusOK))
	e.fakeRole(3, router.RolePrefill, fakeVLLMPrefill(salted, http.StatusOK))
	e.fakeRole(2, router.RoleDecode, fakeVLLMDecode(decode))
	prompt := tokens(64, 9)
	for id, salt := range map[uint64]string{1: "", 3: "tenant-a"} {
		if err := e.router.ApplyEngineStored(&router.EngineStored{
			Worker: kv.Worker{ID: id}, EngineHashes: []uint64{id<<8 | 1, id<<8 | 2, id<<8 | 3, id<<8 | 4}, Tokens: prompt, BlockSize: 16, Salt: salt,
		}); err != nil {
			t.Fatal(err)
		}
	}
	for _, salt := range []string{"tenant-a", "", "tenant-a"} {
		body := map[string]any{"model": "m", "prompt": prompt, "max_tokens": 4}
		if salt != "" {
			body["cache_salt"] = salt
		}
		if resp, got := e.post("/v1/completions", body); resp.StatusCode != http.StatusOK {
			t.Fatalf("%d %s", resp.StatusCode, got)
		}
	}
	e.settle()
	if len(salted.prefill) != 2 || len(plain.prefill) != 1 {
		t.Fatalf("prefills: %d on the salted engine (want 2), %d on the plain one (want 1)", len(salted.prefill), len(plain.prefill))
	}
	if salted.prefill[0]["cache_salt"] != "tenant-a" || plain.prefill[0]["cache_salt"] != nil {
		t.Fatalf("prefill bodies %v and %v", salted.prefill[0], plain.prefill[0])
	}
}
