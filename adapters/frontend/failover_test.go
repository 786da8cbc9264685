package frontend

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

func (e *env) migrations(kind string) float64 {
	return testutil.ToFloat64(e.fe.m.migrations.WithLabelValues("fake", kind))
}

// resetHandler is an engine that reads the request and drops the
// connection without a word.
func resetHandler(w http.ResponseWriter, r *http.Request) {
	panic(http.ErrAbortHandler)
}

// A request whose engine refuses the connection goes to another engine;
// the refusal is reported so the registry can drop the engine.
func TestRefusedEngineIsRetriedElsewhereAndReported(t *testing.T) {
	var mu sync.Mutex
	refused := map[uint64]int{}
	e := newEnv(t, envOpts{refused: func(id uint64) { mu.Lock(); refused[id]++; mu.Unlock() }})
	e.fake(60, "fake", 1, sseHandler([]string{"data: {\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\n", "data: [DONE]\n\n"}, ""))
	e.add(Worker{ID: 61, Name: "dead", BaseURL: closedURL(t), Model: "fake"})
	for i := range 20 {
		resp, body := e.post("/v1/completions", map[string]any{"model": "fake", "prompt": tokens(40, i), "stream": true})
		if resp.StatusCode != 200 || !strings.HasSuffix(string(body), "data: [DONE]\n\n") || strings.Contains(string(body), "error") {
			t.Fatalf("request %d: %d %q", i, resp.StatusCode, body)
		}
	}
	e.settle()
	mu.Lock()
	defer mu.Unlock()
	if len(refused) != 1 || refused[61] == 0 || float64(refused[61]) != e.migrations("new_request") {
		t.Fatalf("refusals reported %v, new_request migrations %v", refused, e.migrations("new_request"))
	}
}

// A reset before the response headers is retried on another engine, once,
// and is not taken for a dead engine.
func TestResetBeforeHeadersIsRetriedOnce(t *testing.T) {
	reported := false
	e := newEnv(t, envOpts{refused: func(uint64) { reported = true }})
	e.fake(62, "fake", 1, resetHandler)
	e.fake(63, "fake", 1, resetHandler)
	e.fake(64, "fake", 1, resetHandler)
	resp, body := e.post("/v1/completions", map[string]any{"model": "fake", "prompt": tokens(40, 1)})
	if code := openAIError(t, resp, body, http.StatusBadGateway); code != "engine_unreachable" {
		t.Fatalf("code %q", code)
	}
	e.settle()
	if got := e.migrations("new_request"); got != 1 || reported {
		t.Fatalf("%v retries (want 1), engine reported dead: %v", got, reported)
	}

	ok := newEnv(t, envOpts{})
	ok.fake(65, "fake", 1, resetHandler)
	ok.fake(66, "fake", 1, sseHandler([]string{"data: {\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\n", "data: [DONE]\n\n"}, ""))
	for i := range 10 {
		if resp, body := ok.post("/v1/completions", map[string]any{"model": "fake", "prompt": tokens(40, i), "stream": true}); resp.StatusCode != 200 || strings.Contains(string(body), "error") {
			t.Fatalf("request %d: %d %q", i, resp.StatusCode, body)
		}
	}
	ok.settle()
}

// resumable is a fake engine pair's shared state: the first stream it
// serves breaks after cutAfter tokens; every other is served whole. Each
// token is the word " w<k>", k counting from the tokens already in the
// prompt, so a continuation that carries them on goes on where the first
// stopped.
type resumable struct {
	cutAfter int
	mu       sync.Mutex
	bodies   []map[string]json.RawMessage
}

func (f *resumable) handler(w http.ResponseWriter, r *http.Request) {
	var body map[string]json.RawMessage
	_ = json.NewDecoder(r.Body).Decode(&body)
	if r.URL.Path == "/tokenize" {
		var text string
		_ = json.Unmarshal(body["prompt"], &text)
		ids := []int{}
		for range strings.Fields(text) {
			ids = append(ids, 7)
		}
		_ = json.NewEncoder(w).Encode(map[string]any{"tokens": ids})
		return
	}
	f.mu.Lock()
	f.bodies = append(f.bodies, body)
	n := len(f.bodies)
	f.mu.Unlock()
	var maxTokens int
	_ = json.Unmarshal(body["max_tokens"], &maxTokens)
	chat := strings.HasSuffix(r.URL.Path, "/chat/completions")
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(http.StatusOK)
	for i := range maxTokens {
		if n == 1 && i == f.cutAfter {
			w.(http.Flusher).Flush()
			panic(http.ErrAbortHandler)
		}
		word := fmt.Sprintf(" w%d", i)
		var choice string
		switch {
		case chat && i == 0:
			choice = fmt.Sprintf(`{"index":0,"delta":{"role":"assistant","content":%q},"finish_reason":null}`, word)
		case chat:
			choice = fmt.Sprintf(`{"index":0,"delta":{"content":%q},"finish_reason":null}`, word)
		default:
			choice = fmt.Sprintf(`{"index":0,"text":%q,"finish_reason":null}`, word)
		}
		fmt.Fprintf(w, "data: {\"id\":\"engine-%d\",\"created\":%d,\"choices\":[%s]}\n\n", n, 1000+n, choice)
	}
	fmt.Fprintf(w, "data: {\"id\":\"engine-%d\",\"created\":%d,\"choices\":[],\"usage\":{\"prompt_tokens\":50,\"completion_tokens\":%d,\"total_tokens\":%d}}\n\n", n, 1000+n, maxTokens, 50+maxTokens)
	fmt.Fprint(w, "data: [DONE]\n\n")
}

func TestBrokenStreamContinuesAsOneStream(t *testing.T) {
	cases := []struct {
		name, path string
		prompt     map[string]any
		check      func(t *testing.T, cont map[string]json.RawMessage, generated string)
	}{
		{"text prompt", "/v1/completions", map[string]any{"prompt": "tell me"}, func(t *testing.T, cont map[string]json.RawMessage, generated string) {
			if want, _ := json.Marshal("tell me" + generated); string(cont["prompt"]) != string(want) {
				t.Fatalf("continuation prompt %s, want %s", cont["prompt"], want)
			}
		}},
		{"token prompt", "/v1/completions", map[string]any{"prompt": []int{1, 2, 3}}, func(t *testing.T, cont map[string]json.RawMessage, generated string) {
			if string(cont["prompt"]) != "[1,2,3,7,7,7]" {
				t.Fatalf("continuation prompt %s, want the prompt and the ids of the three words generated", cont["prompt"])
			}
		}},
		{"chat", "/v1/chat/completions", map[string]any{"messages": []map[string]string{{"role": "user", "content": "hi"}}}, func(t *testing.T, cont map[string]json.RawMessage, generated string) {
			var msgs []map[string]string
			_ = json.Unmarshal(cont["messages"], &msgs)
			if len(msgs) != 2 || msgs[1]["role"] != "assistant" || msgs[1]["content"] != generated ||
				string(cont["continue_final_message"]) != "true" || string(cont["add_generation_prompt"]) != "false" {
				t.Fatalf("continuation %v", cont)
			}
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := &resumable{cutAfter: 3}
			e := newEnv(t, envOpts{migrations: 1})
			e.fake(70, "fake", 1, f.handler)
			e.fake(71, "fake", 1, f.handler)
			req := map[string]any{"model": "fake", "max_tokens": 8, "stream": true, "stream_options": map[string]any{"include_usage": true}}
			for k, v := range tc.prompt {
				req[k] = v
			}
			resp, body := e.post(tc.path, req)
			if resp.StatusCode != 200 {
				t.Fatalf("%d %s", resp.StatusCode, body)
			}
			data := sseData(t, strings.NewReader(string(body)))
			if len(data) != 10 || data[9] != "[DONE]" {
				t.Fatalf("want 8 tokens, usage and [DONE]; got %q", data)
			}
			var text strings.Builder
			for i, d := range data[:9] {
				var ch struct {
					ID      string `json:"id"`
					Created int    `json:"created"`
					Choices []struct {
						Text  string `json:"text"`
						Delta *struct {
							Role    *string `json:"role"`
							Content string  `json:"content"`
						} `json:"delta"`
					} `json:"choices"`
					Usage *struct {
						Prompt     int `json:"prompt_tokens"`
						Completion int `json:"completion_tokens"`
						Total      int `json:"total_tokens"`
					} `json:"usage"`
				}
				if err := json.Unmarshal([]byte(d), &ch); err != nil {
					t.Fatal(err)
				}
				if ch.ID != "engine-1" || ch.Created != 1001 {
					t.Fatalf("chunk %d of another stream: %s", i, d)
				}
				if i == 8 {
					if ch.Usage == nil || ch.Usage.Completion != 8 || ch.Usage.Prompt != 47 || ch.Usage.Total != 55 {
						t.Fatalf("usage %s: the 3 tokens of the first engine count as generated", d)
					}
					continue
				}
				c := ch.Choices[0]
				if c.Delta != nil {
					if (c.Delta.Role != nil) != (i == 0) {
						t.Fatalf("chunk %d: role %v", i, c.Delta.Role)
					}
					c.Text = c.Delta.Content
				}
				text.WriteString(c.Text)
			}
			if want := " w0 w1 w2 w0 w1 w2 w3 w4"; text.String() != want {
				t.Fatalf("text %q, want %q", text.String(), want)
			}
			f.mu.Lock()
			defer f.mu.Unlock()
			if len(f.bodies) != 2 || string(f.bodies[1]["max_tokens"]) != "5" {
				t.Fatalf("engine requests %v", f.bodies)
			}
			tc.check(t, f.bodies[1], " w0 w1 w2")
			if e.migrations("ongoing_request") != 1 {
				t.Fatalf("migrations %v", e.migrations("ongoing_request"))
			}
			e.settle()
		})
	}
}

// Without migration a broken stream ends with an error event and [DONE],
// though another engine could have taken it.
func TestBrokenStreamWithoutMigrationEnds(t *testing.T) {
	f := &resumable{cutAfter: 3}
	e := newEnv(t, envOpts{})
	e.fake(72, "fake", 1, f.handler)
	e.fake(73, "fake", 1, f.handler)
	resp, body := e.post("/v1/completions", map[string]any{"model": "fake", "prompt": "x", "max_tokens": 8, "stream": true})
	data := sseData(t, strings.NewReader(string(body)))
	if resp.StatusCode != 200 || len(data) != 5 || data[4] != "[DONE]" || !strings.Contains(data[3], `"engine_stream_error"`) {
		t.Fatalf("%d %q", resp.StatusCode, data)
	}
	e.settle()
	if e.migrations("ongoing_request") != 0 || len(f.bodies) != 1 {
		t.Fatal("migrated with a limit of 0")
	}
}

// A non-streamed answer broken off mid-way has shown the client nothing:
// it is asked again elsewhere.
func TestBrokenWholeAnswerIsRetried(t *testing.T) {
	e := newEnv(t, envOpts{})
	var calls atomic.Int32
	half := func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", "100")
		_, _ = io.WriteString(w, `{"id":"x","cho`)
		w.(http.Flusher).Flush()
		panic(http.ErrAbortHandler)
	}
	whole := func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"y","choices":[{"index":0,"text":"ok"}],"usage":{"completion_tokens":1}}`)
	}
	e.fake(74, "fake", 1, half)
	e.fake(75, "fake", 1, whole)
	for i := range 20 {
		resp, body := e.post("/v1/completions", map[string]any{"model": "fake", "prompt": tokens(40, i)})
		if resp.StatusCode != 200 || !strings.Contains(string(body), `"ok"`) {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, body)
		}
	}
	e.settle()
	if retries := e.migrations("new_request"); retries == 0 || float64(calls.Load()) != 20+retries {
		t.Fatalf("%v retries, %d engine calls", retries, calls.Load())
	}
}

// What a continuation keeps of each chunk, the chunk walked rather than
// decoded: the text of its choice, unescaped, whether it finished, and
// whether it is one a continuation can reproduce.
func TestRelayNotesChunks(t *testing.T) {
	cases := []struct {
		chunk     string
		text      string
		gen       int
		finished  bool
		resumable bool
	}{
		{`{"id":"a","choices":[{"index":0,"text":" x","finish_reason":null}]}`, " x", 1, false, true},
		{`{"choices":[{"index":0,"delta":{"role":"assistant","content":"h\"i\u00e9\n"}}]}`, "h\"ié\n", 1, false, true},
		{`{"choices":[{"index":0,"delta":{"content":""},"finish_reason":"stop"}]}`, "", 0, true, true},
		{`{"choices":[{"index":0,"text":null,"logprobs":{"text":"no","tokens":["x"]}}]}`, "", 0, false, true},
		{`{"choices":[],"usage":{"completion_tokens":3}}`, "", 0, false, true},
		{`{"choices":[{"index":1,"text":"b"}]}`, "b", 1, false, false},
		{` { "choices" : [ { "text" : "s" , "index" : 0 } ] } `, "s", 1, false, true},
		{`[1,2]`, "", 0, false, false},
		{`"text"`, "", 0, false, false},
	}
	for _, tc := range cases {
		rs := newRelay(nil, true)
		rs.note([]byte(tc.chunk))
		if rs.generated.String() != tc.text || rs.genTokens != tc.gen || rs.finished != tc.finished || rs.resumable != tc.resumable {
			t.Errorf("%s: text %q, %d tokens, finished %v, resumable %v", tc.chunk, rs.generated.String(), rs.genTokens, rs.finished, rs.resumable)
		}
	}
}

// A reset says nothing about the engine: a fresh dial does. A closed port
// refuses; a listening one, or a host that does not answer in time, is
// not declared dead.
func TestRefusesConnections(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	open := "http://" + ln.Addr().String()
	closedLn, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := "http://" + closedLn.Addr().String()
	closedLn.Close()
	defer ln.Close()
	for _, c := range []struct {
		url  string
		want bool
	}{{open, false}, {closed, true}, {"::not a url", false}} {
		if got := refusesConnections(context.Background(), c.url); got != c.want {
			t.Errorf("refusesConnections(%q) = %v, want %v", c.url, got, c.want)
		}
	}
}
