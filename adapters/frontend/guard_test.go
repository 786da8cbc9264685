package frontend

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvrouter/kvrouter/adapters/modeltok"
)

// TestAPIKeyGuardsPromptAndCacheEndpoints: with an API key, what takes a
// prompt or shows the cache needs it (or the admin token). Without, a
// client guessed a secret in another client's prompt from the blocks
// potential_loads said were cached.
func TestAPIKeyGuardsPromptAndCacheEndpoints(t *testing.T) {
	for _, admin := range []string{"", testAdmin} {
		e := newEnv(t, envOpts{engines: 1, apiKey: testKey, adminToken: admin})
		prompt := map[string]any{"model": mockModel, "tokens": tokens(64, 1)}
		secret := map[string]any{"model": mockModel, "prompt": "the PIN is 4921", "max_tokens": 1}
		if resp, body := e.do("POST", "/v1/completions", testKey, secret); resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
		for _, c := range []struct {
			method, path string
			body         any
		}{
			{"POST", "/router/potential_loads", prompt},
			{"POST", "/router/best_worker", prompt},
			{"GET", "/ui/api/state", nil},
			{"GET", "/router/dump_events", nil},
			{"GET", "/busy_threshold", nil},
			{"POST", "/busy_threshold", map[string]any{"model": mockModel}},
			{"POST", "/router/free", map[string]any{"request_id": "x"}},
		} {
			for _, tok := range []string{"", "sk-wrong"} {
				resp, body := e.do(c.method, c.path, tok, c.body)
				if code := openAIError(t, resp, body, http.StatusUnauthorized); code != "invalid_api_key" {
					t.Errorf("admin %q: %s %s with %q: code %q", admin, c.method, c.path, tok, code)
				}
			}
			for _, tok := range []string{testKey, admin} {
				if tok == "" {
					continue
				}
				// The admin token may still be asked for; the key is not.
				if resp, body := e.do(c.method, c.path, tok, c.body); strings.Contains(string(body), "invalid_api_key") {
					t.Errorf("%s %s with a valid credential: %d %s", c.method, c.path, resp.StatusCode, body)
				}
			}
		}
		// The dashboard's page holds nothing; the probes and /metrics
		// stay open for the orchestrator and the scraper.
		for _, p := range []string{"/ui", "/live", "/ready", "/health", "/metrics"} {
			if resp, body := e.get(p); resp.StatusCode != http.StatusOK {
				t.Errorf("%s without a key: %d %s", p, resp.StatusCode, body)
			}
		}
		e.settle()
	}
}

// TestHealthShowsEngineURLsToTheAdminOnly: an engine's URL is a way around
// the router's keys and limits.
func TestHealthShowsEngineURLsToTheAdminOnly(t *testing.T) {
	urls := func(e *env, token, remote string) bool {
		req := httptest.NewRequest(http.MethodGet, "/health", nil)
		req.RemoteAddr = remote
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		rec := httptest.NewRecorder()
		e.fe.Handler().ServeHTTP(rec, req)
		var h struct {
			Workers []map[string]any `json:"workers"`
		}
		if err := json.Unmarshal(rec.Body.Bytes(), &h); err != nil || len(h.Workers) != 1 {
			t.Fatalf("%v: %s", err, rec.Body)
		}
		_, has := h.Workers[0]["base_url"]
		return has || strings.Contains(rec.Body.String(), "127.0.0.1:")
	}
	withAdmin := newEnv(t, envOpts{engines: 1, adminToken: testAdmin})
	for _, c := range []struct {
		e             *env
		token, remote string
		want          bool
	}{
		{withAdmin, "", "127.0.0.1:5000", false},
		{withAdmin, "wrong", "127.0.0.1:5000", false},
		{withAdmin, testAdmin, "192.0.2.7:5000", true},
		{newEnv(t, envOpts{engines: 1}), "", "127.0.0.1:5000", true},
		{newEnv(t, envOpts{engines: 1}), "", "[::1]:5000", true},
		{newEnv(t, envOpts{engines: 1}), "", "192.0.2.7:5000", false},
	} {
		if got := urls(c.e, c.token, c.remote); got != c.want {
			t.Errorf("token %q from %s: engine URLs shown %v, want %v", c.token, c.remote, got, c.want)
		}
	}
}

// TestNoTokenizingForAClientThatLeft: a request whose client has gone is
// not tokenized, in process or by an engine.
func TestNoTokenizingForAClientThatLeft(t *testing.T) {
	tok := llamaTokenizer(t)
	var engineCalls atomic.Int64
	e := newEnv(t, envOpts{frontend: func(c *Config) {
		c.Tokenizer = func(m string) *modeltok.Model { return map[string]*modeltok.Model{"local": tok}[m] }
	}})
	for _, model := range []string{"local", "remote"} {
		e.fake(uint64(len(model)), model, 1, func(w http.ResponseWriter, r *http.Request) {
			engineCalls.Add(1)
			_, _ = io.WriteString(w, `{"tokens":[1,2,3]}`)
		})
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	for _, model := range []string{"local", "remote"} {
		top := map[string]json.RawMessage{"model": json.RawMessage(`"` + model + `"`), "prompt": json.RawMessage(`"` + strings.Repeat("hello ", 1000) + `"`)}
		_, serving := e.fe.workersFor(model)
		ids, _, herr := e.fe.promptTokens(ctx, top, kindCompletion, model, serving, nil)
		if herr == nil || herr.Code != "cancelled" {
			t.Fatalf("%s: %d ids, error %v: want cancelled", model, len(ids), herr)
		}
	}
	if n := engineCalls.Load(); n != 0 {
		t.Fatalf("engines asked to tokenize %d times", n)
	}
	if n := testutil.ToFloat64(e.fe.m.tokenized.WithLabelValues("local", "in_process")); n != 0 {
		t.Fatalf("tokenized in process %v times", n)
	}
}

// crossSite sends a request as a browser would, with the headers given.
func (e *env) crossSite(method, path, contentType string, headers map[string]string, body string) (*http.Response, []byte) {
	e.t.Helper()
	req, err := http.NewRequest(method, e.srv.URL+path, strings.NewReader(body))
	if err != nil {
		e.t.Fatal(err)
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	for k, v := range headers {
		if k == "Host" {
			req.Host = v
			continue
		}
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		e.t.Fatal(err)
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	return resp, out
}

// TestCrossSiteRequestsCannotChangeState: any page the operator opens must
// not drain engines or change thresholds on a router without an admin
// token; the dashboard's own calls (same origin, JSON) still work.
func TestCrossSiteRequestsCannotChangeState(t *testing.T) {
	var drains atomic.Int64
	e := newEnv(t, envOpts{engines: 1, frontend: func(c *Config) {
		c.SetDrained = func(uint64, bool) error { drains.Add(1); return nil }
	}})
	u, _ := url.Parse(e.srv.URL)
	self := "http://" + u.Host
	drain := `{"worker_id":10,"drained":true}`
	threshold := `{"model":"` + mockModel + `","active_prefill_tokens_threshold":1}`
	for _, c := range []struct {
		name, ctype string
		headers     map[string]string
		status      int
		code        string
	}{
		{"text/plain, another origin", "text/plain", map[string]string{"Origin": "http://evil.example"}, 403, "cross_origin_request"},
		{"JSON, another origin", "application/json", map[string]string{"Origin": "http://evil.example"}, 403, "cross_origin_request"},
		{"JSON, an opaque origin", "application/json", map[string]string{"Origin": "null"}, 403, "cross_origin_request"},
		{"JSON, cross-site", "application/json", map[string]string{"Sec-Fetch-Site": "cross-site"}, 403, "cross_origin_request"},
		{"JSON, same-site", "application/json", map[string]string{"Sec-Fetch-Site": "same-site", "Origin": "http://a." + u.Hostname()}, 403, "cross_origin_request"},
		{"JSON, a rebound name", "application/json", map[string]string{"Host": "evil.example:" + u.Port(), "Origin": "http://evil.example:" + u.Port(), "Sec-Fetch-Site": "same-origin"}, 403, "cross_origin_request"},
		{"text/plain, no origin", "text/plain", nil, 415, "unsupported_media_type"},
		{"a form", "application/x-www-form-urlencoded", nil, 415, "unsupported_media_type"},
		{"no content type", "", nil, 415, "unsupported_media_type"},
	} {
		for _, p := range []struct{ path, body string }{{"/router/drain", drain}, {"/busy_threshold", threshold}, {"/router/free", `{"request_id":"x"}`}} {
			resp, body := e.crossSite("POST", p.path, c.ctype, c.headers, p.body)
			if code := openAIError(t, resp, body, c.status); code != c.code {
				t.Errorf("%s, %s: code %q, want %q", c.name, p.path, code, c.code)
			}
		}
	}
	if n := drains.Load(); n != 0 {
		t.Fatalf("%d drains went through", n)
	}
	if th := e.router.Thresholds().Get(mockModel); th.ActivePrefillTokens != nil {
		t.Fatalf("a cross-site request set a threshold: %+v", th)
	}
	// A completion from another site is refused too; one from curl is not.
	chat := `{"model":"` + mockModel + `","prompt":"hi","max_tokens":1}`
	if resp, body := e.crossSite("POST", "/v1/completions", "text/plain", map[string]string{"Origin": "http://evil.example"}, chat); resp.StatusCode != 403 {
		t.Errorf("cross-site completion: %d %s", resp.StatusCode, body)
	}
	if resp, body := e.crossSite("POST", "/v1/completions", "application/json", nil, chat); resp.StatusCode != 200 {
		t.Errorf("completion: %d %s", resp.StatusCode, body)
	}
	// The dashboard, and curl.
	for _, h := range []map[string]string{{"Origin": self, "Sec-Fetch-Site": "same-origin"}, {"Origin": self}, nil} {
		if resp, body := e.crossSite("POST", "/router/drain", "application/json; charset=utf-8", h, drain); resp.StatusCode != 200 {
			t.Errorf("same-origin drain %v: %d %s", h, resp.StatusCode, body)
		}
	}
	if n := drains.Load(); n != 3 {
		t.Fatalf("same-origin drains: %d, want 3", n)
	}
	// With an admin token, the token is what protects: a page reached by
	// name may use it.
	adm := newEnv(t, envOpts{adminToken: testAdmin, frontend: func(c *Config) { c.SetDrained = func(uint64, bool) error { return nil } }})
	byName := map[string]string{"Host": "router.example:" + u.Port(), "Origin": "http://router.example:" + u.Port(), "Sec-Fetch-Site": "same-origin", "Authorization": "Bearer " + testAdmin}
	if resp, body := adm.crossSite("POST", "/router/drain", "application/json", byName, drain); resp.StatusCode != 200 {
		t.Errorf("drain by name with the admin token: %d %s", resp.StatusCode, body)
	}
	e.settle()
}

// An engine configured but not in routing is named in /health with why,
// and its URL, there and in the why, only to those who may see URLs.
func TestHealthShowsAnUnroutableEnginesURLToTheAdminOnly(t *testing.T) {
	const url = "http://127.0.0.1:8109"
	e := newEnv(t, envOpts{engines: 1, adminToken: testAdmin, frontend: func(c *Config) {
		c.Engines = func() []EngineStatus {
			return []EngineStatus{{ID: 99, Name: "gone", URL: url, State: "unreachable", Why: "engine url=" + url + " unreachable: connection refused"}}
		}
	}})
	for _, token := range []string{"", testAdmin} {
		req := httptest.NewRequest(http.MethodGet, "/health", nil)
		req.RemoteAddr = "192.0.2.7:5000"
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		rec := httptest.NewRecorder()
		e.fe.Handler().ServeHTTP(rec, req)
		body := rec.Body.String()
		if !strings.Contains(body, "gone") || !strings.Contains(body, "connection refused") {
			t.Fatalf("token %q: the unroutable engine is not named with why: %s", token, body)
		}
		if shown := strings.Contains(body, "127.0.0.1:8109"); shown != (token != "") {
			t.Errorf("token %q: URL shown %v: %s", token, shown, body)
		}
	}
}
