package frontend

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/core/sched"
)

// Dynamo's overrides take effect wherever Dynamo accepts them: an overlap
// credit out of [0, 1] is refused, so a 400 shows the router read it.
func TestDynamoOverridesTakeEffectWhereDynamoPutsThem(t *testing.T) {
	e := newEnv(t, envOpts{engines: 1})
	e.settle()
	for _, body := range []map[string]any{
		{"nvext": map[string]any{"agent_hints": map[string]any{"kv_overlap_score_credit": 5}}},
		{"nvext": map[string]any{"overlap_score_credit": 5}},
		{"nvext": map[string]any{"router_config_override": map[string]any{"overlap_score_credit": 5}}},
		{"router_config_override": map[string]any{"kv_overlap_score_credit": 5}},
	} {
		body["model"], body["prompt"], body["max_tokens"] = mockModel, tokens(32, 1), 2
		resp, b := e.post("/v1/completions", body)
		if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(b), "overlap") {
			t.Errorf("%v: %d %s, want 400 naming the overlap credit", mustJSON(t, body), resp.StatusCode, b)
		}
	}
	// In range, each is served.
	resp, b := e.post("/v1/completions", map[string]any{"model": mockModel, "prompt": tokens(32, 2), "max_tokens": 2,
		"nvext": map[string]any{"agent_hints": map[string]any{"kv_overlap_score_credit": 0.5, "osl": 8, "speculative_prefill": false}}})
	if resp.StatusCode != http.StatusOK || resp.Header.Get(WarningHeader) != "" {
		t.Errorf("%d %q %s", resp.StatusCode, resp.Header.Values(WarningHeader), b)
	}
}

// An nvext key neither kvrouter nor Dynamo knows is served with a warning
// header naming it, or refused under --strict-nvext; the engine gets
// neither nvext nor router_config_override.
func TestUnknownNvextKeysWarnOrAreRefused(t *testing.T) {
	var mu sync.Mutex
	var got string
	e := newEnv(t, envOpts{})
	e.fake(1, "m", 1, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		got = string(b)
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"x","object":"text_completion","choices":[{"index":0,"text":"a","finish_reason":"stop"}]}`)
	})
	body := map[string]any{"model": "m", "prompt": tokens(16, 1), "max_tokens": 1,
		"nvext":                  map[string]any{"foo": 1, "greed_sampling": true, "agent_hints": map[string]any{"kv_overlap_score_credt": 0.5}},
		"router_config_override": map[string]any{"router_temperature": 0}}
	resp, b := e.post("/v1/completions", body)
	warnings := resp.Header.Values(WarningHeader)
	want := []string{`unknown nvext key "nvext.agent_hints.kv_overlap_score_credt"`, `unknown nvext key "nvext.foo"`}
	if resp.StatusCode != http.StatusOK || strings.Join(warnings, "|") != strings.Join(want, "|") {
		t.Fatalf("%d %q %s; want 200 with warnings %q", resp.StatusCode, warnings, b, want)
	}
	mu.Lock()
	if strings.Contains(got, "nvext") || strings.Contains(got, "router_config_override") {
		t.Errorf("the engine got the router's fields: %s", got)
	}
	mu.Unlock()

	strict := newEnv(t, envOpts{frontend: func(c *Config) { c.StrictNvext = true }})
	strict.fake(1, "m", 1, func(w http.ResponseWriter, r *http.Request) {})
	resp, b = strict.post("/v1/completions", body)
	if code := openAIError(t, resp, b, http.StatusBadRequest); code != "unknown_nvext_key" || !strings.Contains(string(b), `nvext.foo`) || !strings.Contains(string(b), "--strict-nvext") {
		t.Errorf("strict: %s", b)
	}
}

// Dynamo's X-Dynamo-Session-ID names the session when nvext does not.
func TestSessionHeaderNamesTheSession(t *testing.T) {
	for _, tc := range []struct {
		name, nvext, header string
		wantID              string
		wantAction          sched.SessionAction
	}{
		{"header alone binds", ``, "h1", "h1", sched.SessionBind},
		{"nvext's id wins", `{"session_control": {"session_id": "n1", "action": "open"}}`, "h1", "n1", sched.SessionOpen},
		{"header fills nvext's missing id", `{"session_control": {"action": "close"}}`, "h1", "h1", sched.SessionClose},
		{"neither", `{"agent_hints": {"priority": 1}}`, "", "", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := http.Header{}
			if tc.header != "" {
				h.Set(SessionHeader, tc.header)
			}
			var req router.Request
			_, _, _, herr := parseNvext(nvextInput{nvext: json.RawMessage(tc.nvext), header: h}, &req)
			if herr != nil {
				t.Fatal(herr)
			}
			switch {
			case tc.wantID == "" && req.Session != nil:
				t.Fatalf("a session %+v without any id given", req.Session)
			case tc.wantID != "" && (req.Session == nil || req.Session.ID != tc.wantID || req.Session.Action != tc.wantAction):
				t.Fatalf("session %+v, want id %q action %q", req.Session, tc.wantID, tc.wantAction)
			}
		})
	}
}

func TestStrictPriorityIsReadAsTheQueueTier(t *testing.T) {
	var req router.Request
	if _, _, _, herr := parseNvext(nvextInput{nvext: json.RawMessage(`{"agent_hints": {"strict_priority": 3, "priority": 1.5}}`)}, &req); herr != nil {
		t.Fatal(herr)
	}
	if req.StrictPriority != 3 || req.Priority != 1.5 {
		t.Fatalf("strict_priority %d, priority %v; want 3 and 1.5", req.StrictPriority, req.Priority)
	}
	for _, bad := range []string{`-1`, `1.5`, `"high"`} {
		_, _, _, herr := parseNvext(nvextInput{nvext: json.RawMessage(`{"agent_hints": {"strict_priority": ` + bad + `}}`)}, &router.Request{})
		if herr == nil || herr.status != http.StatusBadRequest || !strings.Contains(herr.Error(), "strict_priority") {
			t.Errorf("strict_priority %s: %v, want a 400 naming the field", bad, herr)
		}
	}
}
