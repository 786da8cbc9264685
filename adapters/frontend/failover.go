package frontend

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/core/sched"
)

// outcome is how one attempt on one engine ended.
type outcome uint8

const (
	// served: the client has its answer, or an error that ends it.
	served outcome = iota
	// unrouted: the router found no engine; nothing reached one.
	unrouted
	// unanswered: the engine failed before its response headers, so the
	// client has seen nothing of it.
	unanswered
	// cut: the engine's stream broke off after it began.
	cut
)

// errWorkerGone: the router chose an engine the registry has just let go.
var errWorkerGone = errors.New("the worker left the registry")

// connectFailure reports whether err is a failure to connect: the engine
// never saw the request.
func connectFailure(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial"
}

// refusesConnections dials the engine at baseURL once: true when it
// refuses, false when it accepts or does not answer in time (a slow engine
// is not a dead one).
func refusesConnections(ctx context.Context, baseURL string) bool {
	u, err := url.Parse(baseURL)
	if err != nil || u.Host == "" {
		return false
	}
	host := u.Host
	if u.Port() == "" {
		host = net.JoinHostPort(u.Hostname(), map[bool]string{true: "443", false: "80"}[u.Scheme == "https"])
	}
	ctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancel()
	conn, err := (&net.Dialer{}).DialContext(ctx, "tcp", host)
	if err != nil {
		return errors.Is(err, syscall.ECONNREFUSED)
	}
	conn.Close()
	return false
}

// serve routes req and forwards it, moving it to another engine when its
// engine fails it:
//
//   - an engine that fails before answering (connection refused, reset
//     before the response headers) is excluded and the request routed
//     again, whatever the migration limit: the client has seen nothing and
//     generation has no side effects. Each engine is tried once; a reset
//     (the engine may have read the request and died of it) is retried
//     only once, so a request that kills engines cannot kill them all.
//   - a stream that breaks off continues on another engine, at most
//     MigrationLimit times, from the prompt and the text generated so far.
//
// Every attempt is booked under its own id and freed when it ends.
func (c *call) serve(req *router.Request) {
	defer c.observeStream()
	ctx := c.ctx
	baseID := req.ID
	top, raw := c.top, c.body
	prompt := req.Tokens
	resets := 0
	var lastErr error
	for try := 0; ; try++ {
		if try > 0 {
			req.ID = baseID + "-" + strconv.Itoa(try)
		}
		c.id = req.ID
		c.engineOK, c.fault = false, ""
		res, err := c.attempt(req, top, raw)
		if res != served && ctx.Err() != nil {
			c.stopped()
			return
		}
		c.judge(res, err)
		switch res {
		case served:
			return
		case unrouted:
			if lastErr == nil {
				c.fail(routeError(err, c.model))
			} else {
				c.giveUp(lastErr)
			}
			return
		case unanswered:
			lastErr = fmt.Errorf("engine %s unreachable: %w", c.worker.Name, err)
			c.f.log.Warn("engine failed before answering", "worker", c.worker.Name, "request", c.id, "err", err)
			switch {
			case connectFailure(err):
				if c.f.cfg.EngineRefused != nil {
					c.f.cfg.EngineRefused(c.worker.ID)
				}
			case errors.Is(err, errWorkerGone):
			default:
				// A reset often comes from a pooled connection the engine
				// closed as it died; whether it is gone only a fresh
				// connection tells.
				if failureReason(err) == failReset && c.f.cfg.EngineRefused != nil && refusesConnections(ctx, c.worker.BaseURL) {
					c.f.cfg.EngineRefused(c.worker.ID)
				}
				if resets++; resets > 1 {
					c.giveUp(lastErr)
					return
				}
			}
			c.f.m.migrations.WithLabelValues(c.label, "new_request").Inc()
		case cut:
			lastErr = fmt.Errorf("engine %s broke off the stream: %w", c.worker.Name, err)
			c.f.log.Warn("engine stream broke", "worker", c.worker.Name, "request", c.id, "err", err)
			if c.rs.migrations >= c.f.cfg.MigrationLimit {
				c.endStream(errorEvent("engine_stream_error", "%v", lastErr))
				return
			}
			next, tokens, items, err := c.continuation(prompt, req.MM)
			if err != nil {
				c.endStream(errorEvent("engine_stream_error", "%v; it could not be continued: %v", lastErr, err))
				return
			}
			c.rs.migrations++
			c.f.m.migrations.WithLabelValues(c.label, "ongoing_request").Inc()
			top, raw, req.Tokens, req.MM = next, nil, tokens, items
		}
		req.Exclude = append(req.Exclude, c.worker.ID)
	}
}

// judge tells outlier detection how the engine of the attempt just made
// did: a client that left, or an engine the registry let go, says nothing
// of it.
func (c *call) judge(res outcome, err error) {
	if c.worker.BaseURL == "" || c.ctx.Err() != nil {
		return
	}
	switch {
	case res == unrouted:
	case res == unanswered && errors.Is(err, errWorkerGone):
	case res == unanswered:
		c.f.engineFailed(c.worker, failureReason(err), err)
	case res == cut:
		c.f.engineFailed(c.worker, failCut, err)
	case c.fault != "":
		c.f.engineFailed(c.worker, c.fault, nil)
	case c.engineOK:
		c.f.engineServed(c.worker)
	}
}

// giveUp ends the request when no engine could serve it: with the last
// engine's own error answer when it sent one.
func (c *call) giveUp(err error) {
	if c.rs != nil {
		c.endStream(errorEvent("engine_unreachable", "%v", err))
		return
	}
	if c.engineErr != nil {
		c.relayStatus(c.engineErr)
		return
	}
	c.fail(newError(http.StatusBadGateway, "server_error", "engine_unreachable", "", "%v", err))
}

// attempt books req on the engine the router chooses, forwards the
// request there and frees the booking.
func (c *call) attempt(req *router.Request, top map[string]json.RawMessage, raw []byte) (outcome, error) {
	// The prefill runs once: a decode engine that fails leaves the KV on
	// the prefill engine for the next one to pull, and a continuation's
	// prompt is not the one prefilled, so its engine computes it.
	if !c.pdTried && raw != nil && c.disaggregated() {
		c.pdTried = true
		c.pd = c.prefillRemotely(req)
		if c.pd == nil && c.f.cfg.Disagg.Enforce && c.localReason != localShortUncached && c.ctx.Err() == nil {
			c.fail(c.refusedUndisaggregated())
			return served, nil
		}
	}
	if c.ctx.Err() != nil {
		return unrouted, c.ctx.Err()
	}
	dreq := req
	if c.pd != nil && raw != nil {
		q := *req
		q.Overrides = router.RemoteDecodeOverrides(req.Overrides, c.f.cfg.Disagg.NoAssumeKVReuse)
		dreq = &q
	}
	d, err := c.f.cfg.Router.BestWorker(c.ctx, c.f.withoutEjected(dreq))
	if err != nil {
		return unrouted, err
	}
	// Booked: whatever happens from here, the load goes back.
	defer c.f.cfg.Router.Free(req.ID)
	c.decision = d
	c.f.observeDecision(c.label, poolDecode, &d, c.pd == nil || raw == nil)
	if d.Warning != "" {
		c.f.log.Warn("routing", "warning", d.Warning, "request", req.ID)
	}
	wk, ok := findWorker(c.f.cfg.Workers(), d.Worker.ID)
	if !ok {
		c.worker = Worker{ID: d.Worker.ID, Name: strconv.FormatUint(d.Worker.ID, 10)}
		return unanswered, errWorkerGone
	}
	c.worker = wk
	var body pieces
	if c.pd != nil && raw != nil {
		c.countTransfer(&d)
		body, err = decodeBody(top, wk, d.Worker.DPRank, c.pd.params)
	} else {
		body, err = engineBody(top, raw, c.members, wk, d.Worker.DPRank)
	}
	if err != nil {
		c.fail(newError(http.StatusInternalServerError, "server_error", "internal", "", "re-encoding the request: %v", err))
		return served, nil
	}
	// The engine's session opens before the session's first request
	// reaches it, and closes after the last one.
	if s := req.Session; s != nil && s.Action == sched.SessionOpen {
		c.engineSession(s)
	}
	res, err := c.forward(body)
	if s := req.Session; s != nil && s.Action == sched.SessionClose {
		c.engineSession(s)
	}
	return res, err
}

// routerOwned are the members of a client's request that no engine gets
// from the client: nvext and router_config_override are the router's,
// kv_transfer_params the router's alone to set (kvTransferKey).
var routerOwned = []string{"nvext", "router_config_override", kvTransferKey}

// engineBody is what the engine gets: the client's bytes (raw, made of
// members) less the router's members and with the routed data-parallel
// rank, spliced rather than re-encoded; a continuation (raw nil) is top
// re-encoded.
func engineBody(top map[string]json.RawMessage, raw []byte, members []member, wk Worker, rank uint32) (pieces, error) {
	if raw != nil {
		switch {
		case wk.DPSize > 1:
			return without(raw, members, append([]string{"data_parallel_rank"}, routerOwned...), []byte("data_parallel_rank"), strconv.AppendUint(nil, uint64(rank), 10)), nil
		case slices.ContainsFunc(members, func(m member) bool { return slices.Contains(routerOwned, m.key) }):
			return without(raw, members, routerOwned), nil
		}
		return pieces{raw}, nil
	}
	out := maps.Clone(top)
	for _, k := range routerOwned {
		delete(out, k)
	}
	if wk.DPSize > 1 {
		out["data_parallel_rank"] = json.RawMessage(strconv.FormatUint(uint64(rank), 10))
	}
	b, err := json.Marshal(out)
	return pieces{b}, err
}

// continuation is the request that resumes the client's broken stream on
// another engine: the original prompt followed by everything generated so
// far (for chat, as an assistant message the engine continues), with
// max_tokens reduced by what was generated. prompt is the original
// prompt's tokens. It returns the request and the tokens to route it by.
func (c *call) continuation(prompt []uint32, mm []router.MMItem) (map[string]json.RawMessage, []uint32, []router.MMItem, error) {
	rs := c.rs
	switch {
	case !rs.resumable:
		return nil, nil, nil, errors.New("the stream is not one a continuation can reproduce")
	case rs.finished:
		return nil, nil, nil, errors.New("the engine had already finished")
	}
	next := maps.Clone(c.top)
	if rs.genTokens == 0 && rs.generated.Len() == 0 {
		return next, prompt, mm, nil
	}
	for _, k := range []string{"max_tokens", "max_completion_tokens"} {
		if !present(next[k]) {
			continue
		}
		var n int
		if err := json.Unmarshal(next[k], &n); err != nil {
			return nil, nil, nil, fmt.Errorf("%s is not an integer", k)
		}
		if n -= rs.genTokens; n < 1 {
			return nil, nil, nil, errors.New("every token asked for was generated")
		}
		next[k] = json.RawMessage(strconv.Itoa(n))
	}
	return c.withAnswer(c.ctx, next, rs.generated.String(), false)
}

// withAnswer extends the request next (a copy of the call's) by the
// answer text: for chat, as an assistant message, left open for the
// engine to continue (closed false) or closed as the chat template ends a
// turn (closed true, the prefix of the next turn); for completions,
// appended to the prompt. It returns next and the tokens to route it by.
func (c *call) withAnswer(ctx context.Context, next map[string]json.RawMessage, text string, closed bool) (map[string]json.RawMessage, []uint32, []router.MMItem, error) {
	serving := c.servingNow()
	if c.ep.kind == kindChat {
		var msgs []json.RawMessage
		if err := json.Unmarshal(c.top["messages"], &msgs); err != nil {
			return nil, nil, nil, err
		}
		msg, _ := json.Marshal(map[string]string{"role": "assistant", "content": text})
		next["messages"], _ = json.Marshal(append(msgs, msg))
		next["continue_final_message"] = json.RawMessage(strconv.FormatBool(!closed))
		next["add_generation_prompt"] = json.RawMessage("false")
	} else {
		ids, prefix, ok := singlePrompt(c.top["prompt"])
		switch {
		case !ok:
			return nil, nil, nil, errors.New("a batch of prompts")
		case prefix != nil:
			next["prompt"], _ = json.Marshal(*prefix + text)
		default:
			// The answer is text, not token ids: the engine's own
			// tokenizer turns it back into ids.
			payload, _ := json.Marshal(map[string]any{"model": c.model, "prompt": text, "add_special_tokens": false})
			gen, herr := c.f.tokenize(ctx, serving, pieces{payload})
			if herr != nil {
				return nil, nil, nil, herr
			}
			next["prompt"], _ = json.Marshal(append(ids, gen...))
		}
	}
	tokens, items, herr := c.f.promptTokens(ctx, next, c.ep.kind, c.base, serving, nil)
	if herr != nil {
		return nil, nil, nil, herr
	}
	return next, tokens, items, nil
}

// servingNow returns the engines serving the call's model now: those
// holding its adapter, for an adapter.
func (c *call) servingNow() []Worker {
	if c.lora != "" {
		_, holders := adapterHolders(c.lora, c.f.cfg.Workers())
		return holders
	}
	_, serving := c.f.workersFor(c.model)
	return serving
}

// singlePrompt reads a completions prompt that is one prompt: text, token
// ids, or a list holding one of them.
func singlePrompt(raw json.RawMessage) (ids []uint32, text *string, ok bool) {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return nil, &s, true
	}
	if ids, herr := tokenIDs(raw, "prompt"); herr == nil {
		return ids, nil, true
	}
	var list []json.RawMessage
	if json.Unmarshal(raw, &list) != nil || len(list) != 1 {
		return nil, nil, false
	}
	return singlePrompt(list[0])
}

// relay is the client's side of a streamed answer, which may come from
// several engines one after the other.
type relay struct {
	w  http.ResponseWriter
	rc *http.ResponseController

	first, last time.Time
	chunks      int // data chunks relayed
	usage       int // completion tokens the engine reported, -1 until it does
	prompt      int // prompt tokens the first engine reported, -1 until it does
	engErr      bool

	engines      int // engines that streamed into it
	engineChunks int // data chunks from the current one
	migrations   int

	// What a continuation needs, kept when migration is on.
	track     bool
	resumable bool            // false once a chunk is one a continuation cannot reproduce
	finished  bool            // a finish_reason arrived
	id        json.RawMessage // the first engine's chunk id and creation time,
	created   json.RawMessage // which every later chunk takes over
	generated strings.Builder
	genTokens int
	carried   int // tokens generated by the engines before the current one
}

func newRelay(w http.ResponseWriter, track bool) *relay {
	return &relay{w: w, rc: http.NewResponseController(w), usage: -1, prompt: -1, track: track, resumable: true}
}

func (rs *relay) write(b []byte) bool {
	_, err := rs.w.Write(b)
	return err == nil
}

func (rs *relay) startEngine() {
	rs.engines++
	rs.engineChunks = 0
	rs.carried = rs.genTokens
}

// observe notes a data chunk on its way to the client and returns the
// event to send: a continuation's chunks are made to look like the first
// engine's. data is valid JSON.
func (rs *relay) observe(data, raw []byte) []byte {
	if rs.engines > 1 {
		if b, ok := rs.stitch(data); ok {
			data, raw = b, dataEvent(b)
		}
	}
	if p, g := usageOf(data); g >= 0 {
		rs.usage = g
		if rs.engines <= 1 { // a continuation's prompt is not the client's
			rs.prompt = p
		}
	}
	if rs.track && rs.resumable {
		rs.note(data)
	}
	return raw
}

// note keeps what a continuation needs of a chunk: the text of its one
// choice, whether it finished, the stream's id. It walks the chunk rather
// than decoding it, which on this per-chunk path costs no allocation.
func (rs *relay) note(data []byte) {
	gen := false
	top := members{b: data}
	for top.next() {
		switch string(top.key) {
		case "id":
			if rs.id == nil {
				rs.id = bytes.Clone(top.val)
			}
		case "created":
			if rs.created == nil {
				rs.created = bytes.Clone(top.val)
			}
		case "choices":
			choices := elements{b: top.val}
			for choices.next() {
				choice := members{b: choices.val}
				for choice.next() {
					switch string(choice.key) {
					case "index":
						if string(choice.val) != "0" {
							rs.resumable = false
						}
					case "text":
						gen = rs.keepText(choice.val) || gen
					case "delta":
						delta := members{b: choice.val}
						for delta.next() {
							if string(delta.key) == "content" {
								gen = rs.keepText(delta.val) || gen
							}
						}
					case "finish_reason":
						if len(choice.val) > 2 && choice.val[0] == '"' {
							rs.finished = true
						}
					}
				}
			}
		}
	}
	if top.err != nil || !top.object {
		rs.resumable = false
	}
	if gen {
		rs.genTokens++
	}
}

// keepText appends a JSON string value to the generated text, reporting
// whether it held any.
func (rs *relay) keepText(v []byte) bool {
	if len(v) <= 2 || v[0] != '"' {
		return false
	}
	if bytes.IndexByte(v, '\\') < 0 {
		rs.generated.Write(v[1 : len(v)-1])
		return true
	}
	var s string
	if json.Unmarshal(v, &s) != nil {
		return false
	}
	rs.generated.WriteString(s)
	return s != ""
}

// stitch rewrites a continuation's chunk as part of the first stream: its
// id and creation time, no second assistant role, and usage counting the
// tokens generated before as generated, not as prompt.
func (rs *relay) stitch(data []byte) ([]byte, bool) {
	m, err := splitObject(data)
	if err != nil {
		return nil, false
	}
	if present(rs.id) && present(m["id"]) {
		m["id"] = rs.id
	}
	if present(rs.created) && present(m["created"]) {
		m["created"] = rs.created
	}
	var choices []map[string]json.RawMessage
	if json.Unmarshal(m["choices"], &choices) == nil {
		for _, ch := range choices {
			var delta map[string]json.RawMessage
			if json.Unmarshal(ch["delta"], &delta) == nil && delta != nil {
				delete(delta, "role")
				ch["delta"], _ = json.Marshal(delta)
			}
		}
		if choices != nil {
			m["choices"], _ = json.Marshal(choices)
		}
	}
	var usage map[string]json.RawMessage
	if json.Unmarshal(m["usage"], &usage) == nil && usage != nil && rs.carried > 0 {
		var p, g int
		if json.Unmarshal(usage["prompt_tokens"], &p) == nil && json.Unmarshal(usage["completion_tokens"], &g) == nil {
			p, g = max(0, p-rs.carried), g+rs.carried
			usage["prompt_tokens"] = json.RawMessage(strconv.Itoa(p))
			usage["completion_tokens"] = json.RawMessage(strconv.Itoa(g))
			usage["total_tokens"] = json.RawMessage(strconv.Itoa(p + g))
			m["usage"], _ = json.Marshal(usage)
		}
	}
	b, err := json.Marshal(m)
	return b, err == nil
}

// dataEvent is one SSE event carrying b.
func dataEvent(b []byte) []byte {
	return append(append([]byte("data: "), b...), "\n\n"...)
}

// observeStream records a streamed answer's metrics once it has ended.
func (c *call) observeStream() {
	rs := c.rs
	if rs == nil {
		return
	}
	out := rs.chunks
	if rs.usage >= 0 {
		out = rs.usage
	}
	c.f.tokCheck.observe(c.label, c.worker.Name, c.isl, rs.prompt)
	if !rs.first.IsZero() {
		c.observeEnd(rs.first.Sub(c.start), out)
		return
	}
	c.f.m.duration.WithLabelValues(c.label).Observe(time.Since(c.start).Seconds())
}
