package frontend

import (
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/kvrouter/kvrouter/internal/testwait"
)

type tokHealth struct {
	Status    string   `json:"status"`
	Reasons   []string `json:"reasons"`
	Tokenizer []struct {
		Mismatch     bool `json:"mismatch"`
		EngineTokens int  `json:"engine_prompt_tokens"`
	} `json:"tokenizer"`
}

// gathered is the value of a metric of e's registry with the model label,
// -1 when it has none.
func (e *env) gathered(t *testing.T, name, model string) float64 {
	t.Helper()
	mfs, err := e.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "model" && l.GetValue() == model {
					if g := m.GetGauge(); g != nil {
						return g.GetValue()
					}
					return m.GetCounter().GetValue()
				}
			}
		}
	}
	return -1
}

func (e *env) tokHealth(t *testing.T) tokHealth {
	t.Helper()
	_, body := e.get("/health")
	var h tokHealth
	if err := json.Unmarshal(body, &h); err != nil {
		t.Fatalf("%v: %s", err, body)
	}
	return h
}

// An engine that counts another number of prompt tokens than the router
// (usage.prompt_tokens, whole or streamed) tokenizes otherwise: that is
// logged once, shown by /health (degraded, with both counts) and by
// kvrouter_tokenizer_mismatch, and cleared when the counts agree again.
func TestTokenizerMismatchIsReported(t *testing.T) {
	var logs testwait.Buffer
	e := newEnv(t, envOpts{frontend: func(c *Config) { c.Logger = slog.New(slog.NewTextHandler(&logs, nil)) }})
	var engineCount atomic.Int64
	engineCount.Store(300)
	e.fake(1, "m", 1, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		usage := fmt.Sprintf(`"usage":{"prompt_tokens":%d,"completion_tokens":1,"total_tokens":%d}`, engineCount.Load(), engineCount.Load()+1)
		if strings.Contains(string(b), `"stream":true`) {
			sseHandler([]string{
				`data: {"id":"x","object":"text_completion","choices":[{"index":0,"text":"a","finish_reason":"stop"}]}` + "\n\n",
				`data: {"id":"x","object":"text_completion","choices":[],` + usage + "}\n\n",
				"data: [DONE]\n\n",
			}, "")(w, r)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"x","object":"text_completion","choices":[{"index":0,"text":"a","finish_reason":"stop"}],`+usage+`}`)
	})
	complete := func(stream bool) {
		t.Helper()
		body := map[string]any{"model": "m", "prompt": tokens(32, 1), "max_tokens": 1}
		if stream {
			body["stream"], body["stream_options"] = true, map[string]any{"include_usage": true}
		}
		resp, b := e.post("/v1/completions", body)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
	}
	complete(false)
	h := e.tokHealth(t)
	want := `the router counted 32 prompt tokens where engine fake-m counted 300`
	if h.Status != "degraded" || len(h.Reasons) != 1 || !strings.Contains(h.Reasons[0], want) {
		t.Errorf("/health %+v, want degraded with %q", h, want)
	}
	if len(h.Tokenizer) != 1 || !h.Tokenizer[0].Mismatch || h.Tokenizer[0].EngineTokens != 300 {
		t.Errorf("/health tokenizer %+v", h.Tokenizer)
	}
	if v := e.gathered(t, "kvrouter_tokenizer_mismatch", "m"); v != 1 {
		t.Errorf("kvrouter_tokenizer_mismatch = %v", v)
	}
	complete(true)
	complete(false)
	if n := strings.Count(logs.String(), want); n != 1 {
		t.Errorf("logged %d times, want once:\n%s", n, logs.String())
	}
	if v := e.gathered(t, "kvrouter_prompt_token_count_mismatches_total", "m"); v != 3 {
		t.Errorf("kvrouter_prompt_token_count_mismatches_total = %v, want 3 (the stream's usage counted)", v)
	}

	engineCount.Store(32) // the right tokenizer
	complete(true)
	if h := e.tokHealth(t); h.Status != "ok" || len(h.Tokenizer) != 1 || h.Tokenizer[0].Mismatch {
		t.Errorf("/health %+v after the counts agreed", h)
	}
	if v := e.gathered(t, "kvrouter_tokenizer_mismatch", "m"); v != 0 {
		t.Errorf("kvrouter_tokenizer_mismatch = %v after the counts agreed", v)
	}
}
