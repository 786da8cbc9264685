package frontend

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
)

type respNvext struct {
	WorkerID      *uint64 `json:"worker_id"`
	DPRank        *uint32 `json:"dp_rank"`
	OverlapBlocks *int    `json:"overlap_blocks"`
	PromptBlocks  *int    `json:"prompt_blocks"`
	Timing        *struct {
		ReadMS     *float64 `json:"read_ms"`
		FrontendMS *float64 `json:"frontend_ms"`
		RoutingMS  *float64 `json:"routing_ms"`
		TTFTMS     *float64 `json:"ttft_ms"`
		TotalMS    *float64 `json:"total_ms"`
	} `json:"timing"`
}

func nvextOf(t *testing.T, body []byte) *respNvext {
	t.Helper()
	var v struct {
		Nvext *respNvext `json:"nvext"`
	}
	if err := json.Unmarshal(body, &v); err != nil {
		t.Fatalf("not JSON: %v: %s", err, body)
	}
	return v.Nvext
}

var extra = map[string]any{"extra_fields": []string{"worker_id", "timing"}}

// read_ms is the part of frontend_ms spent reading the client's body: a
// client that pauses halfway through sending it shows up there, and not
// as the frontend's own work.
func TestTimingSeparatesReadingTheBody(t *testing.T) {
	e := newEnv(t, envOpts{engines: 1})
	body, _ := json.Marshal(map[string]any{"model": mockModel, "prompt": tokens(64, 1), "max_tokens": 2, "nvext": extra})
	// The handler's clock starts when it is called, which a loaded machine
	// can delay past the start of the pause: half the pause is what the
	// server must see at least, and it can only see it if it times reading.
	const pause = 200 * time.Millisecond
	pr, pw := io.Pipe()
	go func() {
		_, _ = pw.Write(body[:len(body)/2])
		time.Sleep(pause) // the client's own slowness, the thing measured
		_, _ = pw.Write(body[len(body)/2:])
		_ = pw.Close()
	}()
	req, err := http.NewRequest(http.MethodPost, e.srv.URL+"/v1/completions", pr)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	got, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	nv := nvextOf(t, got)
	if resp.StatusCode != 200 || nv == nil || nv.Timing == nil || nv.Timing.ReadMS == nil || nv.Timing.FrontendMS == nil {
		t.Fatalf("%d, no timing: %s", resp.StatusCode, got)
	}
	read, held := *nv.Timing.ReadMS, *nv.Timing.FrontendMS
	if read < float64(pause.Milliseconds())/2 || read > held {
		t.Fatalf("read_ms %v, frontend_ms %v, the client paused %v while sending", read, held, pause)
	}
}

// An engine's KV event says worker 11 holds the prompt's first 4 blocks:
// a request continuing it goes there, and extra_fields says so.
func TestCompletionFollowsInjectedEvent(t *testing.T) {
	e := newEnv(t, envOpts{engines: 2})
	prefix := tokens(64, 1)
	err := e.router.ApplyEngineStored(&router.EngineStored{
		Worker: kv.Worker{ID: 11}, EngineHashes: []uint64{1, 2, 3, 4}, Tokens: prefix, BlockSize: 16,
	})
	if err != nil {
		t.Fatal(err)
	}
	for i := range 4 {
		prompt := append(append([]uint32(nil), prefix...), tokens(32, 100+i)...)
		resp, body := e.post("/v1/completions", map[string]any{"model": mockModel, "prompt": prompt, "max_tokens": 3, "nvext": extra})
		if resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
		nv := nvextOf(t, body)
		if nv == nil || *nv.WorkerID != 11 || *nv.DPRank != 0 || *nv.OverlapBlocks != 4 || *nv.PromptBlocks != 6 {
			t.Fatalf("nvext %+v: %s", nv, body)
		}
		if nv.Timing == nil || nv.Timing.RoutingMS == nil || nv.Timing.TTFTMS == nil || nv.Timing.TotalMS == nil {
			t.Fatalf("timing missing: %s", body)
		}
		var c struct {
			Object  string `json:"object"`
			Choices []struct {
				Text string `json:"text"`
			} `json:"choices"`
		}
		if json.Unmarshal(body, &c); c.Object != "text_completion" || len(c.Choices) != 1 {
			t.Fatalf("engine answer changed: %s", body)
		}
		e.settle()
	}
}

// Chat conversations are tokenized by the engine (chat template included)
// and, through predict-on-route, each follow-up turn lands where the
// conversation went first.
func TestChatSharedPrefixSameWorker(t *testing.T) {
	e := newEnv(t, envOpts{engines: 2})
	system := strings.Repeat("you are a careful assistant who answers briefly and precisely ", 8)
	for conv := range 6 {
		msgs := []map[string]any{
			{"role": "system", "content": fmt.Sprintf("conversation %d: %s", conv, system)},
			{"role": "user", "content": "first question about the weather"},
		}
		var home uint64
		for turn := range 3 {
			resp, body := e.post("/v1/chat/completions", map[string]any{"model": mockModel, "messages": msgs, "max_tokens": 2, "nvext": extra})
			if resp.StatusCode != 200 {
				t.Fatalf("%d %s", resp.StatusCode, body)
			}
			nv := nvextOf(t, body)
			if nv == nil || nv.WorkerID == nil {
				t.Fatalf("no worker in %s", body)
			}
			if turn == 0 {
				home = *nv.WorkerID
			} else {
				if *nv.WorkerID != home {
					t.Fatalf("conversation %d turn %d went to %d, first turn to %d", conv, turn, *nv.WorkerID, home)
				}
				if *nv.OverlapBlocks == 0 {
					t.Fatalf("turn %d: no overlap: %+v", turn, nv)
				}
			}
			msgs = append(msgs, map[string]any{"role": "assistant", "content": "answer"}, map[string]any{"role": "user", "content": fmt.Sprintf("follow-up %d", turn)})
			e.settle()
		}
	}
}

func TestStreamingChatExtraFieldsInFirstChunk(t *testing.T) {
	e := newEnv(t, envOpts{engines: 2})
	for _, withExtra := range []bool{true, false} {
		req := map[string]any{"model": mockModel, "stream": true, "max_tokens": 5,
			"messages": []map[string]any{{"role": "user", "content": "hello there"}}}
		if withExtra {
			req["nvext"] = extra
		}
		b, _ := json.Marshal(req)
		resp, err := http.Post(e.srv.URL+"/v1/chat/completions", "application/json", strings.NewReader(string(b)))
		if err != nil {
			t.Fatal(err)
		}
		if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
			t.Fatalf("content type %q", ct)
		}
		data := sseData(t, resp.Body)
		resp.Body.Close()
		if len(data) != 6 || data[len(data)-1] != "[DONE]" {
			t.Fatalf("chunks %q", data)
		}
		for i, d := range data[:len(data)-1] {
			nv := nvextOf(t, []byte(d))
			switch {
			case withExtra && i == 0:
				if nv == nil || nv.WorkerID == nil || (*nv.WorkerID != 10 && *nv.WorkerID != 11) || nv.Timing == nil || nv.Timing.TTFTMS == nil || nv.Timing.TotalMS != nil {
					t.Fatalf("first chunk %s", d)
				}
			case nv != nil:
				t.Fatalf("chunk %d has nvext: %s", i, d)
			}
		}
		e.settle()
	}
	if got := e.counter(mockModel, "chat_completions", "200"); got != 2 {
		t.Fatalf("requests_total{200} = %v", got)
	}
}

// A client that leaves mid-stream frees its load, and the engine's stream
// is dropped.
func TestClientDisconnectFreesLoad(t *testing.T) {
	e := newEnv(t, envOpts{engines: 2})
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			b, _ := json.Marshal(map[string]any{"model": mockModel, "prompt": tokens(100, i), "max_tokens": 30000, "stream": true})
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, e.srv.URL+"/v1/completions", strings.NewReader(string(b)))
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Error(err)
				return
			}
			defer resp.Body.Close()
			br := bufio.NewReader(resp.Body)
			for range 3 { // a few chunks, then leave
				line, err := br.ReadString('\n')
				if err != nil {
					t.Errorf("read: %v (status %d)", err, resp.StatusCode)
					return
				}
				if strings.HasPrefix(line, "data: [DONE]") {
					t.Error("stream ended early")
					return
				}
			}
			cancel()
		}()
	}
	wg.Wait()
	e.settle()
	if got := e.counter(mockModel, "completions", "cancelled"); got != 8 {
		t.Fatalf("cancelled = %v", got)
	}
}

// Engines that break their streams: the client gets one error event, then
// [DONE], and the load goes back.
func TestBrokenEngineStreams(t *testing.T) {
	chunk := "data: {\"id\":\"x\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\n"
	cases := []struct {
		name   string
		pieces []string
		end    string
	}{
		{"dies mid-stream", []string{chunk, chunk}, "abort"},
		{"dies mid-event", []string{chunk, "data: {\"id\":"}, "abort"},
		{"data not JSON", []string{chunk, "data: {not json\n\n", chunk, "data: [DONE]\n\n"}, ""},
		{"not SSE", []string{chunk, "HTTP/1.1 200 OK garbage\n\n"}, ""},
		{"ends before DONE", []string{chunk, chunk}, ""},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, envOpts{})
			e.fake(uint64(50+i), "fake", 1, sseHandler(tc.pieces, tc.end))
			resp, body := e.post("/v1/completions", map[string]any{"model": "fake", "prompt": tokens(40, i), "stream": true})
			if resp.StatusCode != 200 {
				t.Fatalf("%d %s", resp.StatusCode, body)
			}
			data := sseData(t, strings.NewReader(string(body)))
			if len(data) < 2 || data[len(data)-1] != "[DONE]" {
				t.Fatalf("the stream does not end with [DONE]: %q", body)
			}
			data = data[:len(data)-1]
			last := data[len(data)-1]
			var ev struct {
				Error *apiError `json:"error"`
			}
			if err := json.Unmarshal([]byte(last), &ev); err != nil || ev.Error == nil || ev.Error.Code != "engine_stream_error" || ev.Error.Message == "" {
				t.Fatalf("last event %q", last)
			}
			for _, d := range data[:len(data)-1] {
				if d != strings.TrimSuffix(strings.TrimPrefix(chunk, "data: "), "\n\n") {
					t.Fatalf("unexpected event %q in %q", d, body)
				}
			}
			e.settle()
			if got := e.counter("fake", "completions", "stream_error"); got != 1 {
				t.Fatalf("stream_error = %v", got)
			}
		})
	}
}

// Engines that break their streams before the first event have shown the
// client nothing: it gets the frontend's 502, not an empty stream.
func TestStreamsBrokenBeforeTheirFirstEvent(t *testing.T) {
	for i, tc := range []struct {
		name   string
		pieces []string
		end    string
	}{
		{"no chunk at all", nil, "abort"},
		{"closed at once", nil, ""},
		{"data not JSON", []string{"data: {not json\n\n"}, ""},
		{"not SSE", []string{"HTTP/1.1 200 OK garbage\n\n"}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, envOpts{})
			e.fake(uint64(70+i), "fake", 1, sseHandler(tc.pieces, tc.end))
			resp, body := e.post("/v1/completions", map[string]any{"model": "fake", "prompt": tokens(40, i), "stream": true})
			if resp.StatusCode != http.StatusBadGateway || !strings.Contains(string(body), `"engine_unreachable"`) {
				t.Fatalf("%d %s", resp.StatusCode, body)
			}
			e.settle()
		})
	}
}

// The engine's errors and bytes pass through unchanged.
func TestEngineAnswersPassThrough(t *testing.T) {
	e := newEnv(t, envOpts{})
	e.fake(60, "err", 1, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("X-Engine", "yes")
		w.WriteHeader(http.StatusBadRequest)
		_, _ = io.WriteString(w, `{"error": {"message": "max_tokens too large", "type": "BadRequestError", "param": null, "code": 400}}`)
	})
	exact := `{"id":  "c1", "object":"text_completion",  "choices":[{"text":"x"}]}` + "\n"
	e.fake(61, "ok", 1, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json; charset=utf-8")
		w.Header().Set("X-Engine", "yes")
		_, _ = io.WriteString(w, exact)
	})
	resp, body := e.post("/v1/completions", map[string]any{"model": "err", "prompt": []int{1, 2, 3}})
	if resp.StatusCode != 400 || resp.Header.Get("X-Engine") != "yes" || !strings.Contains(string(body), "max_tokens too large") {
		t.Fatalf("%d %v %s", resp.StatusCode, resp.Header, body)
	}
	resp, body = e.post("/v1/completions", map[string]any{"model": "ok", "prompt": []int{1, 2, 3}})
	if resp.StatusCode != 200 || string(body) != exact || resp.Header.Get("Content-Type") != "application/json; charset=utf-8" {
		t.Fatalf("%d %v %q", resp.StatusCode, resp.Header, body)
	}
	resp, body = e.post("/v1/completions", map[string]any{"model": "ok", "prompt": []int{1, 2, 3}, "nvext": map[string]any{"extra_fields": []string{"worker_id"}}})
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	if want := `{"id":  "c1", "object":"text_completion",  "choices":[{"text":"x"}],"nvext":{"worker_id":61,"dp_rank":0,"overlap_blocks":0,"prompt_blocks":0}}` + "\n"; string(body) != want {
		t.Fatalf("got %s\nwant %s", body, want)
	}
	e.settle()
}

// nvext is dropped from what the engine sees, data_parallel_rank is set
// for a multi-rank worker, and a plain body is forwarded byte for byte.
func TestForwardedBody(t *testing.T) {
	e := newEnv(t, envOpts{})
	var mu sync.Mutex
	var seen [][]byte
	capture := func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		seen = append(seen, b)
		mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"object":"text_completion","choices":[]}`)
	}
	e.fake(70, "dp", 4, capture)
	e.fake(71, "single", 1, capture)

	resp, body := e.post("/v1/completions", `{"model":"dp","prompt":[5,6,7],"temperature":0.5,"data_parallel_rank":0,"nvext":{"backend_instance_id":70,"dp_rank":3,"extra_fields":["worker_id"]}}`)
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	if nv := nvextOf(t, body); nv == nil || *nv.WorkerID != 70 || *nv.DPRank != 3 {
		t.Fatalf("%s", body)
	}
	raw := `{"model": "single", "prompt": [5, 6, 7],   "max_tokens": 2}`
	if resp, body := e.post("/v1/completions", raw); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	e.settle()
	var got map[string]any
	if err := json.Unmarshal(seen[0], &got); err != nil {
		t.Fatal(err)
	}
	if _, ok := got["nvext"]; ok || got["data_parallel_rank"] != 3.0 || got["temperature"] != 0.5 || got["model"] != "dp" {
		t.Fatalf("forwarded %s", seen[0])
	}
	if string(seen[1]) != raw {
		t.Fatalf("forwarded %q, sent %q", seen[1], raw)
	}
}

func TestEngineUnreachable(t *testing.T) {
	e := newEnv(t, envOpts{})
	e.add(Worker{ID: 80, Name: "gone", BaseURL: closedURL(t), Model: "gone"})
	resp, body := e.post("/v1/completions", map[string]any{"model": "gone", "prompt": []int{1, 2, 3}, "stream": true})
	if code := openAIError(t, resp, body, http.StatusBadGateway); code != "engine_unreachable" {
		t.Fatalf("code %q", code)
	}
	// Text needs the engine's tokenizer: unreachable too.
	resp, body = e.post("/v1/completions", map[string]any{"model": "gone", "prompt": "some text"})
	if code := openAIError(t, resp, body, http.StatusBadGateway); code != "tokenization_failed" {
		t.Fatalf("code %q", code)
	}
	e.settle()
}

func TestOpenAIErrors(t *testing.T) {
	e := newEnv(t, envOpts{engines: 1, maxBody: 4096})
	cases := []struct {
		path, body string
		status     int
		code       string
	}{
		{"/v1/completions", `{"model": "kvrouter-mock", "prompt": [1, 2`, 400, "invalid_json"},
		{"/v1/completions", `[1, 2]`, 400, "invalid_json"},
		{"/v1/completions", `{"prompt": [1, 2]}`, 400, "missing_model"},
		{"/v1/completions", `{"model": "kvrouter-mock"}`, 400, "missing_prompt"},
		{"/v1/chat/completions", `{"model": "kvrouter-mock", "prompt": "x"}`, 400, "missing_messages"},
		{"/v1/chat/completions", `{"model": "kvrouter-mock", "messages": []}`, 400, "invalid_messages"},
		{"/v1/completions", `{"model": "kvrouter-mock", "prompt": [1, -2]}`, 400, "invalid_tokens"},
		{"/v1/completions", `{"model": "kvrouter-mock", "prompt": [1], "nvext": {"dp_rank": 1}}`, 400, "invalid_nvext"},
		{"/v1/completions", `{"model": "kvrouter-mock", "prompt": [1], "nvext": {"session_control": {"session_id": "s", "action": "nope"}}}`, 400, "invalid_nvext"},
		{"/v1/completions", `{"model": "kvrouter-mock", "prompt": [1], "nvext": {"router_temperature": -1}}`, 400, "invalid_nvext"},
		{"/v1/completions", `{"model": "kvrouter-mock", "prompt": [1], "nvext": {"backend_instance_id": 99}}`, 400, "unknown_worker"},
		{"/v1/chat/completions", `{"model": "kvrouter-mock", "messages": [{"content": "no role"}]}`, 400, "tokenization_failed"},
		{"/v1/completions", `{"model": "nope", "prompt": [1, 2]}`, 404, "model_not_found"},
		{"/v1/completions", `{"model": "kvrouter-mock", "prompt": "` + strings.Repeat("x", 5000) + `"}`, 413, "request_too_large"},
	}
	for _, tc := range cases {
		resp, body := e.post(tc.path, tc.body)
		if code := openAIError(t, resp, body, tc.status); code != tc.code {
			t.Errorf("%s %.60s: code %q, want %q (%s)", tc.path, tc.body, code, tc.code, body)
		}
	}
	e.settle()
	if got := e.counter("", "completions", "404"); got != 1 {
		t.Fatalf("requests_total{404} = %v", got)
	}
}

func TestNoWorkers(t *testing.T) {
	e := newEnv(t, envOpts{})
	resp, body := e.post("/v1/completions", map[string]any{"model": mockModel, "prompt": []int{1}})
	if code := openAIError(t, resp, body, http.StatusServiceUnavailable); code != "no_workers" {
		t.Fatal(code)
	}
	if resp, body := e.get("/health"); resp.StatusCode != 503 || !strings.Contains(string(body), `"unavailable"`) {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
}

// Every worker over the busy threshold (set through the API) → 503; once
// the bookings are freed the same request is served.
func TestAllBusy(t *testing.T) {
	e := newEnv(t, envOpts{engines: 2})
	resp, body := e.post("/busy_threshold", map[string]any{"model": mockModel, "active_prefill_tokens_threshold": 0})
	if resp.StatusCode != 200 || !strings.Contains(string(body), `"active_prefill_tokens_threshold":0`) {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	for _, id := range []uint64{10, 11} {
		resp, body := e.post("/router/best_worker", map[string]any{"model": mockModel, "tokens": tokens(32, int(id)), "request_id": fmt.Sprint("hold-", id), "nvext": map[string]any{"backend_instance_id": id}})
		var bw bestWorkerResponse
		if json.Unmarshal(body, &bw); resp.StatusCode != 200 || bw.WorkerID != id || bw.RequestID == "" {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
	}
	req := map[string]any{"model": mockModel, "prompt": tokens(32, 3), "max_tokens": 2}
	resp, body = e.post("/v1/completions", req)
	if code := openAIError(t, resp, body, http.StatusServiceUnavailable); code != "all_workers_busy" {
		t.Fatal(code)
	}
	for _, id := range []string{"hold-10", "hold-11"} {
		if resp, body := e.post("/router/free", map[string]any{"request_id": id}); resp.StatusCode != 200 || !strings.Contains(string(body), `"found":true`) {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
	}
	if resp, body := e.post("/v1/completions", req); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	e.settle()
}
