package frontend

import (
	"encoding/json"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvrouter/kvrouter/adapters/chattemplate"
	"github.com/kvrouter/kvrouter/adapters/modeltok"
)

func llamaTokenizer(t *testing.T) *modeltok.Model {
	t.Helper()
	m, err := modeltok.Load("../hftokenizer/testdata/llama3_1")
	if err != nil {
		t.Fatal(err)
	}
	if !m.HasChatTemplate() {
		t.Fatal("the test tokenizer has no chat template")
	}
	return m
}

// A model with an in-process tokenizer is tokenized by the frontend: the
// engine's /tokenize is never asked, and the router hashes exactly the ids
// the tokenizer gives. A model without one still asks its engine.
func TestInProcessTokenization(t *testing.T) {
	tok := llamaTokenizer(t)
	var mu sync.Mutex
	tokenizeCalls := 0
	engine := func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/tokenize") {
			mu.Lock()
			tokenizeCalls++
			mu.Unlock()
			_, _ = w.Write([]byte(`{"tokens":[1,2,3],"count":3}`))
			return
		}
		_, _ = w.Write([]byte(`{"id":"x","choices":[{"index":0,"text":"ok"}]}`))
	}
	e := newEnv(t, envOpts{frontend: func(c *Config) {
		c.Tokenizer = func(model string) *modeltok.Model {
			if model == "llama" {
				return tok
			}
			return nil
		}
	}})
	e.fake(1, "llama", 1, engine)
	e.fake(2, "other", 1, engine)

	text := "The quick brown fox, 123 emoji 🦊 and <|begin_of_text|> written out."
	want, err := tok.EncodeText(text, true)
	if err != nil {
		t.Fatal(err)
	}
	msgs := []json.RawMessage{json.RawMessage(`{"role":"system","content":"Be brief."}`), json.RawMessage(`{"role":"user","content":"` + strings.Repeat("Hello there. ", 20) + `"}`)}
	wantChat, _, err := tok.EncodeChat(msgs, chattemplate.Options{AddGenerationPrompt: true}, false)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		body map[string]any
		want []uint32
	}{
		{"text", map[string]any{"model": "llama", "prompt": text}, want},
		{"text without special tokens", map[string]any{"model": "llama", "prompt": text, "add_special_tokens": false}, want[1:]},
		{"chat", map[string]any{"model": "llama", "messages": msgs}, wantChat},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp, body := e.post("/router/best_worker", tc.body)
			var out struct {
				PromptBlocks int `json:"prompt_blocks"`
			}
			if resp.StatusCode != http.StatusOK || json.Unmarshal(body, &out) != nil {
				t.Fatalf("%d %s", resp.StatusCode, body)
			}
			if out.PromptBlocks != len(tc.want)/e.router.BlockSize() {
				t.Fatalf("%d prompt blocks, the tokenizer gives %d ids (%d blocks)", out.PromptBlocks, len(tc.want), len(tc.want)/e.router.BlockSize())
			}
		})
	}
	if resp, body := e.post("/v1/completions", map[string]any{"model": "llama", "prompt": text, "max_tokens": 2}); resp.StatusCode != http.StatusOK {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	if tokenizeCalls != 0 {
		t.Fatalf("the engine's /tokenize was asked %d times for a model with a tokenizer", tokenizeCalls)
	}
	if resp, body := e.post("/v1/completions", map[string]any{"model": "other", "prompt": text, "max_tokens": 2}); resp.StatusCode != http.StatusOK || tokenizeCalls != 1 {
		t.Fatalf("a model without a tokenizer: %d %s, /tokenize asked %d times", resp.StatusCode, body, tokenizeCalls)
	}
	if got := testutil.ToFloat64(e.fe.m.tokenized.WithLabelValues("llama", "in_process")); got != 4 {
		t.Fatalf("in-process tokenizations counted: %v", got)
	}
	_, body := e.get("/v1/models")
	if !strings.Contains(string(body), `"id":"llama","object":"model","created"`) || !strings.Contains(string(body), `"tokenizer":"in-process"`) || !strings.Contains(string(body), `"tokenizer":"engine"`) {
		t.Fatalf("/v1/models does not say who tokenizes: %s", body)
	}
	// What the template or the tokenizer refuses is the client's error.
	resp, body := e.post("/v1/chat/completions", map[string]any{"model": "llama", "messages": []any{"not a message"}})
	if code := openAIError(t, resp, body, http.StatusBadRequest); code != "invalid_messages" {
		t.Fatalf("code %s", code)
	}
	e.settle()
}
