package frontend

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"mime"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/core/router"
)

type endpoint struct {
	name, path string
	kind       promptKind
}

var (
	endpointCompletions = endpoint{"completions", "/v1/completions", kindCompletion}
	endpointChat        = endpoint{"chat_completions", "/v1/chat/completions", kindChat}
)

// call is one OpenAI request on its way through the frontend.
type call struct {
	f        *Frontend
	w        http.ResponseWriter
	r        *http.Request
	ep       endpoint
	start    time.Time
	sent     time.Time // when the request left for the engine
	model    string    // "" until known to be served: a metrics label
	status   string    // requests_total's status label
	id       string    // booking id
	decision router.Decision
	worker   Worker
	ex       extras
	tokenize time.Duration
	isl      int
}

func (c *call) fail(e *httpError) {
	c.status = strconv.Itoa(e.status)
	writeHTTPError(c.w, e)
}

func (f *Frontend) serveOpenAI(w http.ResponseWriter, r *http.Request, ep endpoint) {
	c := &call{f: f, w: w, r: r, ep: ep, start: time.Now(), status: "500"}
	defer func() { f.m.requests.WithLabelValues(c.model, ep.name, c.status).Inc() }()

	body, herr := readBody(w, r, f.cfg.MaxBodyBytes)
	if herr != nil {
		c.fail(herr)
		return
	}
	members, err := objectMembers(body)
	if err != nil {
		c.fail(badRequest("invalid_json", "", "the body must be a JSON object"))
		return
	}
	top := make(map[string]json.RawMessage, len(members))
	for _, m := range members {
		top[m.key] = m.val
	}
	var model string
	if !present(top["model"]) {
		c.fail(badRequest("missing_model", "model", "model is required"))
		return
	}
	if err := json.Unmarshal(top["model"], &model); err != nil || model == "" {
		c.fail(badRequest("invalid_model", "model", "model must be a non-empty string"))
		return
	}
	all, serving := f.workersFor(model)
	switch {
	case len(all) == 0:
		c.fail(newError(http.StatusServiceUnavailable, "server_error", "no_workers", "", "no workers are registered"))
		return
	case len(serving) == 0:
		c.fail(newError(http.StatusNotFound, "invalid_request_error", "model_not_found", "model", "The model `%s` does not exist.", model))
		return
	}
	c.model = model
	f.m.inflight.WithLabelValues(model).Inc()
	defer f.m.inflight.WithLabelValues(model).Dec()

	if herr := checkPrompt(top, ep.kind); herr != nil {
		c.fail(herr)
		return
	}
	req := router.Request{ID: f.newID(), Model: model}
	n, ex, herr := parseNvext(top["nvext"], r.Header, &req)
	if herr != nil {
		c.fail(herr)
		return
	}
	c.ex, c.id = ex, req.ID
	t0 := time.Now()
	req.Tokens, herr = f.promptTokens(r.Context(), top, ep.kind, model, serving, n.TokenData)
	if herr != nil {
		c.fail(herr)
		return
	}
	c.tokenize = time.Since(t0)
	c.isl = len(req.Tokens)

	d, err := f.cfg.Router.BestWorker(r.Context(), &req)
	if err != nil {
		if r.Context().Err() != nil {
			c.status = "cancelled"
			return
		}
		c.fail(routeError(err, model))
		return
	}
	// Booked: whatever happens from here, the load goes back.
	defer f.cfg.Router.Free(req.ID)
	c.decision = d
	f.observeDecision(model, &d)
	if d.Warning != "" {
		f.log.Warn("routing", "warning", d.Warning, "request", req.ID)
	}
	wk, ok := findWorker(f.cfg.Workers(), d.Worker.ID)
	if !ok {
		c.fail(newError(http.StatusServiceUnavailable, "server_error", "worker_gone", "", "worker %d left the registry", d.Worker.ID))
		return
	}
	c.worker = wk

	out := pieces{body}
	_, hasNvext := top["nvext"]
	switch {
	case wk.DPSize > 1:
		out = without(body, members, []string{"nvext", "data_parallel_rank"}, []byte("data_parallel_rank"), strconv.AppendUint(nil, uint64(d.Worker.DPRank), 10))
	case hasNvext:
		out = without(body, members, []string{"nvext"})
	}
	c.forward(out)
}

func (f *Frontend) observeDecision(model string, d *router.Decision) {
	f.m.routing.WithLabelValues("hash").Observe(d.Timings.Hash.Seconds())
	f.m.routing.WithLabelValues("find_matches").Observe(d.Timings.FindMatches.Seconds())
	f.m.routing.WithLabelValues("scheduling").Observe(d.Timings.Schedule.Seconds())
	f.m.routing.WithLabelValues("queue").Observe(d.Queued.Seconds())
	f.m.routing.WithLabelValues("total").Observe(d.Timings.Total.Seconds())
	if d.PromptBlocks > 0 {
		f.m.hitRate.WithLabelValues(model).Observe(float64(d.OverlapBlocks) / float64(d.PromptBlocks))
	}
}

// hopByHop headers are the connection's, not the response's.
var hopByHop = []string{"Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade", "Content-Length"}

func copyHeaders(dst, src http.Header) {
	for k, vs := range src {
		if slices.Contains(hopByHop, k) {
			continue
		}
		dst[k] = slices.Clone(vs)
	}
}

// forward sends the request to the chosen engine and relays its answer.
func (c *call) forward(body pieces) {
	ctx := c.r.Context()
	url := strings.TrimRight(c.worker.BaseURL, "/") + c.ep.path
	ereq, err := body.post(ctx, url)
	if err != nil {
		c.fail(newError(http.StatusBadGateway, "server_error", "engine_unreachable", "", "engine %s: %v", c.worker.Name, err))
		return
	}
	if a := c.r.Header.Get("Accept"); a != "" {
		ereq.Header.Set("Accept", a)
	}
	ereq.Header.Set("X-Request-Id", c.id)
	c.sent = time.Now()
	resp, err := c.f.cfg.Client.Do(ereq)
	if err != nil {
		if ctx.Err() != nil {
			c.status = "cancelled"
			return
		}
		c.f.log.Warn("engine unreachable", "worker", c.worker.Name, "url", url, "err", err)
		c.fail(newError(http.StatusBadGateway, "server_error", "engine_unreachable", "", "engine %s unreachable: %v", c.worker.Name, err))
		return
	}
	defer resp.Body.Close()

	if resp.StatusCode != http.StatusOK {
		// The engine's own error, relayed with its code as a string.
		c.status = strconv.Itoa(resp.StatusCode)
		data, _ := readAtMost(resp.Body, resp.ContentLength, maxEngineError)
		copyHeaders(c.w.Header(), resp.Header)
		c.w.WriteHeader(resp.StatusCode)
		_, _ = c.w.Write(stringCode(data))
		c.f.m.duration.WithLabelValues(c.model).Observe(time.Since(c.start).Seconds())
		return
	}
	if mt, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type")); mt == "text/event-stream" {
		c.stream(resp)
		return
	}
	c.whole(resp)
}

// whole relays a non-streamed answer; its arrival is the first token.
func (c *call) whole(resp *http.Response) {
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		if c.r.Context().Err() != nil {
			c.status = "cancelled"
			return
		}
		c.fail(newError(http.StatusBadGateway, "server_error", "engine_stream_error", "", "engine %s broke off its answer: %v", c.worker.Name, err))
		return
	}
	c.f.cfg.Router.MarkPrefillCompleted(c.id)
	elapsed := time.Since(c.start)
	if c.ex.any() {
		ext := c.ex.build(&c.decision, c.tokenize, c.sent.Sub(c.start), elapsed, elapsed)
		if b, ok := injectNvext(data, ext); ok {
			data = b
		}
	}
	copyHeaders(c.w.Header(), resp.Header)
	c.w.Header().Set("Content-Length", strconv.Itoa(len(data)))
	c.w.WriteHeader(http.StatusOK)
	_, _ = c.w.Write(data)
	c.status = "200"
	c.observeEnd(elapsed, outputTokens(data, -1))
}

func (c *call) observeEnd(ttft time.Duration, out int) {
	m := c.f.m
	m.ttft.WithLabelValues(c.model).Observe(ttft.Seconds())
	m.duration.WithLabelValues(c.model).Observe(time.Since(c.start).Seconds())
	m.inputTokens.WithLabelValues(c.model).Observe(float64(c.isl))
	if out >= 0 {
		m.outputTokens.WithLabelValues(c.model).Observe(float64(out))
	}
}

// maxEngineError bounds the engine error body the frontend relays.
const maxEngineError = 1 << 20

// stringCode gives an engine's OpenAI error body the frontend's type of
// "code", a string: vLLM sends the HTTP status as a number, and a client
// should not have to handle both. Other bodies are returned as they are.
func stringCode(body []byte) []byte {
	top, err := splitObject(body)
	if err != nil {
		return body
	}
	switch e := top["error"]; {
	case len(e) > 0 && e[0] == '{':
		inner, ok := withStringCode(e)
		if !ok {
			return body
		}
		top["error"] = inner
		out, err := json.Marshal(top)
		if err != nil {
			return body
		}
		return append(out, '\n')
	case bytes.Equal(top["object"], []byte(`"error"`)): // vLLM's older flat shape
		if out, ok := withStringCode(body); ok {
			return append(out, '\n')
		}
	}
	return body
}

// withStringCode returns the JSON object obj with a "code" that is not a
// string turned into one; ok is false when there is nothing to change.
func withStringCode(obj []byte) ([]byte, bool) {
	m, err := splitObject(obj)
	if err != nil {
		return nil, false
	}
	code := m["code"]
	if len(code) == 0 || code[0] == '"' || string(code) == "null" {
		return nil, false
	}
	m["code"], _ = json.Marshal(string(code))
	out, err := json.Marshal(m)
	return out, err == nil
}

// outputTokens is usage.completion_tokens of a JSON answer or chunk, else
// def.
func outputTokens(data []byte, def int) int {
	if !bytes.Contains(data, []byte(`"usage"`)) {
		return def
	}
	var u struct {
		Usage *struct {
			CompletionTokens *int `json:"completion_tokens"`
		} `json:"usage"`
	}
	if json.Unmarshal(data, &u) == nil && u.Usage != nil && u.Usage.CompletionTokens != nil {
		return *u.Usage.CompletionTokens
	}
	return def
}

// isErrorChunk reports whether a JSON chunk is an error object.
func isErrorChunk(data []byte) bool {
	if !bytes.Contains(data, []byte(`"error"`)) {
		return false
	}
	var e struct {
		Error json.RawMessage `json:"error"`
	}
	return json.Unmarshal(data, &e) == nil && present(e.Error)
}

func isObject(data []byte) bool {
	d := bytes.TrimSpace(data)
	return len(d) > 0 && d[0] == '{'
}

var doneData = []byte("[DONE]")

// stream relays server-sent events as they come, checking each one.
func (c *call) stream(resp *http.Response) {
	ctx := c.r.Context()
	rc := http.NewResponseController(c.w)
	copyHeaders(c.w.Header(), resp.Header)
	c.w.WriteHeader(http.StatusOK)
	// A stream lasts as long as the generation: no write timeout.
	_ = rc.SetWriteDeadline(time.Time{})
	_ = rc.Flush()

	var (
		sse     = newSSEReader(resp.Body)
		first   time.Time
		last    time.Time
		chunks  int
		usage   = -1
		engErr  bool
		clientW = func(b []byte) bool {
			_, err := c.w.Write(b)
			return err == nil
		}
	)
	defer func() {
		out := chunks
		if usage >= 0 {
			out = usage
		}
		if !first.IsZero() {
			c.observeEnd(first.Sub(c.start), out)
		} else {
			c.f.m.duration.WithLabelValues(c.model).Observe(time.Since(c.start).Seconds())
		}
	}()
	for {
		ev, err := sse.next()
		if err != nil {
			if ctx.Err() != nil {
				c.status = "cancelled"
				return
			}
			var msg []byte
			switch {
			case errors.Is(err, io.EOF):
				msg = errorEvent("engine_stream_error", "engine %s ended the stream before [DONE]", c.worker.Name)
			case errors.Is(err, errMalformed):
				msg = errorEvent("engine_stream_error", "engine %s sent a malformed stream: %v", c.worker.Name, err)
			default:
				msg = errorEvent("engine_stream_error", "engine %s broke off the stream: %v", c.worker.Name, err)
			}
			c.f.log.Warn("engine stream failed", "worker", c.worker.Name, "request", c.id, "err", err)
			c.status = "stream_error"
			clientW(msg)
			_ = rc.Flush()
			return
		}
		raw := ev.raw
		if ev.hasData {
			switch {
			case bytes.Equal(ev.data, doneData):
				clientW(raw)
				_ = rc.Flush()
				c.status = "200"
				if engErr {
					c.status = "stream_error"
				}
				return
			case !json.Valid(ev.data):
				c.f.log.Warn("engine stream failed", "worker", c.worker.Name, "request", c.id, "err", "data is not JSON")
				c.status = "stream_error"
				clientW(errorEvent("engine_stream_error", "engine %s sent a malformed stream: a data line that is not JSON: %.120q", c.worker.Name, ev.data))
				_ = rc.Flush()
				return
			case isErrorChunk(ev.data):
				engErr = true
			default:
				now := time.Now()
				if first.IsZero() {
					first = now
					c.f.cfg.Router.MarkPrefillCompleted(c.id)
					if c.ex.any() && isObject(ev.data) {
						ext := c.ex.build(&c.decision, c.tokenize, c.sent.Sub(c.start), now.Sub(c.start), -1)
						if b, ok := injectNvext(ev.data, ext); ok {
							raw = append(append([]byte("data: "), b...), "\n\n"...)
						}
					}
				} else {
					c.f.m.itl.WithLabelValues(c.model).Observe(now.Sub(last).Seconds())
				}
				last = now
				chunks++
				usage = outputTokens(ev.data, usage)
			}
		}
		if !clientW(raw) {
			c.status = "cancelled"
			return
		}
		if sse.buffered() == 0 {
			// Nothing more in hand: what was written goes out now.
			if err := rc.Flush(); err != nil && !errors.Is(err, http.ErrNotSupported) {
				c.status = "cancelled"
				return
			}
		}
		if ctx.Err() != nil {
			c.status = "cancelled"
			return
		}
	}
}
