package frontend

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
)

const (
	testKey   = "sk-test-key"
	testAdmin = "admin-secret"
)

func TestAPIKeyGuardsOpenAIPaths(t *testing.T) {
	e := newEnv(t, envOpts{engines: 1, apiKey: testKey, adminToken: testAdmin})
	chat := map[string]any{"model": mockModel, "messages": []map[string]string{{"role": "user", "content": "hi"}}, "max_tokens": 2}
	for _, tc := range []struct {
		name, token string
		want        int
	}{
		{"no key", "", 401},
		{"wrong key", "sk-wrong", 401},
		{"key with a suffix", testKey + "x", 401},
		{"the key", testKey, 200},
		{"the admin token", testAdmin, 200},
	} {
		for _, req := range []struct {
			method, path string
			body         any
		}{{"GET", "/v1/models", nil}, {"POST", "/v1/chat/completions", chat}} {
			resp, body := e.do(req.method, req.path, tc.token, req.body)
			if tc.want == 401 {
				if code := openAIError(t, resp, body, 401); code != "invalid_api_key" {
					t.Errorf("%s %s: code %q", tc.name, req.path, code)
				}
				if resp.Header.Get("WWW-Authenticate") == "" {
					t.Errorf("%s: 401 without WWW-Authenticate", tc.name)
				}
				continue
			}
			if resp.StatusCode != tc.want {
				t.Errorf("%s %s: %d %s", tc.name, req.path, resp.StatusCode, body)
			}
		}
	}
	// Probes and metrics stay open: they carry no credentials.
	for _, p := range []string{"/live", "/ready", "/health", "/metrics"} {
		if resp, body := e.get(p); resp.StatusCode != 200 {
			t.Errorf("%s without a key: %d %s", p, resp.StatusCode, body)
		}
	}
	e.settle()
}

func TestAdminTokenGuardsStateChanges(t *testing.T) {
	e := newEnv(t, envOpts{engines: 2, adminToken: testAdmin})
	book := map[string]any{"model": mockModel, "tokens": tokens(32, 1), "request_id": "b1"}
	for _, c := range []struct {
		path string
		body any
	}{
		{"/busy_threshold", map[string]any{"model": mockModel, "active_prefill_tokens_threshold": 0}},
		{"/busy_threshold", map[string]any{"model": mockModel}},
		{"/router/best_worker", book},
		{"/router/mark_prefill_complete", map[string]any{"request_id": "b1"}},
		{"/router/free", map[string]any{"request_id": "b1"}},
	} {
		for _, tok := range []string{"", "wrong"} {
			resp, body := e.do("POST", c.path, tok, c.body)
			if code := openAIError(t, resp, body, 401); code != "invalid_admin_token" {
				t.Errorf("%s with %q: %s", c.path, tok, code)
			}
		}
	}
	if th := e.router.Thresholds().Get(mockModel); th.ActivePrefillTokens != nil {
		t.Fatalf("an unauthorised POST changed the thresholds: %+v", th)
	}
	if l := e.router.Loads(); l[0].ActiveRequests+l[1].ActiveRequests != 0 {
		t.Fatalf("an unauthorised booking holds load: %+v", l)
	}
	// Reading stays open: a query without request_id books nothing.
	if resp, body := e.do("POST", "/router/best_worker", "", map[string]any{"model": mockModel, "tokens": tokens(32, 1)}); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	if resp, body := e.get("/busy_threshold"); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	for _, c := range []struct {
		path string
		body any
		want string
	}{
		{"/router/best_worker", book, `"request_id":"b1"`},
		{"/router/mark_prefill_complete", map[string]any{"request_id": "b1"}, `"found":true`},
		{"/router/free", map[string]any{"request_id": "b1"}, `"found":true`},
		{"/busy_threshold", map[string]any{"model": mockModel, "active_decode_blocks_threshold": 0.9}, `"active_decode_blocks_threshold":0.9`},
	} {
		if resp, body := e.do("POST", c.path, testAdmin, c.body); resp.StatusCode != 200 || !strings.Contains(string(body), c.want) {
			t.Fatalf("%s as admin: %d %s", c.path, resp.StatusCode, body)
		}
	}
	e.settle()
}

func TestThresholdValidationAndSwitchOff(t *testing.T) {
	e := newEnv(t, envOpts{engines: 1})
	for _, bad := range []map[string]any{
		{"model": mockModel, "active_decode_blocks_threshold": 1e-7},
		{"model": mockModel, "active_decode_blocks_threshold": 0},
		{"model": mockModel, "active_decode_blocks_threshold": 1.5},
		{"model": mockModel, "active_prefill_tokens_threshold": -1},
		{"model": mockModel, "active_prefill_tokens_threshold": 1.5},
		{"model": mockModel, "active_decode_blocks_threshold": "0.5"},
	} {
		resp, body := e.post("/busy_threshold", bad)
		if code := openAIError(t, resp, body, 400); code != "invalid_threshold" {
			t.Errorf("%v: %s", bad, code)
		}
	}
	if th := e.router.Thresholds().Get(mockModel); th.ActiveDecodeBlocks != nil || th.ActivePrefillTokens != nil {
		t.Fatalf("refused thresholds were set: %+v", th)
	}
	set := func(body string, want string) {
		t.Helper()
		resp, out := e.post("/busy_threshold", body)
		if resp.StatusCode != 200 || !strings.Contains(string(out), want) {
			t.Fatalf("%s: %d %s, want %s", body, resp.StatusCode, out, want)
		}
	}
	set(`{"model":"kvrouter-mock","active_prefill_tokens_threshold":0,"active_decode_blocks_threshold":0.5}`,
		`"active_decode_blocks_threshold":0.5,"active_prefill_tokens_threshold":0}`)
	// null switches a threshold off; an absent field is left as it is.
	set(`{"model":"kvrouter-mock","active_prefill_tokens_threshold":null}`,
		`"active_decode_blocks_threshold":0.5,"active_prefill_tokens_threshold":null}`)
	set(`{"model":"kvrouter-mock","active_decode_blocks_threshold":null}`,
		`"active_decode_blocks_threshold":null,"active_prefill_tokens_threshold":null}`)
	if th := e.router.Thresholds().Get(mockModel); th.ActiveDecodeBlocks != nil || th.ActivePrefillTokens != nil {
		t.Fatalf("thresholds not switched off: %+v", th)
	}
}

// A pin to a busy worker is refused unless the caller holds the admin
// token: a client cannot pile work onto an overloaded engine.
func TestPinnedRequestRespectsBusy(t *testing.T) {
	e := newEnv(t, envOpts{engines: 2, adminToken: testAdmin})
	if resp, body := e.do("POST", "/busy_threshold", testAdmin, map[string]any{"model": mockModel, "active_prefill_tokens_threshold": 0}); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	// Worker 10 holds a prompt in prefill: busy.
	if resp, body := e.do("POST", "/router/best_worker", testAdmin, map[string]any{"model": mockModel, "tokens": tokens(32, 1), "request_id": "hold", "nvext": map[string]any{"backend_instance_id": 10}}); resp.StatusCode != 200 || !strings.Contains(string(body), `"worker_id":10`) {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	pinned := map[string]any{"model": mockModel, "prompt": tokens(32, 2), "max_tokens": 2, "nvext": map[string]any{"backend_instance_id": 10, "extra_fields": []string{"worker_id"}}}
	resp, body := e.do("POST", "/v1/completions", "", pinned)
	if code := openAIError(t, resp, body, 503); code != "all_workers_busy" {
		t.Fatal(code)
	}
	resp, body = e.do("POST", "/router/best_worker", "", map[string]any{"model": mockModel, "tokens": tokens(32, 2), "nvext": map[string]any{"backend_instance_id": 10}})
	if code := openAIError(t, resp, body, 503); code != "all_workers_busy" {
		t.Fatal(code)
	}
	// Unpinned traffic goes to the free worker; the admin's pin goes through.
	if resp, body := e.do("POST", "/v1/completions", "", map[string]any{"model": mockModel, "prompt": tokens(32, 3), "max_tokens": 2}); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	if resp, body := e.do("POST", "/v1/completions", testAdmin, pinned); resp.StatusCode != 200 || !strings.Contains(string(body), `"worker_id":10`) {
		t.Fatalf("admin pin: %d %s", resp.StatusCode, body)
	}
	e.do("POST", "/router/free", testAdmin, map[string]any{"request_id": "hold"})
	e.settle()
}

func TestBookingsBounded(t *testing.T) {
	e := newEnv(t, envOpts{engines: 2, maxBookings: 2})
	book := func(id string, n int) (*http.Response, []byte) {
		return e.post("/router/best_worker", map[string]any{"model": mockModel, "tokens": tokens(n, len(id)), "request_id": id})
	}
	for _, id := range []string{"a", "b"} {
		if resp, body := book(id, 32); resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
	}
	resp, body := book("c", 32)
	if code := openAIError(t, resp, body, 429); code != "too_many_bookings" {
		t.Fatal(code)
	}
	if resp, body := book("a", 32); openAIError(t, resp, body, 409) != "duplicate_request_id" {
		t.Fatal("a duplicate was booked")
	}
	e.post("/router/free", map[string]any{"request_id": "a"})
	if resp, body := book("c", 32); resp.StatusCode != 200 {
		t.Fatalf("after a free: %d %s", resp.StatusCode, body)
	}
	e.post("/router/free", map[string]any{"request_id": "b"})
	// No engine can hold more than its 4096 blocks of 16 tokens.
	resp, body = book("huge", 4096*16+1)
	if code := openAIError(t, resp, body, 400); code != "booking_too_large" {
		t.Fatal(code)
	}
	e.post("/router/free", map[string]any{"request_id": "c"})
	e.settle()
}

func TestPprofNeedsTheAdminToken(t *testing.T) {
	open := newEnv(t, envOpts{engines: 0})
	if resp, _ := open.get("/debug/pprof/cmdline"); resp.StatusCode != 404 {
		t.Fatalf("pprof without an admin token configured: %d", resp.StatusCode)
	}
	e := newEnv(t, envOpts{engines: 0, adminToken: testAdmin})
	for _, p := range []string{"/debug/pprof/", "/debug/pprof/cmdline", "/debug/pprof/heap"} {
		if resp, body := e.do("GET", p, "", nil); resp.StatusCode != 401 {
			t.Fatalf("%s without the token: %d %s", p, resp.StatusCode, body)
		}
		if resp, body := e.do("GET", p, testAdmin, nil); resp.StatusCode != 200 {
			t.Fatalf("%s with the token: %d %.200s", p, resp.StatusCode, body)
		}
	}
}

func TestLiveReadyHealth(t *testing.T) {
	models := []string{mockModel}
	e := newEnv(t, envOpts{engines: 1, models: func() []string { return models }})
	status := func(path string) (int, string) {
		resp, body := e.get(path)
		var out struct {
			Status  string
			Reasons []string
		}
		if err := json.Unmarshal(body, &out); err != nil {
			t.Fatalf("%s: %s", path, body)
		}
		return resp.StatusCode, out.Status + " " + strings.Join(out.Reasons, "; ")
	}
	check := func(path string, code int, want string) {
		t.Helper()
		if got, s := status(path); got != code || !strings.Contains(s, want) {
			t.Fatalf("%s: %d %q, want %d %q", path, got, s, code, want)
		}
	}
	check("/live", 200, "live")
	check("/ready", 200, "ready")
	check("/health", 200, "ok")

	// A model meant to be served without an engine in routing: not ready.
	models = []string{mockModel, "ghost"}
	check("/ready", 503, `model "ghost": no engine in routing`)
	check("/health", 503, "unavailable")
	models = []string{mockModel}

	e.fe.Drain()
	check("/ready", 503, "draining")
	check("/health", 503, "draining")
	check("/live", 200, "live")
}

// Abort ends what is still in flight: a stream with an error event and
// [DONE], a request waiting for its engine with 503.
func TestAbortEndsRequestsInFlight(t *testing.T) {
	e := newEnv(t, envOpts{})
	started := make(chan struct{}, 2)
	e.fake(1, "slow", 1, func(w http.ResponseWriter, r *http.Request) {
		var body struct{ Stream bool }
		_ = json.NewDecoder(r.Body).Decode(&body)
		if body.Stream {
			w.Header().Set("Content-Type", "text/event-stream")
			_, _ = io.WriteString(w, "data: {\"choices\":[{\"text\":\"a\"}]}\n\n")
			w.(http.Flusher).Flush()
		}
		started <- struct{}{}
		<-r.Context().Done()
	})
	streamResp, err := http.Post(e.srv.URL+"/v1/completions", "application/json", strings.NewReader(`{"model":"slow","prompt":[1,2,3],"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	defer streamResp.Body.Close()
	br := bufio.NewReader(streamResp.Body)
	if line, err := br.ReadString('\n'); err != nil || !strings.HasPrefix(line, "data: ") {
		t.Fatalf("first chunk: %q %v", line, err)
	}
	whole := make(chan error, 1)
	go func() {
		resp, err := http.Post(e.srv.URL+"/v1/completions", "application/json", strings.NewReader(`{"model":"slow","prompt":[1,2,3]}`))
		if err != nil {
			whole <- err
			return
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 503 || !strings.Contains(string(body), `"shutting_down"`) {
			err = fmt.Errorf("%d %s", resp.StatusCode, body)
		}
		whole <- err
	}()
	<-started
	<-started
	e.fe.Abort()
	data := sseData(t, br)
	if len(data) != 2 || !strings.Contains(data[0], `"code":"shutting_down"`) || data[1] != "[DONE]" {
		t.Fatalf("stream after Abort: %q", data)
	}
	if err := <-whole; err != nil {
		t.Fatalf("request waiting for its engine: %v", err)
	}
	e.settle()
	if got := e.counter("slow", "completions", "stream_error"); got != 1 {
		t.Fatalf("requests_total{stream_error} = %v", got)
	}
}
