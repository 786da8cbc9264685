package frontend

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/openai/openai-go"
	"github.com/openai/openai-go/option"

	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/core/sched"
	"github.com/kvrouter/kvrouter/internal/testwait"
)

func oaiClient(e *env, opts ...option.RequestOption) openai.Client {
	return openai.NewClient(append([]option.RequestOption{
		option.WithBaseURL(e.srv.URL + "/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0),
	}, opts...)...)
}

// The official OpenAI Go client drives the frontend: chat streaming,
// completions, extra fields, models and errors.
func TestOpenAIGoClient(t *testing.T) {
	e := newEnv(t, envOpts{engines: 2})
	ctx := context.Background()
	c := oaiClient(e)

	stream := c.Chat.Completions.NewStreaming(ctx, openai.ChatCompletionNewParams{
		Model:     mockModel,
		Messages:  []openai.ChatCompletionMessageParamUnion{openai.SystemMessage("be brief"), openai.UserMessage("tell me about caches")},
		MaxTokens: openai.Int(6),
	})
	var acc openai.ChatCompletionAccumulator
	n := 0
	for stream.Next() {
		acc.AddChunk(stream.Current())
		n++
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if n != 6 || len(acc.Choices) != 1 || acc.Choices[0].Message.Content == "" {
		t.Fatalf("%d chunks, %+v", n, acc.ChatCompletion)
	}

	comp, err := c.Completions.New(ctx, openai.CompletionNewParams{
		Model:     openai.CompletionNewParamsModel(mockModel),
		Prompt:    openai.CompletionNewParamsPromptUnion{OfString: openai.String("the quick brown fox jumps over the lazy dog")},
		MaxTokens: openai.Int(4),
	}, option.WithJSONSet("nvext", map[string]any{"extra_fields": []string{"worker_id"}}))
	if err != nil {
		t.Fatal(err)
	}
	if len(comp.Choices) != 1 || comp.Usage.CompletionTokens != 4 {
		t.Fatalf("%+v", comp)
	}
	nv, ok := comp.JSON.ExtraFields["nvext"]
	if !ok || !strings.Contains(nv.Raw(), `"worker_id":1`) {
		t.Fatalf("nvext %q", nv.Raw())
	}

	tokStream := c.Completions.NewStreaming(ctx, openai.CompletionNewParams{
		Model:     openai.CompletionNewParamsModel(mockModel),
		Prompt:    openai.CompletionNewParamsPromptUnion{OfArrayOfTokens: []int64{1001, 1002, 1003, 1004}},
		MaxTokens: openai.Int(3),
	})
	n = 0
	for tokStream.Next() {
		n++
	}
	if tokStream.Err() != nil || n != 3 {
		t.Fatalf("%d chunks, %v", n, tokStream.Err())
	}

	models, err := c.Models.List(ctx)
	if err != nil || len(models.Data) != 1 || models.Data[0].ID != mockModel {
		t.Fatalf("%+v %v", models, err)
	}

	_, err = c.Completions.New(ctx, openai.CompletionNewParams{
		Model:  openai.CompletionNewParamsModel("no-such-model"),
		Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String("x")},
	})
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != 404 || apiErr.Code != "model_not_found" {
		t.Fatalf("%v", err)
	}
	e.settle()
}

// Concurrent streams, some abandoned early: every booking is freed.
func TestConcurrentStreams(t *testing.T) {
	e := newEnv(t, envOpts{engines: 2, dp: 2})
	c := oaiClient(e)
	var wg sync.WaitGroup
	for i := range 24 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			s := c.Completions.NewStreaming(ctx, openai.CompletionNewParams{
				Model:     openai.CompletionNewParamsModel(mockModel),
				Prompt:    openai.CompletionNewParamsPromptUnion{OfArrayOfTokens: toInt64(tokens(64+i, i%4))},
				MaxTokens: openai.Int(int64(8 + i)),
			})
			n := 0
			for s.Next() {
				n++
				if i%3 == 0 && n == 2 {
					cancel()
					break
				}
			}
			if i%3 != 0 && (s.Err() != nil || n != 8+i) {
				t.Errorf("stream %d: %d chunks, %v", i, n, s.Err())
			}
			s.Close()
		}()
	}
	wg.Wait()
	e.settle()
	for _, l := range e.router.Loads() {
		if l.Worker.DPRank > 1 {
			t.Fatalf("rank %v", l.Worker)
		}
	}
}

func toInt64(ids []uint32) []int64 {
	out := make([]int64, len(ids))
	for i, id := range ids {
		out[i] = int64(id)
	}
	return out
}

// A session pins its requests to the worker the open went to.
func TestSessionControl(t *testing.T) {
	e := newEnv(t, envOpts{engines: 2})
	var home uint64
	for i, action := range []string{"open", "", "", "close"} {
		nv := map[string]any{"extra_fields": []string{"worker_id"}, "session_control": map[string]any{"session_id": "s1", "action": action, "timeout": 60}}
		resp, body := e.post("/v1/completions", map[string]any{"model": mockModel, "prompt": tokens(48, 10+i), "max_tokens": 2, "nvext": nv})
		if resp.StatusCode != 200 {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
		got := *nvextOf(t, body).WorkerID
		if i == 0 {
			home = got
		} else if got != home {
			t.Fatalf("request %d went to %d, session is on %d", i, got, home)
		}
		e.settle()
	}
}

func TestRouterAPI(t *testing.T) {
	e := newEnv(t, envOpts{engines: 2})
	prefix := tokens(48, 7)
	if err := e.router.ApplyEngineStored(&router.EngineStored{Worker: kv.Worker{ID: 10}, EngineHashes: []uint64{7, 8, 9}, Tokens: prefix, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	query := append(append([]uint32(nil), prefix...), tokens(16, 8)...)

	// Query only: where it would go, nothing booked.
	resp, body := e.post("/router/best_worker", map[string]any{"tokens": query, "model": mockModel})
	var bw bestWorkerResponse
	if err := json.Unmarshal(body, &bw); err != nil || resp.StatusCode != 200 || bw.WorkerID != 10 || bw.OverlapBlocks != 3 || bw.PromptBlocks != 4 || bw.RequestID != "" || bw.Timing == nil {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	e.settle()

	// Booked under an id: its load shows in potential_loads until freed.
	resp, body = e.post("/router/best_worker", map[string]any{"tokens": query, "request_id": "r1"})
	if json.Unmarshal(body, &bw); resp.StatusCode != 200 || bw.RequestID != "r1" || bw.WorkerID != 10 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	resp, body = e.post("/router/best_worker", map[string]any{"tokens": query, "request_id": "r1"})
	if code := openAIError(t, resp, body, http.StatusConflict); code != "duplicate_request_id" {
		t.Fatal(code)
	}
	loads := func() map[uint64]potentialLoad {
		t.Helper()
		resp, body := e.post("/router/potential_loads", map[string]any{"tokens": query, "model": mockModel})
		var pl []potentialLoad
		if err := json.Unmarshal(body, &pl); err != nil || resp.StatusCode != 200 || len(pl) != 2 {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
		out := map[uint64]potentialLoad{}
		for _, l := range pl {
			out[l.WorkerID] = l
		}
		return out
	}
	pl := loads()
	if pl[10].ActiveRequests != 1 || pl[10].ActivePrefillTokens == 0 || pl[10].OverlapBlocks < 3 || pl[11].ActiveRequests != 0 {
		t.Fatalf("%+v", pl)
	}
	for _, step := range []struct {
		path  string
		found bool
	}{
		{"/router/mark_prefill_complete", true},
		{"/router/free", true},
		{"/router/free", false},
		{"/router/mark_prefill_complete", false},
	} {
		resp, body := e.post(step.path, map[string]any{"request_id": "r1"})
		if resp.StatusCode != 200 || !strings.Contains(string(body), fmt.Sprintf(`"found":%v`, step.found)) {
			t.Fatalf("%s: %d %s", step.path, resp.StatusCode, body)
		}
	}
	if pl := loads(); pl[10].ActiveRequests != 0 {
		t.Fatalf("%+v", pl)
	}
	resp, body = e.post("/router/free", `{}`)
	if code := openAIError(t, resp, body, 400); code != "missing_request_id" {
		t.Fatal(code)
	}

	// Text and chat are tokenized by an engine.
	for _, q := range []map[string]any{
		{"model": mockModel, "prompt": "hello world of routers"},
		{"model": mockModel, "messages": []map[string]any{{"role": "user", "content": "hi"}}},
	} {
		resp, body := e.post("/router/best_worker", q)
		if resp.StatusCode != 200 || !strings.Contains(string(body), `"worker_id"`) {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
	}
	resp, body = e.post("/router/best_worker", map[string]any{"model": mockModel})
	if code := openAIError(t, resp, body, 400); code != "missing_prompt" {
		t.Fatal(code)
	}
	resp, body = e.post("/router/best_worker", map[string]any{"model": "other", "tokens": []int{1}})
	if code := openAIError(t, resp, body, 404); code != "model_not_found" {
		t.Fatal(code)
	}

	// The dump rebuilds the index: the three stored blocks are in it.
	resp, body = e.get("/router/dump_events")
	var evs []kv.Event
	if err := json.Unmarshal(body, &evs); err != nil || resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	blocks := 0
	for _, ev := range evs {
		if ev.Worker.ID == 10 {
			blocks += len(ev.Stored.Blocks)
		}
	}
	if blocks != 3 {
		t.Fatalf("dump %s", body)
	}
	e.settle()
}

func TestBusyThresholdAPI(t *testing.T) {
	e := newEnv(t, envOpts{engines: 1})
	resp, body := e.get("/busy_threshold")
	if resp.StatusCode != 200 || string(body) != `{"thresholds":[]}`+"\n" {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	// Only the model: a read, which records nothing.
	resp, body = e.post("/busy_threshold", map[string]any{"model": mockModel})
	if resp.StatusCode != 200 || string(body) != `{"model":"`+mockModel+`","active_decode_blocks_threshold":null,"active_prefill_tokens_threshold":null}`+"\n" {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	resp, body = e.post("/busy_threshold", map[string]any{"model": mockModel, "active_decode_blocks_threshold": 0.8})
	if resp.StatusCode != 200 || string(body) != `{"model":"`+mockModel+`","active_decode_blocks_threshold":0.8,"active_prefill_tokens_threshold":null}`+"\n" {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	resp, body = e.post("/busy_threshold", map[string]any{"model": mockModel, "active_prefill_tokens_threshold": 1000})
	if resp.StatusCode != 200 || string(body) != `{"model":"`+mockModel+`","active_decode_blocks_threshold":0.8,"active_prefill_tokens_threshold":1000}`+"\n" {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	resp, body = e.post("/busy_threshold", map[string]any{"model": mockModel, "active_prefill_tokens_threshold_frac": 1.5})
	if resp.StatusCode != 200 || !strings.Contains(string(body), `"active_prefill_tokens_threshold_frac":1.5`) {
		t.Fatalf("setting the fraction: %d %s", resp.StatusCode, body)
	}
	resp, body = e.post("/busy_threshold", map[string]any{"model": mockModel, "active_prefill_tokens_threshold_frac": nil})
	if resp.StatusCode != 200 || strings.Contains(string(body), "frac") {
		t.Fatalf("switching the fraction off: %d %s", resp.StatusCode, body)
	}
	resp, body = e.get("/busy_threshold")
	var list struct {
		Thresholds []sched.ModelThreshold `json:"thresholds"`
	}
	if err := json.Unmarshal(body, &list); err != nil || len(list.Thresholds) != 1 || *list.Thresholds[0].ActivePrefillTokens != 1000 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	if got := e.router.Thresholds().Get(mockModel); *got.ActiveDecodeBlocks != 0.8 {
		t.Fatalf("%+v", got)
	}
	for _, bad := range []string{`{"model":"` + mockModel + `","active_decode_blocks_threshold":1.5}`, `{"active_prefill_tokens_threshold":3}`, `{"model":`} {
		resp, body := e.post("/busy_threshold", bad)
		openAIError(t, resp, body, 400)
	}
}

// /busy_threshold shows the command line's thresholds, refuses a model no
// engine serves, and logs values, not pointers.
func TestBusyThresholdShowsTheCommandLineAndRefusesUnknownModels(t *testing.T) {
	var logs testwait.Buffer
	decode := 0.9
	e := newEnv(t, envOpts{engines: 1,
		router:   func(c *router.Config) { c.Busy.ActiveDecodeBlocks = &decode },
		frontend: func(c *Config) { c.Logger = slog.New(slog.NewTextHandler(&logs, nil)) }})
	resp, body := e.get("/busy_threshold")
	if resp.StatusCode != 200 || string(body) != `{"thresholds":[{"model":"","active_decode_blocks_threshold":0.9,"active_prefill_tokens_threshold":null}]}`+"\n" {
		t.Errorf("GET: %d %s, want the command line's decode threshold", resp.StatusCode, body)
	}
	for _, b := range []map[string]any{{"model": "not-served", "active_decode_blocks_threshold": 0.5}, {"model": "not-served"}} {
		resp, body = e.post("/busy_threshold", b)
		if code := openAIError(t, resp, body, http.StatusNotFound); code != "model_not_found" {
			t.Errorf("%v: %s", b, code)
		}
	}
	resp, body = e.post("/busy_threshold", map[string]any{"model": mockModel, "active_prefill_tokens_threshold": 1000})
	if resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	if line := logs.String(); !strings.Contains(line, "decode=0.9 prefill=1000") || strings.Contains(line, "0x") {
		t.Errorf("log: %s", line)
	}
}

func TestModelsHealthMetrics(t *testing.T) {
	e := newEnv(t, envOpts{engines: 2})
	e.fake(90, "other", 1, func(w http.ResponseWriter, r *http.Request) {})
	resp, body := e.get("/v1/models")
	var models struct {
		Object string `json:"object"`
		Data   []struct {
			ID     string `json:"id"`
			Object string `json:"object"`
		} `json:"data"`
	}
	if err := json.Unmarshal(body, &models); err != nil || models.Object != "list" || len(models.Data) != 2 || models.Data[0].ID != mockModel || models.Data[1].ID != "other" || models.Data[0].Object != "model" {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	resp, body = e.get("/health")
	if resp.StatusCode != 200 || !strings.Contains(string(body), `"status":"ok"`) {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	// A worker the router does not know: degraded, but requests are served.
	e.mu.Lock()
	e.workers = append(e.workers, Worker{ID: 91, Name: "stray", BaseURL: closedURL(t), Model: "other"})
	e.mu.Unlock()
	if resp, body := e.get("/health"); resp.StatusCode != 200 || !strings.Contains(string(body), `"status":"degraded"`) || !strings.Contains(string(body), `stray (91) is not registered`) {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}

	if resp, body := e.post("/v1/completions", map[string]any{"model": mockModel, "prompt": tokens(40, 1), "max_tokens": 2, "stream": true}); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	e.settle()
	resp, body = e.get("/metrics")
	if resp.StatusCode != 200 {
		t.Fatalf("/metrics: %d", resp.StatusCode)
	}
	for _, want := range []string{
		`kvrouter_frontend_requests_total{endpoint="completions",model="kvrouter-mock",status="200"} 1`,
		`kvrouter_frontend_time_to_first_token_seconds_count{model="kvrouter-mock"} 1`,
		`kvrouter_frontend_inter_token_latency_seconds_count{model="kvrouter-mock"} 1`,
		`kvrouter_frontend_input_sequence_tokens_sum{model="kvrouter-mock"} 40`,
		`kvrouter_frontend_output_sequence_tokens_sum{model="kvrouter-mock"} 2`,
		`kvrouter_frontend_request_duration_seconds_count{model="kvrouter-mock"} 1`,
		`kvrouter_frontend_inflight_requests{model="kvrouter-mock"} 0`,
		`kvrouter_frontend_routing_overhead_seconds_count{phase="find_matches",pool="decode"} 1`,
		`kvrouter_frontend_kv_hit_rate_count{model="kvrouter-mock"} 1`,
		`kvrouter_router_decisions_total 1`,
	} {
		if !strings.Contains(string(body), want) {
			t.Errorf("metrics lack %s", want)
		}
	}
	if t.Failed() {
		t.Logf("%s", body)
	}
}

// An engine that closes the connection before answering is a 502.
func TestEngineDiesBeforeAnswering(t *testing.T) {
	e := newEnv(t, envOpts{})
	e.fake(95, "dead", 1, func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		panic(http.ErrAbortHandler)
	})
	resp, body := e.post("/v1/chat/completions", map[string]any{"model": "dead", "messages": []map[string]any{{"role": "user", "content": "x"}}, "nvext": map[string]any{"token_data": []int{1, 2, 3}}})
	if code := openAIError(t, resp, body, http.StatusBadGateway); code != "engine_unreachable" {
		t.Fatal(code)
	}
	e.settle()
}

func TestNewValidates(t *testing.T) {
	r, _ := router.New(router.DefaultConfig())
	if _, err := New(Config{Workers: func() []Worker { return nil }}); err == nil {
		t.Fatal("no router accepted")
	}
	if _, err := New(Config{Router: r}); err == nil {
		t.Fatal("no workers func accepted")
	}
}
