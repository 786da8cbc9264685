package server

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/mocker/engine"
	"github.com/kvrouter/kvrouter/mocker/tokenizer"
)

// start runs one engine with the given number of KV blocks behind an
// httptest server on 127.0.0.1.
func start(t *testing.T, blocks int, speedup float64) (*httptest.Server, *Runner) {
	t.Helper()
	return startClocked(t, blocks, speedup, RealClock{})
}

func startClocked(t *testing.T, blocks int, speedup float64, clock Clock) (*httptest.Server, *Runner) {
	t.Helper()
	cfg := DefaultConfig()
	cfg.MaxModelLen = 1 << 20
	return startConfig(t, blocks, speedup, clock, cfg)
}

func startConfig(t *testing.T, blocks int, speedup float64, clock Clock, cfg Config) (*httptest.Server, *Runner) {
	t.Helper()
	ecfg := engine.DefaultConfig()
	ecfg.NumGPUBlocks = blocks
	eng, err := engine.New(ecfg)
	if err != nil {
		t.Fatal(err)
	}
	runner := NewRunner(eng, clock, speedup, nil)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { _ = runner.Run(ctx); close(done) }()
	srv := httptest.NewServer(New(cfg, []*Runner{runner}).Handler())
	t.Cleanup(func() {
		srv.Close()
		cancel()
		<-done
	})
	return srv, runner
}

func post(t *testing.T, url string, body any) (*http.Response, []byte) {
	t.Helper()
	b, _ := json.Marshal(body)
	resp, err := http.Post(url, "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	return resp, out
}

func ids(n, salt int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = 1000 + (i*7+salt*131)%100000
	}
	return out
}

// ttft streams a completion and returns the time to its first data line.
func ttft(t *testing.T, url string, prompt []int) (time.Duration, []string) {
	t.Helper()
	b, _ := json.Marshal(map[string]any{"model": "kvrouter-mock", "prompt": prompt, "max_tokens": 4, "stream": true, "stream_options": map[string]any{"include_usage": true}})
	t0 := time.Now()
	resp, err := http.Post(url+"/v1/completions", "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.Header.Get("Content-Type") != "text/event-stream" {
		t.Fatalf("content type %q", resp.Header.Get("Content-Type"))
	}
	sc := bufio.NewScanner(resp.Body)
	var first time.Duration
	var lines []string
	for sc.Scan() {
		line := sc.Text()
		if line == "" {
			continue
		}
		if first == 0 {
			first = time.Since(t0)
		}
		lines = append(lines, line)
	}
	return first, lines
}

// ttftSum is the engine's total time to first token so far, in simulated
// seconds, from its /metrics.
func ttftSum(t *testing.T, url string) float64 {
	t.Helper()
	resp, err := http.Get(url + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	m := regexp.MustCompile(`(?m)^vllm:time_to_first_token_seconds_sum\{[^}]*\} (\S+)$`).FindSubmatch(body)
	if m == nil {
		t.Fatalf("no TTFT sum in the metrics:\n%s", body)
	}
	sum, err := strconv.ParseFloat(string(m[1]), 64)
	if err != nil {
		t.Fatal(err)
	}
	return sum
}

func TestSharedPrefixHitsTheCacheAndLowersTTFT(t *testing.T) {
	// On a virtual clock TTFT is the model's alone, not the machine's load.
	srv, _ := startClocked(t, 16384, 1, NewVirtualClock(time.Unix(0, 0)))
	shared := ids(4096, 1)
	ttft(t, srv.URL, append(shared, ids(32, 2)...))
	first := ttftSum(t, srv.URL)
	_, lines := ttft(t, srv.URL, append(shared, ids(32, 3)...))
	second := ttftSum(t, srv.URL) - first
	if second >= first/2 {
		t.Fatalf("TTFT with a cached 4096-token prefix %gs, without %gs", second, first)
	}
	var usageChunk struct {
		Usage usage `json:"usage"`
	}
	if err := json.Unmarshal([]byte(strings.TrimPrefix(lines[len(lines)-2], "data: ")), &usageChunk); err != nil {
		t.Fatal(err)
	}
	if usageChunk.Usage.PromptTokensDetails.CachedTokens < 4000 {
		t.Fatalf("usage %+v: the shared prefix was not reported cached", usageChunk.Usage)
	}
	resp, err := http.Get(srv.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(body), "vllm:prefix_cache_hits") || strings.Contains(string(body), "vllm:prefix_cache_hits{engine=\"engine-0\",model_name=\"kvrouter-mock\"} 0\n") {
		t.Fatalf("metrics show no prefix cache hits:\n%s", body)
	}
	for _, name := range []string{"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries", "vllm:time_to_first_token_seconds"} {
		if !strings.Contains(string(body), name) {
			t.Fatalf("metric %s missing", name)
		}
	}
}

func TestStreamingFollowsOpenAISSE(t *testing.T) {
	srv, _ := start(t, 4096, 100)
	_, lines := ttft(t, srv.URL, ids(40, 5))
	if lines[len(lines)-1] != "data: [DONE]" {
		t.Fatalf("stream must end with [DONE]: %q", lines[len(lines)-1])
	}
	var text strings.Builder
	for i, line := range lines[:len(lines)-1] {
		if !strings.HasPrefix(line, "data: {") {
			t.Fatalf("line %d is not a data chunk: %q", i, line)
		}
		var c struct {
			Object  string `json:"object"`
			Choices []struct {
				Text         string  `json:"text"`
				FinishReason *string `json:"finish_reason"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(line[len("data: "):]), &c); err != nil {
			t.Fatalf("chunk %d: %v", i, err)
		}
		if c.Object != "text_completion" {
			t.Fatalf("object %q", c.Object)
		}
		for _, ch := range c.Choices {
			text.WriteString(ch.Text)
		}
	}
	if got := tokenizer.Encode(text.String()); len(got) != 4 {
		t.Fatalf("streamed text %q is not 4 tokens", text.String())
	}

	b, _ := json.Marshal(map[string]any{"messages": []any{map[string]any{"role": "user", "content": "hi"}}, "max_tokens": 3, "stream": true})
	resp, err := http.Post(srv.URL+"/v1/chat/completions", "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	raw, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	chunks := strings.Split(strings.TrimSpace(string(raw)), "\n\n")
	if len(chunks) != 4 || chunks[3] != "data: [DONE]" || !strings.Contains(chunks[0], `"role":"assistant"`) || !strings.Contains(chunks[0], "chat.completion.chunk") {
		t.Fatalf("chat stream:\n%s", raw)
	}
}

func TestNonStreamingCompletionAndChat(t *testing.T) {
	srv, _ := start(t, 4096, 100)
	resp, body := post(t, srv.URL+"/v1/completions", map[string]any{"model": "kvrouter-mock", "prompt": "Once upon a time", "max_tokens": 5})
	var c struct {
		Object  string `json:"object"`
		Choices []struct {
			Text         string `json:"text"`
			FinishReason string `json:"finish_reason"`
		} `json:"choices"`
		Usage usage `json:"usage"`
	}
	if err := json.Unmarshal(body, &c); err != nil || resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	if c.Object != "text_completion" || c.Usage.CompletionTokens != 5 || c.Usage.PromptTokens != len(tokenizer.Encode("Once upon a time")) || c.Choices[0].FinishReason != "length" {
		t.Fatalf("completion %s", body)
	}
	_, body = post(t, srv.URL+"/v1/chat/completions", map[string]any{"messages": []any{map[string]any{"role": "user", "content": []any{map[string]any{"type": "text", "text": "hello"}}}}, "max_completion_tokens": 2})
	if !strings.Contains(string(body), `"object":"chat.completion"`) || !strings.Contains(string(body), `"role":"assistant"`) {
		t.Fatalf("chat %s", body)
	}
	_, body = post(t, srv.URL+"/tokenize", map[string]any{"prompt": "Once upon a time"})
	var tk struct {
		Count  int      `json:"count"`
		Tokens []uint32 `json:"tokens"`
	}
	if json.Unmarshal(body, &tk); tk.Count != len(tokenizer.Encode("Once upon a time")) {
		t.Fatalf("tokenize %s", body)
	}
	r, err := http.Get(srv.URL + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	models, _ := io.ReadAll(r.Body)
	r.Body.Close()
	if !strings.Contains(string(models), `"id":"kvrouter-mock"`) {
		t.Fatalf("models %s", models)
	}
}

func TestBadInputGetsOpenAIErrors(t *testing.T) {
	srv, _ := start(t, 64, 100) // 64 blocks × 16 tokens of KV
	huge := strings.Repeat("x", 17<<20)
	tests := []struct {
		name   string
		path   string
		body   string
		status int
		msg    string
	}{
		{"malformed json", "/v1/completions", `{"prompt": "hi"`, 400, "not valid JSON"},
		{"unknown model", "/v1/completions", `{"model": "gpt-9", "prompt": "hi"}`, 404, "does not exist"},
		{"missing prompt", "/v1/completions", `{"max_tokens": 3}`, 400, "prompt is required"},
		{"empty prompt", "/v1/completions", `{"prompt": []}`, 400, "must not be empty"},
		{"negative max_tokens", "/v1/completions", `{"prompt": "hi", "max_tokens": -5}`, 400, "max_tokens"},
		{"max_tokens of the wrong type", "/v1/completions", `{"prompt": "hi", "max_tokens": "5"}`, 400, "max_tokens must be an integer, got a string"},
		{"absurd max_tokens", "/v1/completions", `{"prompt": "hi", "max_tokens": 100000000}`, 400, "maximum context length"},
		{"prompt beyond KV capacity", "/v1/completions", fmt.Sprintf(`{"prompt": %s}`, mustJSON(ids(2000, 1))), 400, ""},
		{"token outside vocabulary", "/v1/completions", `{"prompt": [1, 999999999]}`, 400, "outside the vocabulary"},
		{"batched prompts", "/v1/completions", `{"prompt": ["a", "b"]}`, 400, "batched"},
		{"n > 1", "/v1/completions", `{"prompt": "a", "n": 3}`, 400, "n must be 1"},
		{"chat without messages", "/v1/chat/completions", `{"messages": []}`, 400, "messages"},
		{"chat image part", "/v1/chat/completions", `{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}`, 400, "without its data"},
		{"chat unknown part", "/v1/chat/completions", `{"messages": [{"role": "user", "content": [{"type": "hologram"}]}]}`, 400, "not supported"},
		{"body too large", "/v1/completions", `{"prompt": "` + huge + `"}`, 413, "larger than"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			resp, err := http.Post(srv.URL+tc.path, "application/json", strings.NewReader(tc.body))
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			var e apiError
			if resp.StatusCode != tc.status || json.Unmarshal(body, &e) != nil || e.Error.Code != tc.status || !strings.Contains(e.Error.Message, tc.msg) {
				t.Fatalf("got %d %s, want %d with %q", resp.StatusCode, body, tc.status, tc.msg)
			}
		})
	}
}

func mustJSON(v any) string {
	b, _ := json.Marshal(v)
	return string(b)
}

func TestBurstBeyondCapacityQueuesPreemptsAndLosesNothing(t *testing.T) {
	srv, runner := start(t, 96, 200) // room for about four of the requests at once
	var wg sync.WaitGroup
	errs := make(chan error, 24)
	for i := range 24 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, body := post(t, srv.URL+"/v1/completions", map[string]any{"prompt": ids(200, 10+i), "max_tokens": 120})
			var c struct {
				Usage usage `json:"usage"`
			}
			if resp.StatusCode != 200 || json.Unmarshal(body, &c) != nil || c.Usage.CompletionTokens != 120 {
				errs <- fmt.Errorf("request %d: %d %s", i, resp.StatusCode, body)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if m := runner.Metrics(); m.Preemptions == 0 || m.Running != 0 || m.Waiting != 0 {
		t.Fatalf("metrics after the burst: %+v (expected preemptions and an empty engine)", m)
	}
}

func TestClientDisconnectAbortsTheRequest(t *testing.T) {
	srv, runner := start(t, 4096, 1)
	ctx, cancel := context.WithCancel(context.Background())
	b, _ := json.Marshal(map[string]any{"prompt": ids(64, 1), "max_tokens": 100000, "stream": true})
	req, _ := http.NewRequestWithContext(ctx, "POST", srv.URL+"/v1/completions", bytes.NewReader(b))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(resp.Body)
	if _, err := br.ReadString('\n'); err != nil { // the first token arrived
		t.Fatal(err)
	}
	cancel()
	resp.Body.Close()
	deadline := time.Now().Add(5 * time.Second)
	for runner.Load() != 0 {
		if time.Now().After(deadline) {
			t.Fatal("the request kept running after its client left")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestVirtualClockKeepsTheModelsPaceExactly(t *testing.T) {
	eng, err := engine.New(engine.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	runner := NewRunner(eng, NewVirtualClock(time.Unix(0, 0)), 10, nil)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() { _ = runner.Run(ctx) }()
	s, err := runner.Submit(engine.Request{ID: "a", Tokens: make([]uint32, 3000), MaxTokens: 50})
	if err != nil {
		t.Fatal(err)
	}
	for {
		_, finished, err := s.Next(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if finished {
			break
		}
	}
	tm := runner.Timing()
	if tm.Steps < 50 || tm.Drift() != 0 {
		t.Fatalf("virtual time must follow the model exactly: %+v drift %v", tm, tm.Drift())
	}
	if got := s.DoneAt.Sub(s.Submitted); got != tm.Model {
		t.Fatalf("request took %v of virtual time, model says %v", got, tm.Model)
	}
}
