package frontend

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/core/kv"
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
	ctx      context.Context // r's, also ended by Frontend.Abort
	ep       endpoint
	start    time.Time
	sent     time.Time // when the request left for the engine
	model    string    // "" until known to be served
	base     string    // the model the engines serve: model, or an adapter's base model
	lora     string    // model when it names a LoRA adapter
	label    string    // the model as metrics label it (modelLabel)
	status   string    // requests_total's status label
	id       string    // booking id
	decision router.Decision
	worker   Worker
	ex       extras
	read     time.Duration // reading the client's body
	tokenize time.Duration
	isl      int
	top      map[string]json.RawMessage // the client's request
	body     []byte                     // and its bytes
	members  []member                   // and its members, in order
	rs       *relay                     // the client's stream, once opened
	streamed bool                       // the client asked for a stream
	// speculative is agent_hints.speculative_prefill; answer is the
	// non-streamed answer's text, for it.
	speculative bool
	answer      *string

	// Disaggregated serving: the prefill pin (nvext.prefill_worker_id),
	// whether the prefill was tried, and what it left for the decode.
	prefillTarget *kv.Worker
	pdTried       bool
	pd            *prefillResult
	localReason   string // why the decode worker prefilled, when it did

	// What the last engine did, for outlier detection: served the request
	// well (an answer, or an error of the client's making), or failed it
	// after the client's stream began (fault); engineErr is the error
	// status of an engine that failed before, relayed if no engine serves.
	engineOK  bool
	fault     string
	engineErr *engineStatus
}

// held is what the frontend spent before the engine got the request.
func (c *call) held() heldSpans {
	return heldSpans{read: c.read, tokenize: c.tokenize, total: c.sent.Sub(c.start)}
}

func (c *call) fail(e *httpError) {
	c.status = strconv.Itoa(e.status)
	writeHTTPError(c.w, e)
}

// stopped ends a call whose context ended: silently if the client left;
// if the router is shutting down, with a 503 or, once the client's stream
// is open, an error event and the [DONE] that tells clients the stream is
// over and was not merely broken off.
func (c *call) stopped() {
	if c.r.Context().Err() != nil {
		c.status = "cancelled"
		return
	}
	if c.rs == nil {
		c.fail(newError(http.StatusServiceUnavailable, "server_error", "shutting_down", "", "%v", context.Cause(c.ctx)))
		return
	}
	c.status = "stream_error"
	c.rs.write(errorEvent("shutting_down", "%v: the stream was cut", context.Cause(c.ctx)))
	c.rs.write([]byte("data: [DONE]\n\n"))
	_ = c.rs.rc.Flush()
}

func (f *Frontend) serveOpenAI(w http.ResponseWriter, r *http.Request, ep endpoint) {
	ctx, done := f.requestContext(r)
	defer done()
	c := &call{f: f, w: w, r: r, ctx: ctx, ep: ep, start: time.Now(), status: "500"}
	defer func() {
		f.m.requests.WithLabelValues(c.label, ep.name, c.status).Inc()
		if c.label == otherModel && strings.HasPrefix(c.status, "2") {
			f.labels.learn(c.model)
		}
	}()

	if f.waitingForWorkers(w) {
		c.status = "503"
		return
	}
	body, herr := readBody(w, r, f.cfg.MaxBodyBytes)
	if herr != nil {
		c.fail(herr)
		return
	}
	c.read = time.Since(c.start)
	p, herr := f.parse(ctx, ep, r.Header, f.isAdmin(r), body)
	if p != nil && p.model != "" {
		c.model, c.base, c.lora, c.label = p.model, p.base, p.lora, f.modelLabel(p.model)
	}
	if herr != nil {
		if ctx.Err() != nil && p != nil && p.model != "" {
			c.stopped()
			return
		}
		c.fail(herr)
		return
	}
	f.m.inflight.WithLabelValues(c.label).Inc()
	defer f.m.inflight.WithLabelValues(c.label).Dec()
	warn(w, p.warnings)
	req := p.req
	c.ex, c.id = p.ex, req.ID
	c.prefillTarget = p.prefillTarget
	c.tokenize = p.tokenize
	c.isl = len(req.Tokens)
	c.top, c.body, c.members = p.top, body, p.members
	c.streamed = string(bytes.TrimSpace(p.top["stream"])) == "true"
	c.speculative = p.speculative
	c.serve(&req)
	if c.speculative && c.status == "200" {
		if text, ok := c.answerText(); ok {
			c.speculate(text)
		}
	}
}

// answerText is the text the call answered, when it is known whole.
func (c *call) answerText() (string, bool) {
	switch {
	case c.answer != nil:
		return *c.answer, true
	case c.rs != nil && c.rs.track && c.rs.resumable && c.rs.finished:
		return c.rs.generated.String(), true
	}
	return "", false
}

// parsed is an OpenAI request read, checked and tokenized: ready to route.
type parsed struct {
	top     map[string]json.RawMessage // the client's request
	members []member                   // and its members, in order
	// model is the model asked for, base the model the engines serve
	// (model, or an adapter's base model), lora model when it names an
	// adapter; model is set once known to be served.
	model, base, lora string
	req               router.Request
	ex                extras
	warnings          []string
	speculative       bool // agent_hints.speculative_prefill
	prefillTarget     *kv.Worker
	tokenize          time.Duration
}

// parse reads an OpenAI request's body into the router's request, under a
// fresh booking id, as every path into the router (the HTTP frontend, the
// endpoint picker) reads it. admin says the caller holds the admin token.
// A parse that fails after the model was found returns it with the error.
func (f *Frontend) parse(ctx context.Context, ep endpoint, header http.Header, admin bool, body []byte) (*parsed, *httpError) {
	members, err := objectMembers(body)
	if err != nil {
		return nil, badRequest("invalid_json", "", "the body must be a JSON object")
	}
	top := make(map[string]json.RawMessage, len(members))
	for _, m := range members {
		top[m.key] = m.val
	}
	if _, ok := top[kvTransferKey]; ok {
		// engineBody leaves it out of the client's bytes; every body
		// built from top is without it too.
		delete(top, kvTransferKey)
		f.dm.clientParams.Inc()
	}
	var model string
	if !present(top["model"]) {
		return nil, badRequest("missing_model", "model", "model is required")
	}
	if err := json.Unmarshal(top["model"], &model); err != nil || model == "" {
		return nil, badRequest("invalid_model", "model", "model must be a non-empty string")
	}
	all, serving := f.workersFor(model)
	base, adapter := model, ""
	var herr *httpError
	switch {
	case len(all) == 0:
		return nil, newError(http.StatusServiceUnavailable, "server_error", "no_workers", "", "no workers are registered")
	case f.isAdapter(model, all):
		adapter = model
		if base, serving, herr = f.adapterWorkers(ctx, model, all); herr != nil {
			return nil, herr
		}
	case len(serving) == 0:
		return nil, f.unknownModel(model)
	}
	p := &parsed{top: top, members: members, model: model, base: base, lora: adapter}
	if herr := checkPrompt(top, ep.kind); herr != nil {
		return p, herr
	}
	p.req = router.Request{ID: f.newID(), Model: base, LoRA: adapter, OverrideBusy: admin}
	req := &p.req
	if adapter != "" {
		req.Only = workerIDs(serving)
	}
	if req.CacheSalt, herr = cacheSalt(top); herr != nil {
		return p, herr
	}
	n, ex, warnings, herr := parseNvext(requestNvext(top, header, f.cfg.StrictNvext), req)
	if herr != nil {
		return p, herr
	}
	p.ex, p.warnings = ex, warnings
	p.speculative = n.AgentHints != nil && n.AgentHints.SpeculativePrefill != nil && *n.AgentHints.SpeculativePrefill
	if n.PrefillWorkerID != nil {
		p.prefillTarget = &kv.Worker{ID: *n.PrefillWorkerID}
		if n.PrefillDPRank != nil {
			p.prefillTarget.DPRank = *n.PrefillDPRank
		}
	}
	t0 := time.Now()
	req.Tokens, req.MM, herr = f.promptTokens(ctx, top, ep.kind, base, serving, n.TokenData)
	if herr != nil {
		return p, herr
	}
	p.tokenize = time.Since(t0)
	return p, nil
}

// observeDecision records a routing decision of pool (poolPrefill, or
// poolDecode for the decode-capable workers every other request goes to).
// The hit rate is that of the engine that prefills: a decode after a remote
// prefill counts its held blocks in kv_transfer_blocks_total instead.
func (f *Frontend) observeDecision(label, pool string, d *router.Decision, prefills bool) {
	f.m.routing.WithLabelValues("hash", pool).Observe(d.Timings.Hash.Seconds())
	f.m.routing.WithLabelValues("find_matches", pool).Observe(d.Timings.FindMatches.Seconds())
	f.m.routing.WithLabelValues("scheduling", pool).Observe(d.Timings.Schedule.Seconds())
	f.m.routing.WithLabelValues("queue", pool).Observe(d.Queued.Seconds())
	f.m.routing.WithLabelValues("total", pool).Observe(d.Timings.Total.Seconds())
	if prefills && d.PromptBlocks > 0 {
		f.m.hitRate.WithLabelValues(label).Observe(float64(d.OverlapBlocks) / float64(d.PromptBlocks))
	}
}

// notRelayed are the engine's headers the client does not get: the
// hop-by-hop ones, which are the connection's, not the response's, and
// Server, which tells what the engine runs.
var notRelayed = []string{"Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade", "Content-Length", "Server"}

func copyHeaders(dst, src http.Header) {
	for k, vs := range src {
		if slices.Contains(notRelayed, k) {
			continue
		}
		dst[k] = slices.Clone(vs)
	}
}

// forward sends the request to the chosen engine and relays its answer.
// A failure before the engine answered anything comes back as unanswered,
// with nothing written to the client.
func (c *call) forward(body pieces) (outcome, error) {
	bound := c.f.headerBound(c.streamed)
	ctx, arrived, release := withHeaderBound(c.ctx, bound)
	defer release()
	url := strings.TrimRight(c.worker.BaseURL, "/") + c.ep.path
	ereq, err := body.post(ctx, url)
	if err != nil {
		return unanswered, err
	}
	if a := c.r.Header.Get("Accept"); a != "" {
		ereq.Header.Set("Accept", a)
	}
	ereq.Header.Set("X-Request-Id", c.id)
	if c.sent.IsZero() {
		c.sent = time.Now()
	}
	resp, err := c.f.cfg.Client.Do(ereq)
	if !arrived() {
		if err == nil {
			resp.Body.Close()
		}
		return unanswered, fmt.Errorf("%w (%s)", errHeaderTimeout, bound)
	}
	if err != nil {
		if c.ctx.Err() != nil {
			c.stopped()
			return served, nil
		}
		return unanswered, &engineFault{"the request failed before the engine answered", err}
	}
	defer resp.Body.Close()

	if resp.StatusCode != http.StatusOK {
		if c.rs != nil {
			// A continuation the engine refused: the client's stream is
			// already open, so the engine's error cannot be relayed as is.
			msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
			return cut, fmt.Errorf("engine %s answered the continuation with %d: %s", c.worker.Name, resp.StatusCode, engineMessage(msg))
		}
		data, _ := readAtMost(resp.Body, resp.ContentLength, maxEngineError)
		st := &engineStatus{code: resp.StatusCode, header: resp.Header, body: data}
		if resp.StatusCode >= 500 {
			// The engine failed, not the request: another may serve it,
			// and this answer is relayed only if none does.
			c.engineErr = st
			return unanswered, st
		}
		c.engineOK = true
		c.relayStatus(st)
		return served, nil
	}
	if mt, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type")); mt == "text/event-stream" {
		return c.stream(resp)
	}
	if c.rs != nil {
		return cut, fmt.Errorf("engine %s answered the continuation without a stream", c.worker.Name)
	}
	if c.streamed {
		// Relayed as it is, it would be a 200 that no streaming client
		// can read and that never ends with [DONE].
		c.f.log.Warn("engine answered a streamed request without an event stream", "worker", c.worker.Name, "request", c.id, "content_type", resp.Header.Get("Content-Type"))
		c.fail(newError(http.StatusBadGateway, "server_error", "engine_stream_error", "", "engine %s answered a streamed request without an event stream", c.worker.Name))
		c.f.m.duration.WithLabelValues(c.label).Observe(time.Since(c.start).Seconds())
		return served, nil
	}
	return c.whole(resp)
}

// relayStatus passes an engine's error answer on, its code as a string.
func (c *call) relayStatus(st *engineStatus) {
	c.status = strconv.Itoa(st.code)
	copyHeaders(c.w.Header(), st.header)
	c.w.WriteHeader(st.code)
	_, _ = c.w.Write(withoutKVTransfer(stringCode(st.body)))
	c.f.m.duration.WithLabelValues(c.label).Observe(time.Since(c.start).Seconds())
}

// whole relays a non-streamed answer; its arrival is the first token. An
// answer the engine broke off has shown the client nothing: unanswered.
func (c *call) whole(resp *http.Response) (outcome, error) {
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		if c.ctx.Err() != nil {
			c.stopped()
			return served, nil
		}
		return unanswered, &engineFault{"the answer broke off", err}
	}
	c.f.cfg.Router.MarkPrefillCompleted(c.id)
	data = withoutKVTransfer(data)
	if c.speculative {
		if text, ok := answerText(data); ok {
			c.answer = &text
		}
	}
	elapsed := time.Since(c.start)
	if c.ex.any() {
		ext := c.ex.build(&c.decision, c.pd, c.held(), elapsed, elapsed)
		if b, ok := injectNvext(data, ext); ok {
			data = b
		}
	}
	copyHeaders(c.w.Header(), resp.Header)
	c.w.Header().Set("Content-Length", strconv.Itoa(len(data)))
	c.w.WriteHeader(http.StatusOK)
	_, _ = c.w.Write(data)
	c.status = "200"
	c.engineOK = true
	prompt, out := usageOf(data)
	c.observeEnd(elapsed, out)
	c.f.tokCheck.observe(c.label, c.worker.Name, c.isl, prompt)
	return served, nil
}

func (c *call) observeEnd(ttft time.Duration, out int) {
	m := c.f.m
	m.ttft.WithLabelValues(c.label).Observe(ttft.Seconds())
	c.f.ui.observeTTFT(ttft)
	m.duration.WithLabelValues(c.label).Observe(time.Since(c.start).Seconds())
	m.inputTokens.WithLabelValues(c.label).Observe(float64(c.isl))
	if out >= 0 {
		m.outputTokens.WithLabelValues(c.label).Observe(float64(out))
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

// usageOf is usage.prompt_tokens and usage.completion_tokens of a JSON
// answer or chunk, each -1 when absent.
func usageOf(data []byte) (prompt, completion int) {
	prompt, completion = -1, -1
	if !bytes.Contains(data, []byte(`"usage"`)) {
		return
	}
	var u struct {
		Usage *struct {
			PromptTokens     *int `json:"prompt_tokens"`
			CompletionTokens *int `json:"completion_tokens"`
		} `json:"usage"`
	}
	if json.Unmarshal(data, &u) != nil || u.Usage == nil {
		return
	}
	if u.Usage.PromptTokens != nil {
		prompt = *u.Usage.PromptTokens
	}
	if u.Usage.CompletionTokens != nil {
		completion = *u.Usage.CompletionTokens
	}
	return
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

// stream relays server-sent events as they come, checking each one. It
// returns cut, with the cause, when the engine's stream broke off without
// anything wrong in what it sent: the engine went away.
func (c *call) stream(resp *http.Response) (outcome, error) {
	ctx := c.ctx
	sse := newSSEReader(resp.Body)
	var pending *event
	if c.rs == nil {
		// The client's stream opens with the engine's first event: an
		// engine that breaks before it has shown the client nothing, and
		// the request can go elsewhere.
		ev, err := sse.next()
		switch {
		case err == nil && ev.hasData && !bytes.Equal(ev.data, doneData) && !json.Valid(ev.data):
			return unanswered, fmt.Errorf("%w: a data line that is not JSON: %.120q", errMalformedStart, ev.data)
		case err == nil:
			pending = &ev
		case ctx.Err() != nil:
			c.stopped()
			return served, nil
		case errors.Is(err, errMalformed):
			return unanswered, fmt.Errorf("%w: %w", errMalformedStart, err)
		default:
			return unanswered, fmt.Errorf("the stream ended before its first event: %w", err)
		}
		c.rs = newRelay(c.w, c.f.cfg.MigrationLimit > 0 || c.speculative)
		copyHeaders(c.w.Header(), resp.Header)
		c.w.WriteHeader(http.StatusOK)
		// A stream lasts as long as the generation: no write timeout.
		_ = c.rs.rc.SetWriteDeadline(time.Time{})
		_ = c.rs.rc.Flush()
	}
	rs := c.rs
	rs.startEngine()
	for {
		var ev event
		var err error
		if pending != nil {
			ev, pending = *pending, nil
		} else {
			ev, err = sse.next()
		}
		if err != nil {
			if ctx.Err() != nil {
				c.stopped()
				return served, nil
			}
			if errors.Is(err, errMalformed) {
				c.fault = failMalformed
				c.endStream(errorEvent("engine_stream_error", "engine %s sent a malformed stream: %v", c.worker.Name, err))
				return served, nil
			}
			if errors.Is(err, io.EOF) {
				return cut, errors.New("the stream ended before [DONE]")
			}
			return cut, &engineFault{"the stream broke off before [DONE]", err}
		}
		raw := ev.raw
		if ev.hasData && bytes.Contains(ev.data, kvTransferQuoted) {
			if d := withoutKVTransfer(ev.data); len(d) != len(ev.data) {
				ev.data, raw = d, dataEvent(d)
			}
		}
		if ev.hasData {
			switch {
			case bytes.Equal(ev.data, doneData):
				rs.write(raw)
				_ = rs.rc.Flush()
				c.status = "200"
				c.engineOK = true
				if rs.engErr {
					c.status = "stream_error"
				}
				return served, nil
			case !json.Valid(ev.data):
				c.fault = failMalformed
				c.endStream(errorEvent("engine_stream_error", "engine %s sent a malformed stream: a data line that is not JSON: %.120q", c.worker.Name, ev.data))
				return served, nil
			case isErrorChunk(ev.data):
				rs.engErr = true
			default:
				now := time.Now()
				if rs.engineChunks == 0 {
					c.f.cfg.Router.MarkPrefillCompleted(c.id)
				}
				rs.engineChunks++
				if rs.first.IsZero() {
					rs.first = now
					if c.ex.any() && isObject(ev.data) {
						ext := c.ex.build(&c.decision, c.pd, c.held(), now.Sub(c.start), -1)
						if b, ok := injectNvext(ev.data, ext); ok {
							raw = dataEvent(b)
						}
					}
				} else {
					c.f.m.itl.WithLabelValues(c.label).Observe(now.Sub(rs.last).Seconds())
				}
				rs.last = now
				rs.chunks++
				raw = rs.observe(ev.data, raw)
			}
		}
		if !rs.write(raw) {
			c.status = "cancelled"
			return served, nil
		}
		if sse.buffered() == 0 {
			// Nothing more in hand: what was written goes out now.
			if err := rs.rc.Flush(); err != nil && !errors.Is(err, http.ErrNotSupported) {
				c.status = "cancelled"
				return served, nil
			}
		}
		if ctx.Err() != nil {
			c.stopped()
			return served, nil
		}
	}
}

// endStream ends the client's stream with an error event, and [DONE] so
// that clients waiting for it stop.
func (c *call) endStream(msg []byte) {
	c.status = "stream_error"
	c.f.log.Warn("engine stream failed", "worker", c.worker.Name, "request", c.id, "err", string(bytes.TrimSpace(msg)))
	c.rs.write(msg)
	c.rs.write([]byte("data: [DONE]\n\n"))
	_ = c.rs.rc.Flush()
}
