// Package doctor checks an engine the way `kvrouter serve` will use it and
// says, in plain words, what is missing: the HTTP API serve probes and
// proxies to (/health, /v1/models, /tokenize), the KV events of every
// data-parallel rank (arriving, decodable, with the router's block size),
// the replay endpoint, and the load metrics that some routing modes and the
// agent read from /metrics.
//
// It reuses the router's own adapters (zmqevents for the sockets,
// vllmevents for the payloads, enginemetrics for the metric names), so a
// check that passes here passes for serve. Each check is a line with a
// status (ok, warn, fail) and, unless ok, what to change.
//
// An idle engine publishes nothing: events appear only when its cache
// changes. Config.Probe sends one small completion, with a fresh prompt
// longer than any usual block size, once every rank's subscription is in
// place, so that the engine stores new blocks while doctor watches.
package doctor

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"math/rand/v2"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/kvrouter/kvrouter/adapters/enginemetrics"
	"github.com/kvrouter/kvrouter/adapters/enginesource"
	"github.com/kvrouter/kvrouter/adapters/vllmevents"
	"github.com/kvrouter/kvrouter/adapters/zmqevents"
	"github.com/kvrouter/kvrouter/core/kv"
)

// Defaults of Config's zero values.
const (
	DefaultWindow        = 5 * time.Second
	DefaultHTTPTimeout   = 5 * time.Second
	DefaultReplayTimeout = 2 * time.Second
)

// subscriptionSettle is how long the probe waits after the subscriptions
// were sent, for the publishers to register them.
const subscriptionSettle = 100 * time.Millisecond

// maxBody bounds what doctor reads of any HTTP answer: a broken engine
// should not exhaust the memory of the tool diagnosing it.
const maxBody = enginemetrics.MaxBodyBytes

// Engine is one engine as `serve --worker` describes it.
type Engine struct {
	Name   string
	URL    string // HTTP base
	Events string // rank 0's PUB endpoint; rank r publishes on port + r
	Replay string // rank 0's replay endpoint, "" if none
	Model  string // the model serve will route to it, "" if not given
	DPSize int    // data-parallel ranks; 0 means 1
}

// Config says what to check and how long to watch.
type Config struct {
	Engines []Engine
	// Window is how long each rank's events are watched; 0 means
	// DefaultWindow.
	Window time.Duration
	// Probe sends one small completion so that an idle engine publishes.
	Probe bool
	// NoEvents is serve's --no-router-kv-events: routing predicts the
	// caches from its own decisions, so engines need not publish and
	// their events are not checked.
	NoEvents bool
	// BlockSize is the router's --kv-cache-block-size; 0 leaves the
	// events' block size unchecked against it.
	BlockSize int
	// HTTPTimeout bounds each HTTP request (the probe's completion
	// included); 0 means DefaultHTTPTimeout.
	HTTPTimeout time.Duration
	// ReplayTimeout bounds each replay request; 0 means
	// DefaultReplayTimeout.
	ReplayTimeout time.Duration
	// MaxMessageBytes bounds one ZMQ message, as serve's
	// --zmq-max-message-bytes; 0 means the default.
	MaxMessageBytes int64
	// Logger receives the ZMQ sockets' warnings (dropped peers); nil
	// discards them.
	Logger *slog.Logger
}

// Status is a check's verdict.
type Status string

// The verdicts: ok works as serve needs it; warn works, with a loss
// (a feature, recovery, a routing mode); fail keeps serve from routing
// on the engine's cache, from routing to it at all, or from serving
// some of its requests.
const (
	OK   Status = "ok"
	Warn Status = "warn"
	Fail Status = "fail"
)

// Check is one line of the report.
type Check struct {
	Engine string `json:"engine"`
	Name   string `json:"check"`
	Status Status `json:"status"`
	Detail string `json:"detail"`
	Fix    string `json:"fix,omitempty"`
}

// Report is every check, engine after engine.
type Report struct {
	Checks []Check `json:"checks"`
}

// Count returns how many checks have status s.
func (r Report) Count(s Status) int {
	n := 0
	for _, c := range r.Checks {
		if c.Status == s {
			n++
		}
	}
	return n
}

// Find returns the first check of engine named name, if any.
func (r Report) Find(engine, name string) (Check, bool) {
	for _, c := range r.Checks {
		if c.Engine == engine && c.Name == name {
			return c, true
		}
	}
	return Check{}, false
}

// WriteText writes the report for a terminal: per engine, one line per
// check, the fix indented below it, and a summary line.
func (r Report) WriteText(w io.Writer) error {
	var b strings.Builder
	engine := ""
	for _, c := range r.Checks {
		if c.Engine != engine {
			if engine != "" {
				b.WriteByte('\n')
			}
			engine = c.Engine
			fmt.Fprintf(&b, "%s\n", engine)
		}
		fmt.Fprintf(&b, "  %-4s  %-10s %s\n", c.Status, c.Name, c.Detail)
		if c.Fix != "" {
			fmt.Fprintf(&b, "  %-4s  %-10s fix: %s\n", "", "", c.Fix)
		}
	}
	fmt.Fprintf(&b, "\n%d ok, %d warnings, %d failed\n", r.Count(OK), r.Count(Warn), r.Count(Fail))
	_, err := io.WriteString(w, b.String())
	return err
}

// Run checks every engine, all at once, and returns when each has been
// watched for the window (or ctx ends).
func Run(ctx context.Context, cfg Config) Report {
	if cfg.Window <= 0 {
		cfg.Window = DefaultWindow
	}
	if cfg.HTTPTimeout <= 0 {
		cfg.HTTPTimeout = DefaultHTTPTimeout
	}
	if cfg.ReplayTimeout <= 0 {
		cfg.ReplayTimeout = DefaultReplayTimeout
	}
	results := make([][]Check, len(cfg.Engines))
	var wg sync.WaitGroup
	for i, e := range cfg.Engines {
		wg.Go(func() {
			d := &doctor{cfg: cfg, e: e, client: &http.Client{Timeout: cfg.HTTPTimeout}}
			d.run(ctx)
			results[i] = d.checks
		})
	}
	wg.Wait()
	var r Report
	for _, cs := range results {
		r.Checks = append(r.Checks, cs...)
	}
	return r
}

// doctor checks one engine.
type doctor struct {
	cfg    Config
	e      Engine
	client *http.Client
	checks []Check

	served []string // models from /v1/models
	probed bool     // the probe completion succeeded
}

func (d *doctor) add(name string, s Status, detail, fix string) {
	d.checks = append(d.checks, Check{Engine: d.name(), Name: name, Status: s, Detail: detail, Fix: fix})
}

func (d *doctor) name() string {
	if d.e.Name != "" {
		return d.e.Name
	}
	return d.e.URL
}

func (d *doctor) run(ctx context.Context) {
	if d.e.URL == "" {
		d.add("http", Fail, "no url given", "add url=http://HOST:PORT (the engine's OpenAI server) to the worker")
	} else if d.checkHealth(ctx) {
		d.checkModels(ctx)
		d.checkTokenize(ctx)
	}
	if d.cfg.NoEvents {
		d.add("events", OK, "not checked: with --no-router-kv-events the router predicts caches from its own routing", "")
		d.checkMetrics(ctx)
		return
	}
	ranks := d.watchEvents(ctx)
	d.checkReplay(ctx, ranks)
	d.checkBlockSize(ranks)
	d.checkFields(ranks)
	ranksInMetrics := d.checkMetrics(ctx)
	d.checkRanks(ranks, ranksInMetrics)
}

// get fetches base+path, at most maxBody bytes.
func (d *doctor) get(ctx context.Context, path string) (int, []byte, error) {
	return d.do(ctx, http.MethodGet, path, nil)
}

func (d *doctor) do(ctx context.Context, method, path string, body any) (int, []byte, error) {
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return 0, nil, err
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, strings.TrimRight(d.e.URL, "/")+path, rd)
	if err != nil {
		return 0, nil, err
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := d.client.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, maxBody+1))
	if err == nil && len(b) > maxBody {
		err = fmt.Errorf("answer above %d bytes", maxBody)
	}
	return resp.StatusCode, b, err
}

// checkHealth reports whether the engine answers HTTP at all; the other
// HTTP checks are pointless otherwise.
func (d *doctor) checkHealth(ctx context.Context) bool {
	code, _, err := d.get(ctx, "/health")
	switch {
	case err != nil:
		d.add("http", Fail, fmt.Sprintf("GET %s/health: %v", d.e.URL, err),
			"start the engine, or correct url= (scheme, host, port of its OpenAI server); check that this host can reach it")
		return false
	case code == http.StatusOK:
		d.add("http", OK, "GET /health answers 200", "")
		return true
	}
	// Something answers: tell a wrong URL from an engine without /health.
	mcode, _, merr := d.get(ctx, "/v1/models")
	if merr == nil && mcode == http.StatusOK {
		d.add("http", Fail, fmt.Sprintf("GET /health answers %d, /v1/models 200", code),
			"serve puts an engine in routing only while GET /health answers 200: use a vLLM or SGLang OpenAI server, or a proxy that passes /health through")
		return true
	}
	d.add("http", Fail, fmt.Sprintf("GET /health answers %d and GET /v1/models %d: not an OpenAI-compatible engine at this URL", code, mcode),
		"url= must be the engine's OpenAI server base (e.g. http://HOST:8000), without /v1")
	return false
}

func (d *doctor) checkModels(ctx context.Context) {
	code, body, err := d.get(ctx, "/v1/models")
	if err != nil || code != http.StatusOK {
		d.add("models", Fail, fmt.Sprintf("GET /v1/models: %s", describe(code, err)),
			"serve forwards /v1/* to the engine: url= must be its OpenAI server")
		return
	}
	var list struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if err := json.Unmarshal(body, &list); err != nil {
		d.add("models", Fail, fmt.Sprintf("GET /v1/models is not an OpenAI model list: %v", err), "url= must be the engine's OpenAI server")
		return
	}
	for _, m := range list.Data {
		d.served = append(d.served, m.ID)
	}
	names := quoteList(d.served)
	switch {
	case len(d.served) == 0:
		d.add("models", Fail, "GET /v1/models lists no model", "wait until the engine has loaded its model")
	case d.e.Model == "":
		d.add("models", Warn, "serves "+names+"; the worker names no model",
			fmt.Sprintf("add model=%s to the worker, so that requests for it are routed there", d.served[0]))
	case slices.Contains(d.served, d.e.Model):
		d.add("models", OK, fmt.Sprintf("serves %s, model=%q among them", names, d.e.Model), "")
	default:
		d.add("models", Fail, fmt.Sprintf("model=%q is not served; the engine serves %s", d.e.Model, names),
			fmt.Sprintf("set model=%s (or start the engine with --served-model-name %s)", d.served[0], d.e.Model))
	}
}

// model is the name the probe and /tokenize use: a model the engine
// serves, so that a wrong model= fails one check, not three.
func (d *doctor) model() string {
	if len(d.served) == 0 || slices.Contains(d.served, d.e.Model) {
		return d.e.Model
	}
	return d.served[0]
}

// tokenizeWhy is what an engine without a usable /tokenize costs.
const tokenizeWhy = "serve hashes every text and chat prompt from the engine's /tokenize (vLLM and recent SGLang serve it) and answers them 502 when no engine of the model can tokenize; only token-id prompts (or nvext.token_data) work without it"

func (d *doctor) checkTokenize(ctx context.Context) {
	code, body, err := d.do(ctx, http.MethodPost, "/tokenize", map[string]any{"model": d.model(), "prompt": "kvrouter doctor"})
	if err == nil && code == http.StatusOK {
		var out struct {
			Tokens []int64 `json:"tokens"`
		}
		if json.Unmarshal(body, &out) == nil && len(out.Tokens) > 0 {
			d.add("tokenize", OK, fmt.Sprintf("POST /tokenize answers (%d tokens for a test prompt)", len(out.Tokens)), "")
			return
		}
		d.add("tokenize", Fail, "POST /tokenize answers 200 without a token list",
			"serve reads {\"tokens\": [...]}, as vLLM answers: "+tokenizeWhy)
		return
	}
	d.add("tokenize", Fail, fmt.Sprintf("POST /tokenize: %s", describe(code, err)), tokenizeWhy)
}

// rankWatch is what one rank's events showed.
type rankWatch struct {
	rank           int
	events, replay string
	sub            *zmqevents.Subscriber
	subErr         error

	mu         sync.Mutex
	batches    int
	undecoded  int
	counts     map[string]int // events by type
	blockSizes map[int]int    // BlockStored events by block_size
	badTokens  []string       // BlockStored whose token count does not fit its blocks
	otherGroup int
	dpRanks    map[int]int // batches by the dp rank they name
	// fields counts what serve would not honour in these events.
	fields *enginesource.Inspector

	// groups judges the KV-cache groups as the router does: otherGroup
	// counts the events of those it does not index, unhonoured those it
	// cannot honour, by field.
	groups     enginesource.GroupFilter
	unhonoured map[string]int

	stats    zmqevents.SubscriberStats
	replayed []zmqevents.Message
}

func (w *rankWatch) handle(m zmqevents.Message, live bool) {
	b, err := vllmevents.DecodeBatch(m.Payload)
	w.mu.Lock()
	defer w.mu.Unlock()
	w.fields.Apply(m.Payload)
	if err != nil {
		if live {
			w.undecoded++
		}
		return
	}
	if live {
		w.batches++
		if b.DPRank != nil {
			countBounded(w.dpRanks, *b.DPRank)
		}
	}
	w.groups.Learn(b.Events)
	for _, ev := range b.Events {
		if live {
			w.counts[ev.Type()]++
		}
		st, ok := ev.(*vllmevents.BlockStored)
		if !ok {
			continue
		}
		if v, field := w.groups.Stored(st.GroupIdx, st.KVCacheSpecKind); v != enginesource.GroupIndexed {
			w.otherGroup++
			if field != "" {
				w.unhonoured[field]++
			}
			continue
		}
		countBounded(w.blockSizes, st.BlockSize)
		if want := len(st.BlockHashes) * st.BlockSize; len(st.TokenIDs) != want && len(w.badTokens) < 3 {
			w.badTokens = append(w.badTokens, fmt.Sprintf("%d blocks of %d tokens with %d token ids", len(st.BlockHashes), st.BlockSize, len(st.TokenIDs)))
		}
	}
}

// maxDistinct bounds the distinct block sizes and dp ranks tracked per
// rank: a broken publisher may name any number of them.
const maxDistinct = 16

func countBounded(m map[int]int, k int) {
	if _, ok := m[k]; ok || len(m) < maxDistinct {
		m[k]++
	}
}

// watchEvents subscribes to every rank, sends the probe once all are
// subscribed, and collects what arrives within the window.
func (d *doctor) watchEvents(ctx context.Context) []*rankWatch {
	if d.e.Events == "" {
		d.add("events", Fail, "no events endpoint given: serve cannot see what the engine caches",
			"start the engine with KV events on ZMQ (docs/engines.md) and add events=tcp://HOST:5557 to the worker; or route without them (--no-router-kv-events)")
		return nil
	}
	dp := max(d.e.DPSize, 1)
	ranks := make([]*rankWatch, dp)
	for r := range dp {
		w := &rankWatch{rank: r, counts: map[string]int{}, blockSizes: map[int]int{}, unhonoured: map[string]int{}, dpRanks: map[int]int{},
			fields: enginesource.NewInspector(enginesource.Config{Worker: kv.Worker{DPRank: uint32(r)}})}
		ranks[r] = w
		var err error
		if w.events, err = enginesource.RankEndpoint(d.e.Events, r); err != nil {
			w.subErr = err
			continue
		}
		if w.replay, err = enginesource.RankEndpoint(d.e.Replay, r); err != nil {
			w.subErr = err
			continue
		}
		w.sub, w.subErr = zmqevents.NewSubscriber(zmqevents.SubscriberConfig{
			Endpoint:        w.events,
			Handler:         func(m zmqevents.Message) { w.handle(m, true) },
			MaxMessageBytes: d.cfg.MaxMessageBytes,
			Log:             d.cfg.Logger,
		})
	}
	window, cancel := context.WithTimeout(ctx, d.cfg.Window)
	defer cancel()
	if d.cfg.Probe {
		d.probe(window, ranks)
	}
	<-window.Done()
	for _, w := range ranks {
		if w.sub != nil {
			w.stats = w.sub.Stats()
			_ = w.sub.Close()
		}
	}
	return ranks
}

// probe waits until every rank's subscription is sent (a publisher drops
// what it publishes before: ZeroMQ's slow joiner), at most half the
// window, then sends one completion whose prompt no cache holds yet.
func (d *doctor) probe(ctx context.Context, ranks []*rankWatch) {
	if d.e.URL == "" {
		return
	}
	joined, cancel := context.WithTimeout(ctx, d.cfg.Window/2)
	defer cancel()
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for !allConnected(ranks) && joined.Err() == nil {
		select {
		case <-joined.Done():
		case <-tick.C:
		}
	}
	// The subscription is on the wire once connected; the publisher
	// registers it a moment later, on its own reader.
	settle := time.NewTimer(min(subscriptionSettle, d.cfg.Window/10))
	defer settle.Stop()
	select {
	case <-ctx.Done():
	case <-settle.C:
	}
	// A nonce first, so that even the first block is new to the engine;
	// 300 words exceed the block sizes engines use (16 to 128 tokens).
	var b strings.Builder
	fmt.Fprintf(&b, "kvrouter doctor %x:", rand.Uint64())
	for i := range 300 {
		b.WriteString(" w")
		b.WriteString(strconv.Itoa(i))
	}
	req := map[string]any{"prompt": b.String(), "max_tokens": 1}
	if m := d.model(); m != "" {
		req["model"] = m
	}
	code, _, err := d.do(ctx, http.MethodPost, "/v1/completions", req)
	if err != nil || code != http.StatusOK {
		d.add("probe", Warn, fmt.Sprintf("POST /v1/completions: %s", describe(code, err)),
			"the probe completion failed, so the engine may have had no reason to publish; send a request yourself while doctor watches")
		return
	}
	d.probed = true
	d.add("probe", OK, "sent one completion with a fresh prompt of about 300 tokens", "")
}

func allConnected(ranks []*rankWatch) bool {
	for _, w := range ranks {
		if w.sub != nil && w.sub.Stats().Connects == 0 {
			return false
		}
	}
	return true
}

func rankCheck(name string, rank, dp int) string {
	if dp == 1 {
		return name
	}
	return fmt.Sprintf("%s[%d]", name, rank)
}

func (d *doctor) checkReplay(ctx context.Context, ranks []*rankWatch) {
	dp := len(ranks)
	published := 0
	for _, w := range ranks {
		w.mu.Lock()
		if w.batches > 0 {
			published++
		}
		w.mu.Unlock()
	}
	for _, w := range ranks {
		events := rankCheck("events", w.rank, dp)
		if w.subErr != nil {
			d.add(events, Fail, w.subErr.Error(), "events= must be tcp://HOST:PORT (ranks publish on PORT + rank)")
			continue
		}
		// The replay is read first: what it holds tells a silent engine
		// from an events endpoint pointing elsewhere.
		replay := d.replay(ctx, w)
		d.reportEvents(w, events, published > 0)
		if replay.Name != "" {
			d.checks = append(d.checks, replay)
		}
	}
}

// replay asks the rank's replay endpoint for all it buffers and returns the
// check to report.
func (d *doctor) replay(ctx context.Context, w *rankWatch) Check {
	name := rankCheck("replay", w.rank, max(d.e.DPSize, 1))
	check := func(s Status, detail, fix string) Check {
		return Check{Engine: d.name(), Name: name, Status: s, Detail: detail, Fix: fix}
	}
	if w.replay == "" {
		if w.rank > 0 {
			return Check{}
		}
		return check(Warn, "no replay endpoint given: batches lost on the way (a reconnect, a slow router) cannot be fetched again, and a router started after the engine does not learn what it already caches",
			"set \"replay_endpoint\": \"tcp://*:5558\" in the engine's --kv-events-config and add replay=tcp://HOST:5558 to the worker")
	}
	rctx, cancel := context.WithTimeout(ctx, d.cfg.ReplayTimeout)
	msgs, err := zmqevents.Replay(rctx, w.replay, 0, zmqevents.ReplayConfig{MaxMessageBytes: d.cfg.MaxMessageBytes, Log: d.cfg.Logger})
	cancel()
	w.replayed = msgs
	for _, m := range msgs {
		w.handle(m, false)
	}
	switch {
	case errors.Is(err, zmqevents.ErrReplayTooLarge):
		return check(OK, fmt.Sprintf("%s answers (more than the %d batches doctor reads)", w.replay, len(msgs)), "")
	case err != nil:
		return check(Fail, fmt.Sprintf("%s did not answer within %v: %v", w.replay, d.cfg.ReplayTimeout, err),
			fmt.Sprintf("set \"replay_endpoint\": \"tcp://*:%s\" in the engine's --kv-events-config (rank r answers on that port + r), or drop replay= from the worker", portOf(w.replay)))
	}
	return check(OK, fmt.Sprintf("%s answers with %d buffered batches", w.replay, len(msgs)), "")
}

// reportEvents judges one rank's stream; othersPublished says whether any
// rank of the engine published in the window.
func (d *doctor) reportEvents(w *rankWatch, name string, othersPublished bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	secs := d.cfg.Window.Seconds()
	// Messages not of the 3-frame shape never reach the decoder.
	w.undecoded += int(w.stats.Malformed)
	switch {
	case w.batches > 0 && w.undecoded == 0 && w.stats.Gaps > 0:
		d.add(name, Warn, fmt.Sprintf("%d batches in %v on %s, with %d gaps (%d batches lost on the way)", w.batches, d.cfg.Window, w.events, w.stats.Gaps, w.stats.Missed),
			"the publisher drops batches beyond \"hwm\" of --kv-events-config, or the network loses them; serve fetches them again from replay= when the engine has a replay endpoint")
	case w.batches > 0 && w.undecoded == 0:
		d.add(name, OK, fmt.Sprintf("%d batches in %v (%.1f/s) on %s: %s", w.batches, d.cfg.Window, float64(w.batches)/secs, w.events, countsText(w.counts)), "")
	case w.batches > 0:
		d.add(name, Warn, fmt.Sprintf("%d batches decoded, %d did not (%.1f/s) on %s", w.batches, w.undecoded, float64(w.batches+w.undecoded)/secs, w.events),
			"some payloads are not vLLM's msgpack KV-event batches: the engine's version may publish a format kvrouter does not read")
	case w.undecoded > 0:
		d.add(name, Fail, fmt.Sprintf("%d messages on %s, none a KV-event batch", w.undecoded, w.events),
			"something else publishes on this port: point events= at the engine's KV-event endpoint")
	case w.stats.Connects == 0:
		d.add(name, Fail, fmt.Sprintf("could not connect to %s within %v", w.events, d.cfg.Window),
			fmt.Sprintf("check events= (host and port; rank r publishes on port + r) and that the engine binds it: \"endpoint\": \"tcp://*:%s\" in its --kv-events-config (vLLM connects instead of binding unless the host is *)", portOf(w.events)))
	case othersPublished:
		d.add(name, Warn, fmt.Sprintf("connected to %s, no batch in %v while other ranks published", w.events, d.cfg.Window),
			"a rank publishes only for the requests it serves and the probe reaches one rank: rerun under traffic to see this rank's events")
	case !d.probed:
		// An idle engine publishes nothing, so silence proves nothing
		// either way, even beside a replay buffer full of older batches.
		detail := fmt.Sprintf("connected to %s, no batch in %v: with no traffic doctor cannot tell whether the engine publishes there", w.events, d.cfg.Window)
		if len(w.replayed) > 0 {
			detail = fmt.Sprintf("connected to %s, no batch in %v; the replay endpoint holds %d from earlier traffic: with no traffic doctor cannot tell whether events= is the same engine's", w.events, d.cfg.Window, len(w.replayed))
		}
		d.add(name, Warn, detail,
			"rerun with --probe-request (one small completion that stores new blocks), or send a request while doctor watches")
	case len(w.replayed) > 0:
		d.add(name, Fail, fmt.Sprintf("connected to %s but no batch arrived in %v although a completion was sent, and the replay endpoint holds %d", w.events, d.cfg.Window, len(w.replayed)),
			"events= and replay= probably belong to different engines or ranks; check the ports (rank r: events port + r, replay port + r)")
	default:
		d.add(name, Fail, fmt.Sprintf("connected to %s, no batch in %v although a completion was sent", w.events, d.cfg.Window),
			"the engine does not publish KV events: vLLM needs --kv-events-config '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\"}' and prefix caching on; SGLang --kv-events-config '{\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\"}' (docs/engines.md)")
	}
}

func countsText(counts map[string]int) string {
	var parts []string
	for _, t := range []string{vllmevents.TypeBlockStored, vllmevents.TypeBlockRemoved, vllmevents.TypeAllBlocksCleared} {
		if counts[t] > 0 {
			parts = append(parts, fmt.Sprintf("%d %s", counts[t], t))
		}
	}
	if len(parts) == 0 {
		return "no events"
	}
	return strings.Join(parts, ", ")
}

func (d *doctor) checkBlockSize(ranks []*rankWatch) {
	if len(ranks) == 0 {
		return
	}
	sizes := map[int]int{}
	var bad []string
	other := 0
	indexed := ""
	unhonoured := map[string]int{}
	for _, w := range ranks {
		w.mu.Lock()
		for s, n := range w.blockSizes {
			sizes[s] += n
		}
		bad = append(bad, w.badTokens...)
		other += w.otherGroup
		if g, kind, ok := w.groups.Indexed(); ok && indexed == "" {
			indexed = fmt.Sprintf("group %d (%s)", g, kind)
		}
		for f, n := range w.unhonoured {
			unhonoured[f] += n
		}
		w.mu.Unlock()
	}
	keys := make([]int, 0, len(sizes))
	for s := range sizes {
		keys = append(keys, s)
	}
	slices.Sort(keys)
	note := ""
	if other > 0 {
		note = fmt.Sprintf(" (%d events of other KV-cache groups, which the router skips", other)
		if indexed != "" {
			note += "; it indexes " + indexed
		}
		if len(unhonoured) > 0 && len(keys) > 0 {
			note += "; not honoured: " + strings.Join(slices.Sorted(maps.Keys(unhonoured)), ", ")
		}
		note += ")"
	}
	switch {
	case len(keys) == 0 && len(unhonoured) > 0:
		d.add("block_size", Fail, "no KV-cache group the router can index, only "+strings.Join(slices.Sorted(maps.Keys(unhonoured)), ", ")+note,
			"the router matches prefixes on a full-attention group (docs/engines.md, Hybrid models); route this engine without KV events (--no-router-kv-events)")
	case len(keys) == 0:
		d.add("block_size", Warn, "no BlockStored event seen: the block size is not checked"+note,
			"rerun with --probe-request, or while the engine serves requests")
	case len(bad) > 0:
		d.add("block_size", Fail, "BlockStored token ids do not fit their blocks: "+strings.Join(bad, "; "),
			"the engine's events are not usable for hashing; check its version against docs/engines.md")
	case len(keys) > 1:
		d.add("block_size", Fail, fmt.Sprintf("events carry several block sizes %v", keys),
			"give every engine and rank the same --block-size (SGLang: --page-size)")
	case d.cfg.BlockSize > 0 && keys[0] != d.cfg.BlockSize:
		// The router learns the engine's size from these events and
		// matches it with hashes of that size: routing stays exact, each
		// request is hashed once more per extra size, and overlap is
		// counted in whole router blocks.
		d.add("block_size", Warn, fmt.Sprintf("events carry %d-token blocks, the router uses %d: it will learn the engine's size and hash requests once more for it (kvrouter_worker_block_size_mismatch)%s", keys[0], d.cfg.BlockSize, note),
			fmt.Sprintf("for one hash per request, start serve with --kv-cache-block-size %d, or the engine with --block-size %d (SGLang: --page-size %d)", keys[0], d.cfg.BlockSize, d.cfg.BlockSize))
	case d.cfg.BlockSize > 0:
		d.add("block_size", OK, fmt.Sprintf("events carry %d-token blocks, as the router's --kv-cache-block-size%s", keys[0], note), "")
	default:
		d.add("block_size", OK, fmt.Sprintf("events carry %d-token blocks: start serve with --kv-cache-block-size %d%s", keys[0], keys[0], note), "")
	}
}

// checkFields reports what the events seen (live and replayed) carried
// that serve would not honour, counted by the code serve counts it with.
func (d *doctor) checkFields(ranks []*rankWatch) {
	counts := map[string]uint64{}
	seen := 0
	for _, w := range ranks {
		w.mu.Lock()
		for field, n := range w.fields.Unsupported() {
			counts[field] += n
		}
		seen += w.counts[vllmevents.TypeBlockStored] + len(w.replayed)
		w.mu.Unlock()
	}
	if len(counts) == 0 {
		if seen > 0 {
			d.add("kv_fields", OK, "the router honours every field of the events seen", "")
		}
		return
	}
	parts := make([]string, 0, len(counts))
	for _, field := range slices.Sorted(maps.Keys(counts)) {
		parts = append(parts, fmt.Sprintf("%s (%d)", field, counts[field]))
	}
	d.add("kv_fields", Warn, "events carry what the router does not honour, and routes without: "+strings.Join(parts, ", "),
		"docs/engines.md says what kvrouter does with each field and which engine settings send it; serve counts them in kvrouter_worker_kv_events_unsupported_total and lists them in /health")
}

// checkMetrics reports the load metrics kvrouter reads and returns the dp
// ranks /metrics names (nil when it could not be read).
func (d *doctor) checkMetrics(ctx context.Context) map[int]bool {
	if d.e.URL == "" {
		return nil
	}
	code, body, err := d.get(ctx, "/metrics")
	const why = "kvrouter reads them in the modes llm-d-precise and gie-approx-prefix, for --active-decode-blocks-threshold, and in the agent's load reports"
	if err != nil || code != http.StatusOK {
		d.add("metrics", Warn, fmt.Sprintf("GET /metrics: %s", describe(code, err)), "serve vLLM's Prometheus metrics on /metrics: "+why)
		return nil
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(bytes.NewReader(body))
	if err != nil {
		d.add("metrics", Warn, fmt.Sprintf("GET /metrics is not a Prometheus text exposition: %v", err), "")
		return nil
	}
	var found, missing []string
	for _, name := range []string{enginemetrics.MetricWaiting, enginemetrics.MetricRunning, enginemetrics.MetricKVUsage} {
		if families[name] != nil || (name == enginemetrics.MetricKVUsage && families[enginemetrics.MetricKVUsageOld] != nil) {
			found = append(found, name)
		} else {
			missing = append(missing, name)
		}
	}
	samples, perr := enginemetrics.Parse(bytes.NewReader(body))
	switch {
	case perr != nil:
		d.add("metrics", Warn, fmt.Sprintf("found %s but cannot use them: %v", strings.Join(found, ", "), perr), "")
	case len(missing) > 0:
		d.add("metrics", Warn, fmt.Sprintf("found %d of kvrouter's load metrics; missing %s", len(found), strings.Join(missing, ", ")),
			"these are vLLM's names ("+why+"); other engines' metrics are not read, routing in kv mode does not need them")
	default:
		d.add("metrics", OK, "found "+strings.Join(found, ", "), "")
	}
	if perr != nil || len(samples) == 0 {
		return nil
	}
	ranks := map[int]bool{}
	for r := range samples {
		ranks[r] = true
	}
	return ranks
}

// checkRanks compares the dp size given with the ranks the events and the
// metrics name.
func (d *doctor) checkRanks(ranks []*rankWatch, inMetrics map[int]bool) {
	if len(ranks) == 0 {
		return
	}
	dp := len(ranks)
	var wrong []string
	var seen []int
	for _, w := range ranks {
		w.mu.Lock()
		for r := range w.dpRanks {
			if r != w.rank {
				wrong = append(wrong, fmt.Sprintf("%s carries rank %d", w.events, r))
			}
		}
		if w.batches > 0 {
			seen = append(seen, w.rank)
		}
		w.mu.Unlock()
	}
	extra := 0
	for r := range inMetrics {
		if r >= dp {
			extra = max(extra, r+1)
		}
	}
	switch {
	case len(wrong) > 0:
		d.add("dp_ranks", Fail, strings.Join(wrong, "; ")+": the rank in the events overrides the port's",
			"give every rank its own port: the engine's endpoint is its base port, rank r publishes on base + r")
	case extra > 0:
		d.add("dp_ranks", Fail, fmt.Sprintf("/metrics names %d data-parallel ranks, the worker dp=%d", extra, dp),
			fmt.Sprintf("set dp=%d on the worker (dp_size in --config), so that every rank's events are read", extra))
	case len(seen) == 0:
		// The events lines already say why nothing arrived.
	case len(seen) == dp:
		d.add("dp_ranks", OK, fmt.Sprintf("events from all %d rank(s) %v", dp, seen), "")
	default:
		d.add("dp_ranks", Warn, fmt.Sprintf("events from ranks %v of %d", seen, dp),
			"a rank without traffic publishes nothing; see the events lines above")
	}
}

func describe(code int, err error) string {
	if err != nil {
		return err.Error()
	}
	return "status " + strconv.Itoa(code)
}

func quoteList(names []string) string {
	q := make([]string, len(names))
	for i, n := range names {
		q[i] = strconv.Quote(n)
	}
	return strings.Join(q, ", ")
}

func portOf(endpoint string) string {
	if i := strings.LastIndexByte(endpoint, ':'); i >= 0 {
		return endpoint[i+1:]
	}
	return "PORT"
}
