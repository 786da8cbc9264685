package frontend

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/router"
)

// TestLargePromptsAllocateLittleBeyondTheirSize sends 16 concurrent text
// prompts of 2 MiB through tokenization, routing and forwarding, and
// bounds what the frontend allocates per request by a small multiple of
// the body: decoding the token list through []int64, re-encoding the
// prompt for /tokenize and the body for the engine once cost 25 times it.
func TestLargePromptsAllocateLittleBeyondTheirSize(t *testing.T) {
	// The router's predicted indexes (predict-on-route, and the prompts of
	// engines whose KV events have not come yet) copy the prompt's hashes,
	// which is not the frontend's doing.
	e := newEnv(t, envOpts{maxBody: 8 << 20, router: func(c *router.Config) { c.PredictedTTL, c.KVEventsGrace = 0, 0 }})
	const size, concurrent = 2 << 20, 16
	text := strings.Repeat("hello world ", size/12)
	tokenList := []byte(`{"tokens":[` + strings.TrimSuffix(strings.Repeat("12345,", len(text)/6), ",") + `],"count":1}`)
	e.fake(1, "m", 1, func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		if r.URL.Path == "/tokenize" {
			w.Header().Set("Content-Length", strconv.Itoa(len(tokenList)))
			_, _ = w.Write(tokenList)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"choices":[{"text":"x"}],"usage":{"completion_tokens":1}}`)
	})
	body, err := json.Marshal(map[string]any{"model": "m", "prompt": text, "max_tokens": 1, "nvext": map[string]any{"extra_fields": []string{"worker_id"}}})
	if err != nil {
		t.Fatal(err)
	}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	var wg sync.WaitGroup
	statuses := make([]int, concurrent)
	for i := range concurrent {
		wg.Go(func() {
			resp, err := http.Post(e.srv.URL+"/v1/completions", "application/json", bytes.NewReader(body))
			if err != nil {
				t.Error(err)
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			statuses[i] = resp.StatusCode
		})
	}
	wg.Wait()
	e.settle()
	runtime.ReadMemStats(&after)
	for i, s := range statuses {
		if s != http.StatusOK {
			t.Fatalf("request %d: status %d", i, s)
		}
	}
	perRequest := float64(after.TotalAlloc-before.TotalAlloc) / concurrent
	t.Logf("allocated %.1f MiB per request of %.1f MiB", perRequest/(1<<20), float64(len(body))/(1<<20))
	if perRequest > 3.5*float64(len(body)) {
		t.Fatalf("allocated %.1f× the body per request, want ≤ 3.5×", perRequest/float64(len(body)))
	}
}

// errorMessage checks an OpenAI error body and returns its message.
func errorMessage(t *testing.T, resp *http.Response, body []byte, status int, code string) string {
	t.Helper()
	if got := openAIError(t, resp, body, status); got != code {
		t.Fatalf("code %q, want %q: %s", got, code, body)
	}
	var e struct {
		Error struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	_ = json.Unmarshal(body, &e)
	return e.Error.Message
}

// okEngine answers every completion at once.
func okEngine(w http.ResponseWriter, r *http.Request) {
	_, _ = io.Copy(io.Discard, r.Body)
	w.Header().Set("Content-Type", "application/json")
	_, _ = io.WriteString(w, `{"choices":[{"text":"x"}]}`)
}

// TestClientGrownStateIsBounded: session ids, session counts and timeouts,
// busy-threshold model names and counts, and router API request ids are
// held by the router for as long as they live, so each is bounded and
// refused with a 4xx beyond its bound.
func TestClientGrownStateIsBounded(t *testing.T) {
	e := newEnv(t, envOpts{router: func(c *router.Config) {
		c.Sessions.MaxSessions = 100
		c.MaxThresholdModels = 4
	}})
	e.fake(1, "m", 1, okEngine)
	for i := range 5 {
		e.add(Worker{ID: uint64(100 + i), Name: "w", BaseURL: "http://127.0.0.1:1", Model: strconv.Itoa(i)})
	}
	huge := strings.Repeat("x", 1<<20)
	session := func(id string, timeout float64) (*http.Response, []byte) {
		return e.post("/v1/completions", map[string]any{"model": "m", "prompt": []int{1, 2, 3},
			"nvext": map[string]any{"session_control": map[string]any{"session_id": id, "action": "open", "timeout": timeout}}})
	}
	resp, body := session(huge, 60)
	if msg := errorMessage(t, resp, body, 400, "invalid_nvext"); !strings.Contains(msg, "session_id is 1048576 bytes long, at most 256") {
		t.Errorf("1 MiB session id: %s", msg)
	}
	resp, body = session("s", 1e9)
	if msg := errorMessage(t, resp, body, 400, "invalid_nvext"); !strings.Contains(msg, "timeout") {
		t.Errorf("timeout 1e9 s: %s", msg)
	}
	for i := range 100 {
		if resp, body := session(strconv.Itoa(i), 60); resp.StatusCode != 200 {
			t.Fatalf("session %d: %d %s", i, resp.StatusCode, body)
		}
	}
	resp, body = session("one-too-many", 60)
	errorMessage(t, resp, body, 429, "too_many_sessions")

	resp, body = e.post("/busy_threshold", map[string]any{"model": huge, "active_prefill_tokens_threshold": 10})
	errorMessage(t, resp, body, 400, "invalid_model")
	for i := range 4 {
		if resp, body := e.post("/busy_threshold", map[string]any{"model": strconv.Itoa(i), "active_prefill_tokens_threshold": 10}); resp.StatusCode != 200 {
			t.Fatalf("model %d: %d %s", i, resp.StatusCode, body)
		}
	}
	resp, body = e.post("/busy_threshold", map[string]any{"model": "4", "active_prefill_tokens_threshold": 10})
	errorMessage(t, resp, body, 400, "too_many_models")
	if _, body := e.get("/busy_threshold"); len(body) > 1024 {
		t.Errorf("GET /busy_threshold answered %d bytes", len(body))
	}

	resp, body = e.post("/router/best_worker", map[string]any{"model": "m", "tokens": []int{1, 2, 3}, "request_id": huge})
	errorMessage(t, resp, body, 400, "invalid_request_id")
	e.settle()
}

// TestConcurrencyLimit: beyond MaxConcurrentRequests a request is answered
// 503 with Retry-After at once, while /health is still answered.
func TestConcurrencyLimit(t *testing.T) {
	e := newEnv(t, envOpts{frontend: func(c *Config) { c.MaxConcurrentRequests = 2 }})
	arrived, release := make(chan struct{}, 2), make(chan struct{})
	e.fake(1, "m", 1, func(w http.ResponseWriter, r *http.Request) {
		arrived <- struct{}{}
		<-release
		okEngine(w, r)
	})
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() {
			if resp, body := e.post("/v1/completions", map[string]any{"model": "m", "prompt": []int{1, 2}}); resp.StatusCode != 200 {
				t.Errorf("admitted request: %d %s", resp.StatusCode, body)
			}
		})
	}
	<-arrived
	<-arrived
	resp, body := e.post("/v1/completions", map[string]any{"model": "m", "prompt": []int{1, 2}})
	errorMessage(t, resp, body, 503, "overloaded")
	if resp.Header.Get("Retry-After") == "" {
		t.Error("503 without Retry-After")
	}
	if resp, body := e.get("/health"); resp.StatusCode != 200 {
		t.Errorf("/health while overloaded: %d %s", resp.StatusCode, body)
	}
	close(release)
	wg.Wait()
	if resp, body := e.post("/v1/completions", map[string]any{"model": "m", "prompt": []int{1, 2}}); resp.StatusCode != 200 {
		t.Errorf("after the load: %d %s", resp.StatusCode, body)
	}
	e.settle()
}

// TestWriteTimeoutSparesSlowAnswers: the write timeout bounds writing a
// response, not waiting for the engine; a stream longer than it completes.
func TestWriteTimeoutSparesSlowAnswers(t *testing.T) {
	const timeout = 100 * time.Millisecond
	e := newEnv(t, envOpts{frontend: func(c *Config) { c.WriteTimeout = timeout }})
	e.fake(1, "m", 1, func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		if r.Header.Get("Accept") == "text/event-stream" {
			w.Header().Set("Content-Type", "text/event-stream")
			for i := range 3 {
				_, _ = io.WriteString(w, `data: {"choices":[{"text":"`+strconv.Itoa(i)+`"}]}`+"\n\n")
				w.(http.Flusher).Flush()
				<-time.After(timeout) // a slow generation, longer than the timeout in all
			}
			_, _ = io.WriteString(w, "data: [DONE]\n\n")
			return
		}
		<-time.After(2 * timeout) // a long non-streamed generation
		okEngine(w, r)
	})
	if resp, body := e.post("/v1/completions", map[string]any{"model": "m", "prompt": []int{1, 2}}); resp.StatusCode != 200 {
		t.Fatalf("slow whole answer: %d %s", resp.StatusCode, body)
	}
	req, _ := http.NewRequest(http.MethodPost, e.srv.URL+"/v1/completions", strings.NewReader(`{"model":"m","prompt":[1,2],"stream":true}`))
	req.Header.Set("Accept", "text/event-stream")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if data := sseData(t, resp.Body); len(data) != 4 || data[3] != "[DONE]" {
		t.Fatalf("stream longer than the write timeout: %q", data)
	}
	e.settle()
}

// TestErrorBodies: every error is OpenAI-shaped with a string code (the
// engine's numeric code included), a wrong method is a 405 naming the
// allowed ones, and messages speak of the request's fields, not of Go's
// types.
func TestErrorBodies(t *testing.T) {
	e := newEnv(t, envOpts{engines: 1})
	e.fake(1, "vllm", 1, func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusBadRequest)
		_, _ = io.WriteString(w, `{"error":{"message":"This model's maximum context length is 8 tokens","type":"BadRequestError","param":null,"code":400}}`)
	})
	for _, tc := range []struct {
		method, path, allow string
	}{{"GET", "/v1/completions", "POST"}, {"DELETE", "/busy_threshold", "GET, HEAD, POST"}, {"POST", "/health", "GET, HEAD"}} {
		req, _ := http.NewRequest(tc.method, e.srv.URL+tc.path, nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		errorMessage(t, resp, body, 405, "method_not_allowed")
		if got := resp.Header.Get("Allow"); got != tc.allow {
			t.Errorf("%s %s: Allow %q, want %q", tc.method, tc.path, got, tc.allow)
		}
	}
	for _, tc := range []struct {
		path, body string
		status     int
		code, want string
	}{
		{"/v1/completions", `{"model":"kvrouter-mock","prompt":[1,2],"max_tokens":"five"}`, 400, "400", "max_tokens must be an integer, got a string"},
		{"/v1/completions", `{"model":"vllm","prompt":[1,2]}`, 400, "400", "maximum context length"},
		{"/v1/completions", `{"model":"kvrouter-mock","prompt":[1,2],"nvext":{"agent_hints":{"osl":"long"}}}`, 400, "invalid_nvext", "nvext.agent_hints.osl must be an integer, got a string"},
		{"/v1/completions", `{"model":"kvrouter-mock","prompt":[1,2],"nvext":{"token_data":[1,-1]}}`, 400, "invalid_nvext", "nvext.token_data must be a list of non-negative integers, got number -1"},
		{"/v1/completions", `{"model":"kvrouter-mock","prompt":[1,2],"nvext":{"router_temperature":-1}}`, 400, "invalid_nvext", "temperature"},
		{"/v1/completions", `{"model":7,"prompt":[1,2]}`, 400, "invalid_model", "model must be a non-empty string"},
		{"/v1/completions", `{"model":"kvrouter-mock","prompt":7}`, 400, "invalid_prompt", "prompt must be a string, a list of strings"},
		{"/v1/chat/completions", `{"model":"kvrouter-mock","messages":{"role":"user"}}`, 400, "invalid_messages", "messages must be a list of messages"},
		{"/v1/completions", `{"model":"kvrouter-mock","prompt":[1,2]`, 400, "invalid_json", "the body must be a JSON object"},
		{"/busy_threshold", `{"model":"m","active_prefill_tokens_threshold":"lots"}`, 400, "invalid_threshold", "active_prefill_tokens_threshold must be an integer, got a string"},
		{"/router/best_worker", `{"model":"kvrouter-mock","tokens":[1],"request_id":5}`, 400, "invalid_request_id", "request_id must be a string"},
	} {
		resp, body := e.post(tc.path, tc.body)
		msg := errorMessage(t, resp, body, tc.status, tc.code)
		if !strings.Contains(msg, tc.want) || strings.Contains(msg, "Go ") || strings.Contains(msg, "json:") || strings.Contains(msg, "sched:") {
			t.Errorf("%s %s: message %q, want it to say %q", tc.path, tc.body, msg, tc.want)
		}
	}
	e.settle()
}

// TestBodyBurst: the end of a burst is reported once, when the last large
// body of at least burstBytes in flight together is done, and not for
// large bodies that never added up to a burst.
func TestBodyBurst(t *testing.T) {
	var b bodyBurst
	const mb = 1 << 20
	b.start(10 * mb)
	if b.end(10 * mb) {
		t.Fatal("10 MiB alone reported as a burst")
	}
	for range 8 {
		b.start(10 * mb)
	}
	for i := range 8 {
		if got := b.end(10 * mb); got != (i == 7) {
			t.Fatalf("end %d of 8 bodies of 80 MiB in flight: %v", i, got)
		}
	}
	b.start(10 * mb)
	if b.end(10 * mb) {
		t.Fatal("the burst was reported twice")
	}
}

// TestInflightBodyBudget: bodies held at once are bounded in total; one
// that would exceed the budget is answered 503 with Retry-After, and once
// the others are done it is admitted.
func TestInflightBodyBudget(t *testing.T) {
	e := newEnv(t, envOpts{frontend: func(c *Config) { c.MaxInflightBodyBytes = 3000 }})
	arrived, release := make(chan struct{}, 1), make(chan struct{})
	e.fake(1, "m", 1, func(w http.ResponseWriter, r *http.Request) {
		arrived <- struct{}{}
		<-release
		okEngine(w, r)
	})
	body := `{"model":"m","prompt":[1,2],"pad":"` + strings.Repeat("x", 2000) + `"}`
	done := make(chan int)
	go func() {
		resp, _ := e.post("/v1/completions", body)
		done <- resp.StatusCode
	}()
	<-arrived
	resp, got := e.post("/v1/completions", body)
	errorMessage(t, resp, got, 503, "overloaded")
	if resp.Header.Get("Retry-After") == "" {
		t.Error("503 without Retry-After")
	}
	close(release)
	if s := <-done; s != 200 {
		t.Fatalf("admitted request: %d", s)
	}
	if resp, got := e.post("/v1/completions", body); resp.StatusCode != 200 {
		t.Fatalf("after the first: %d %s", resp.StatusCode, got)
	}
	e.settle()
}
