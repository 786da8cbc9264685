// Package frontend is kvrouter's OpenAI-compatible HTTP frontend: it
// tokenizes each request, asks the router where it should go, forwards it
// to that engine and streams the answer back, keeping the router's view of
// every engine's load in step with the request's life.
//
// # Endpoints
//
//	POST /v1/completions, POST /v1/chat/completions   OpenAI, streaming or not
//	GET  /v1/models                                   the distinct models of the workers
//	POST /router/best_worker                          {tokens|prompt|messages, model, request_id?, pool?, nvext?}
//	POST /router/potential_loads                      {tokens|prompt|messages, model}
//	POST /router/mark_prefill_complete                {request_id}
//	POST /router/free                                 {request_id}
//	GET  /router/dump_events                          the index as a JSON list of KV events, streamed, one dump at a time
//	GET  /busy_threshold, POST /busy_threshold        SPEC §6
//	POST /router/drain                                {worker_id, drained}: take an engine out of routing or back
//	GET  /ui, GET /ui/api/state                       the live dashboard and its feed (docs/dashboard.md)
//	GET  /live, GET /ready, GET /health, GET /metrics
//	GET  /debug/pprof/...                             Go's profiler, with an admin token only
//
// # Access
//
// Config.APIKey guards /v1/* as vLLM's --api-key does ("Authorization:
// Bearer <key>", compared in constant time), and every other endpoint but
// /live, /ready, /health, /metrics and the /ui page: the router API and
// the dashboard's feed take prompts or show what is cached. Config.AdminToken guards what
// changes the router's state: POST /busy_threshold, a booking
// /router/best_worker (with request_id), mark_prefill_complete, free,
// drain, pprof, and /router/dump_events (it reads out the whole index).
// It also passes /v1/*, where it lets backend_instance_id pin a request to
// a busy worker; other pins to a busy worker get 503. Both
// answer 401 in OpenAI's shape (codes invalid_api_key, invalid_admin_token).
// /health shows the engines' URLs only to the admin token's holder (to
// callers on this machine when there is none). A request that changes
// state (POST and the like) sent by a browser for another origin is
// refused with 403 (cross_origin_request), as is, without an admin token,
// one that reaches the router under a DNS name; outside /v1/* such a
// request must be application/json (415 else).
// Bookings through the router API are bounded: Config.MaxBookings at once
// (429 beyond), BookingLifetime each, and no larger than the largest
// engine's KV capacity (400).
//
// # Tokens
//
// The router needs token ids. A completions prompt of token ids (or a list
// holding one) is used as is, so is nvext.token_data; a text prompt and chat
// messages are tokenized by an engine serving the model through its
// /tokenize endpoint (vLLM and SGLang have it), chat template included, so
// the router hashes exactly what the engine will cache. The chat keys that
// change the template (chat_template, chat_template_kwargs, tools,
// add_generation_prompt, continue_final_message, add_special_tokens) are
// passed on to /tokenize. A batch of several prompts is routed by its first.
//
// A model given an in-process tokenizer (Config.Tokenizer: its
// tokenizer.json and its chat template) is
// tokenized by the frontend itself, as vLLM would: completions with special
// tokens unless add_special_tokens is false, chat messages rendered with
// add_generation_prompt (default true), tools and chat_template_kwargs,
// then encoded without special tokens unless add_special_tokens is true. A
// request naming its own chat_template, asking continue_final_message or
// passing documents goes to the engine's /tokenize, as does every prompt of
// a model without a tokenizer. /v1/models says which ("tokenizer":
// "in-process" or "engine"), and kvrouter_frontend_tokenize_total{model,
// where} counts each. A prompt the tokenizer or the template refuses
// (invalid UTF-8, a role the template rejects) is a 400.
//
// # Forwarding
//
// The body goes to the chosen engine (BaseURL + the same path) byte for
// byte, except that the "nvext" key is dropped (engines do not know it), so
// is a client's "kv_transfer_params" (only the router sets them: they
// steer an engine's KV transfers; counted in
// client_kv_transfer_params_stripped_total) and,
// when the worker has more than one data-parallel rank,
// "data_parallel_rank" is set to the routed rank (replacing the client's).
// Members the frontend keeps go on in their order and bytes, spliced from
// the client's body rather than re-encoded; so does the prompt sent to
// /tokenize: a prompt of many megabytes is held once, not copied at every
// step.
// The engine's status, headers (hop-by-hop ones aside) and body come back
// unchanged, but for the engine's kv_transfer_params, which never reach the
// client; the engine request carries X-Request-Id (the booking id) and
// the client's Accept. Server-sent events are passed on as they arrive, flushed
// whenever the engine has nothing more buffered.
//
// Each request is booked in the router under a fresh id. Its prefill is
// marked complete at the first SSE data chunk (or when a non-streamed answer
// is complete) and it is freed exactly once when the handler ends, whatever
// the reason: end of stream, engine error, malformed engine stream, client
// disconnect.
//
// A stream that breaks — a data line that is not JSON, a line that is not
// SSE, an event over 1 MiB, or the engine closing before "data: [DONE]" —
// ends the client's stream with one event "data: {"error": {...}}"
// followed by "data: [DONE]". An engine that answers a streamed request
// with anything but an event stream gets the client a 502. The engine's
// Server header is not relayed, and what the client is told of an engine's
// failure names the engine, not addresses or sockets (the log has those).
//
// # Failover
//
// An engine that fails a request before the client has seen anything of
// it — connection refused or reset, no response headers within
// Config.HeaderTimeout (streams) or Config.ResponseTimeout (non-streamed
// answers, whose headers come with the last token), an error status of
// 500 or more, a stream that breaks or is malformed before its first
// event — is excluded and the request routed again
// (router.Request.Exclude), whatever the migration limit: the client's
// stream opens only with the engine's first event. Each engine is tried
// once; every failure but a refusal only once (the engine may have died
// of the request itself). When no engine serves the request, the client
// gets the last engine's own error answer if it sent one, else a 502. A
// refused connection is reported through Config.EngineRefused, for the
// registry to drop the engine at once.
//
// Engines that keep failing (package outlier: Config.Outlier) are
// ejected, left out of every routing decision (the router API's too, pins
// aside) for a time that grows with each ejection; /health lists each
// ejection (reason, since, until) and marks the router degraded, and
// kvrouter_worker_ejections_total{worker_id} and kvrouter_workers_ejected
// count them. A prefill engine is held to Config.HeaderTimeout too (or
// Disagg.PrefillTimeout, if shorter) and ejected likewise; its requests
// are then prefilled on their decode engine. A stream whose engine goes away mid-way (the stream ends
// or breaks before [DONE], not a malformed one) continues on another
// engine up to Config.MigrationLimit times, as Dynamo's request migration:
// the continuation is the original request with the text generated so far
// appended (completions: to the prompt; a token-id prompt gets the ids the
// engine's /tokenize gives that text; chat: as a final assistant message
// with continue_final_message) and max_tokens / max_completion_tokens
// reduced by the chunks that carried text. Its chunks take the first
// stream's id and created, lose the repeated assistant role, and its usage
// counts the earlier tokens as generated. Streams with several choices, or
// that already had a finish_reason, are not continued. Each attempt is
// booked under its own id ("<id>-<n>") and freed when it ends.
//
// A stream cut by Abort (a drain that ran out of time) ends with an error
// event of code "shutting_down" and "data: [DONE]": it is over, not broken
// off.
//
// # Disaggregated serving
//
// A model whose workers include prefill workers (router.RolePrefill) and
// decode-capable ones is served disaggregated: each request is prefilled on a
// prefill worker and decoded on a decode worker, over vLLM's
// kv_transfer_params protocol; see Disagg. When the last prefill worker
// leaves, the model is served aggregated again. /router/best_worker with
// "pool": "prefill" routes among the prefill workers.
//
// # nvext
//
// The nvext object of a request (SPEC §7, Dynamo's names) is read as:
//
//	backend_instance_id (alias decode_worker_id, header x-worker-instance-id), dp_rank → Request.Target
//	prefill_worker_id, prefill_dp_rank → the prefill worker of a disaggregated request
//	agent_hints {priority, strict_priority, osl}                → Request.Priority, StrictPriority, OSL
//	session_control {session_id, action, timeout (s)}          → Request.Session; "open" and
//	  "close" also call the engine's session API (SGLang's /open_session before the
//	  request, /close_session after it); an engine answering 404 is bound in the router only
//	token_data                                                  → the prompt's token ids
//	router overrides → Request.Overrides, in the body's top-level router_config_override, at
//	nvext's top level, in nvext.router_config_override or in nvext.agent_hints (the later
//	wins); each knob under any of its names:
//	  overlap credit:     overlap_score_credit, kv_overlap_score_credit, router_kv_overlap_score_credit
//	  prefill load scale: prefill_load_scale, router_prefill_load_scale
//	  cache affinity:     cache_affinity, router_cache_affinity (kvrouter's own)
//	  legacy weight:      overlap_score_weight, kv_overlap_score_weight, router_kv_overlap_score_weight
//	  temperature:        router_temperature
//	  reuse assumption:   assume_kv_reuse, router_assume_kv_reuse
//	  prefill tracking:   track_prefill_tokens, router_track_prefill_tokens
//	  shared cache:       shared_cache_multiplier
//	extra_fields ["worker_id", "timing"]
//
// extra_fields adds an "nvext" object to the response:
//
//	{"worker_id": 3, "dp_rank": 0, "overlap_blocks": 4, "prompt_blocks": 6,   (for "worker_id")
//	 "timing": {"read_ms", "tokenize_ms", "routing_ms", "queue_ms", "hash_ms",
//	            "find_matches_ms", "scheduling_ms", "frontend_ms", "ttft_ms",
//	            "total_ms"}}  (for "timing"; frontend_ms: held before the engine,
//	                          read_ms: the part of it spent reading the body)
//
// at the top level of a non-streamed JSON response, and in the first data
// chunk of a stream (where total_ms is absent: the stream is not over).
// Without extra_fields the engine's bytes are untouched.
//
// # Errors
//
// Errors the frontend raises itself use OpenAI's shape {"error": {"message",
// "type", "param", "code"}} with a string code, and messages name the
// request's fields ("nvext.agent_hints.osl must be an integer, got a
// string"): malformed JSON, missing prompt or messages, bad nvext, an
// over-long session id or request_id → 400; a missing or wrong API key or
// admin token → 401; unknown model → 404; a known path with another method
// → 405 with Allow; a request_id already booked (router API) → 409; body
// over MaxBodyBytes → 413; a new session when the router holds its maximum,
// or too many bookings → 429; every worker busy or none serving the model →
// 503; more than MaxConcurrentRequests, or bodies beyond
// MaxInflightBodyBytes, at once → 503 "overloaded" with Retry-After; a
// request cut by a drain → 503 "shutting_down"; engine unreachable or
// tokenization failing on the engine's side → 502. Engines' own errors pass
// through, their numeric code (vLLM's) turned into a string.
//
// The router API answers: best_worker {worker_id, dp_rank, overlap_blocks,
// prompt_blocks, request_id (when booked), via, timing}; potential_loads a
// list of {worker_id, dp_rank, overlap_blocks, active_decode_blocks,
// active_prefill_tokens, active_requests, potential_decode_blocks,
// potential_prefill_tokens}; mark_prefill_complete and free {request_id,
// found}. GET /busy_threshold answers {"thresholds": [...]}, POST the
// model's thresholds now in force (a field given as null is switched off,
// an absent one kept).
//
// # Probes
//
// /live is always 200. /ready is 200 when, not draining, every model of
// Config.Models has an engine known to the router, else 503 with reasons.
// /health is "unavailable" (503) when not ready, "degraded" (200) when an
// engine is not known to the router, has sent no KV event in the grace
// period while serving (its kv_events entry says so), or a dependency is
// not ok, else "ok", with the reasons, the workers and the dependencies.
//
// # Metrics
//
// Prefix kvrouter_frontend_: requests_total{model,endpoint,status} (status is
// the HTTP status, or "stream_error" / "cancelled" for streams that broke or
// whose client left), inflight_requests{model},
// time_to_first_token_seconds, inter_token_latency_seconds (between data
// chunks), request_duration_seconds, input_sequence_tokens,
// output_sequence_tokens, kv_hit_rate (histograms by model), and
// routing_overhead_seconds{phase=hash|find_matches|scheduling|queue|total},
// model_migration_total{model,migration_type=new_request|ongoing_request}
// (Dynamo's name: requests moved before their engine answered, streams
// continued elsewhere);
// plus the router's own collector (adapters/metrics).
package frontend

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvrouter/kvrouter/adapters/metrics"
	"github.com/kvrouter/kvrouter/adapters/modeltok"
	"github.com/kvrouter/kvrouter/core/outlier"
	"github.com/kvrouter/kvrouter/core/router"
)

// DefaultMaxBodyBytes bounds a request body when Config.MaxBodyBytes is 0.
const DefaultMaxBodyBytes = 16 << 20

// Worker is one engine as the frontend reaches it.
type Worker struct {
	ID      uint64 // the router's worker id
	Name    string
	BaseURL string // e.g. http://10.0.0.7:8000, no trailing /v1
	Model   string // "" serves every model
	DPSize  int    // data-parallel ranks; > 1 makes the frontend set data_parallel_rank
	// Events is rank 0's KV-event endpoint, "" when unknown: fix texts name
	// its port.
	Events string
	// Adapters are the LoRA adapters the engine has loaded (its
	// /v1/models entries with a parent).
	Adapters []string
}

// Config configures a Frontend.
type Config struct {
	Router *router.Router
	// Workers returns the current registry. Whoever adds and removes
	// engines also calls Router.AddWorker / RemoveWorker.
	Workers func() []Worker
	// Client reaches the engines; nil uses a client without a timeout
	// (streams last as long as they last) over a pooled transport.
	Client *http.Client
	// MaxBodyBytes bounds request bodies (413 beyond); 0 means
	// DefaultMaxBodyBytes.
	MaxBodyBytes int64
	// Registry receives the frontend's metrics and the router's collector,
	// and is served on /metrics; nil makes a new one.
	Registry *prometheus.Registry
	Logger   *slog.Logger
	// MaxConcurrentRequests, when > 0, is how many requests (besides the
	// probes, /metrics and /ui) are served at once; more are answered 503 with
	// Retry-After.
	MaxConcurrentRequests int
	// MaxInflightBodyBytes, when > 0, bounds the request bodies (by their
	// Content-Length) held at once; a request that would exceed it is
	// answered 503 with Retry-After, unless it is the only one.
	MaxInflightBodyBytes int64
	// WriteTimeout, when > 0, bounds the writing of a non-streamed
	// response, from its first byte; streams are not bounded.
	WriteTimeout time.Duration
	// AfterBurst, optional, is called when the last of a burst of large
	// request bodies (64 MiB or more in flight at once) has been served,
	// so that the process can hand the memory back.
	AfterBurst func()
	// Dependencies, optional, reports the state of what the frontend
	// relies on besides the engines (e.g. "nats": "ok"); any value other
	// than "ok" makes /health "degraded" while requests are still served.
	Dependencies func() map[string]string
	// MigrationLimit is how many times a stream that breaks off may be
	// continued on another engine (Dynamo's --migration-limit); 0 ends it
	// with an error event.
	MigrationLimit int
	// EngineRefused, optional, hears of an engine that refused a
	// connection: the registry's owner should take it out of routing at
	// once, until its health probe answers again.
	EngineRefused func(workerID uint64)
	// Models, optional, lists the models the frontend is meant to serve,
	// engines in routing or not; /ready waits for an engine of each. nil
	// takes the models of Workers.
	Models func() []string
	// APIKey, when set, is required on /v1/* as "Authorization: Bearer
	// <key>" (vLLM's --api-key).
	APIKey string
	// AdminToken, when set, is required the same way on every endpoint
	// that changes the router's state (booking /router/best_worker,
	// mark_prefill_complete, free, POST /busy_threshold) and on
	// /debug/pprof/. On /v1/* it stands for the API key and lets
	// nvext.backend_instance_id pin a request to a busy worker.
	AdminToken string
	// MaxBookings bounds the requests booked through /router/best_worker
	// and not yet freed (429 beyond); 0 means DefaultMaxBookings.
	MaxBookings int
	// Disagg configures disaggregated prefill/decode serving, in force for
	// the models that have prefill workers.
	Disagg Disagg
	// Tokenizer, optional, returns the in-process tokenizer of a model, or
	// nil: that model's text and chat prompts are then tokenized by an
	// engine's /tokenize.
	Tokenizer func(model string) *modeltok.Model
	// MMPlaceholders is the placeholder token id of each modality ("image",
	// "audio", "video") of the models served, where a model's in-process
	// tokenizer does not name its own (config.json): where a chat's media
	// items are in its prompt. Without one, a chat with media of that
	// modality is matched only up to its first placeholder, or not at all.
	MMPlaceholders map[string]uint32
	// Engines, optional, lists every configured engine with its state for
	// the dashboard (/ui); nil shows the engines of Workers.
	Engines func() []EngineStatus
	// SetDrained, optional, takes an engine out of routing (true) until
	// it is re-admitted (false), for POST /router/drain; it returns
	// ErrUnknownEngine for an id no engine has. nil answers 501.
	SetDrained func(id uint64, drained bool) error
	// DynamoMetricNames also exports the metrics Dynamo has under Dynamo's
	// names (DynamoMetricNames), for dashboards built for Dynamo.
	DynamoMetricNames bool
	// StrictNvext answers a request whose nvext (or router_config_override)
	// has a key neither kvrouter nor Dynamo knows with 400; otherwise it is
	// served with an X-Kvrouter-Warning header naming the key.
	StrictNvext bool
	// UIDecisionsPerSecond bounds the decisions the dashboard is sent;
	// 0 means DefaultUIDecisionsPerSecond.
	UIDecisionsPerSecond int
	// HeaderTimeout bounds the wait for an engine's response headers on a
	// streamed request, and for a prefill engine's answer; 0 means
	// DefaultHeaderTimeout, a negative value no bound.
	HeaderTimeout time.Duration
	// ResponseTimeout bounds the wait for the headers of a non-streamed
	// answer, which engines send with its last token; 0 means
	// DefaultResponseTimeout, a negative value no bound.
	ResponseTimeout time.Duration
	// Outlier configures the ejection of engines that keep failing
	// requests (see package outlier); zero fields take its defaults.
	Outlier outlier.Config
	// LoRA configures the serving and loading of LoRA adapters.
	LoRA LoRA
	// MinInitialWorkers, when > 0, holds routing (requests answered 503
	// with Retry-After, /ready 503) until this many engines have been in
	// routing at once, so that the first requests are not all sent to the
	// first engine to come up (Dynamo's --router-min-initial-workers).
	MinInitialWorkers int
}

// DefaultMaxBookings is Config.MaxBookings' default.
const DefaultMaxBookings = 1024

// Frontend serves the HTTP API. Build it with New.
type Frontend struct {
	cfg     Config
	log     *slog.Logger
	m       *frontendMetrics
	dm      *disaggMetrics
	created int64
	idBase  string
	nextID  atomic.Uint64
	tokRR   atomic.Uint64 // rotates the engine asked to tokenize

	apiKey, admin secret
	bookings      *bookings

	draining atomic.Bool
	// anyNext turns the picks of requests the router does not route.
	anyNext atomic.Uint64
	// aborted ends every request still in flight when a drain times out.
	aborted context.Context
	abort   context.CancelFunc

	// inflight counts the requests admitted under MaxConcurrentRequests.
	inflight    atomic.Int64
	bodyBytes   atomic.Int64 // Content-Length of the requests in flight
	largeBodies bodyBurst
	dumping     atomic.Bool // a /router/dump_events answer is being streamed
	labels      modelLabels // the models metrics may label with (modelLabel)

	ui *ui // the dashboard's feed

	outliers *outlier.Detector
	om       *outlierMetrics
	tokCheck *tokenizerCheck
	loras    loraLoads
	sessions engineSessions
	// initialReached: MinInitialWorkers engines have been in routing.
	initialReached atomic.Bool
	// speculative holds a token per speculative prefill in flight.
	speculative chan struct{}
}

// New checks cfg and registers the metrics.
func New(cfg Config) (*Frontend, error) {
	if cfg.Router == nil {
		return nil, errors.New("frontend: Config.Router is required")
	}
	if cfg.Workers == nil {
		return nil, errors.New("frontend: Config.Workers is required")
	}
	if cfg.Client == nil {
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.MaxIdleConns = 1024
		tr.MaxIdleConnsPerHost = 256
		tr.DialContext = (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext
		cfg.Client = &http.Client{Transport: tr}
	}
	if cfg.MaxBodyBytes <= 0 {
		cfg.MaxBodyBytes = DefaultMaxBodyBytes
	}
	if cfg.Registry == nil {
		cfg.Registry = prometheus.NewRegistry()
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	switch {
	case cfg.HeaderTimeout == 0:
		cfg.HeaderTimeout = DefaultHeaderTimeout
	case cfg.HeaderTimeout < 0:
		cfg.HeaderTimeout = 0
	}
	switch {
	case cfg.ResponseTimeout == 0:
		cfg.ResponseTimeout = DefaultResponseTimeout
	case cfg.ResponseTimeout < 0:
		cfg.ResponseTimeout = 0
	}
	if err := cfg.Outlier.Validate(); err != nil {
		return nil, fmt.Errorf("frontend: %w", err)
	}
	outliers := outlier.New(cfg.Outlier)
	m := newFrontendMetrics()
	dm := newDisaggMetrics(latencyBuckets)
	om := newOutlierMetrics(outliers)
	tc := newTokenizerCheck(cfg.Logger)
	cs := slices.Concat(m.collectors(), dm.collectors(), om.collectors(), tc.collectors(), []prometheus.Collector{metrics.NewCollector(cfg.Router), metrics.NewKVEventsCollector(cfg.Router)})
	for _, c := range cs {
		if err := cfg.Registry.Register(c); err != nil {
			return nil, err
		}
	}
	if cfg.MaxBookings <= 0 {
		cfg.MaxBookings = DefaultMaxBookings
	}
	var salt [6]byte
	_, _ = rand.Read(salt[:])
	aborted, abort := context.WithCancel(context.Background())
	f := &Frontend{
		cfg: cfg, log: cfg.Logger, m: m, dm: dm, tokCheck: tc, created: time.Now().Unix(),
		idBase: "kvr-" + hex.EncodeToString(salt[:]) + "-",
		apiKey: newSecret(cfg.APIKey), admin: newSecret(cfg.AdminToken),
		bookings: newBookings(cfg.MaxBookings),
		aborted:  aborted, abort: abort,
		outliers: outliers, om: om,
		speculative: make(chan struct{}, maxSpeculative),
	}
	f.ui = newUI(f, cfg.UIDecisionsPerSecond)
	return f, nil
}

// metricsHandler serves the registry, and Dynamo's names beside
// kvrouter's under Config.DynamoMetricNames.
func (f *Frontend) metricsHandler() http.Handler {
	var g prometheus.Gatherer = f.cfg.Registry
	if f.cfg.DynamoMetricNames {
		g = dynamoNames{g}
	}
	return promhttp.HandlerFor(g, promhttp.HandlerOpts{Registry: f.cfg.Registry})
}

// Handler routes every endpoint. A known path asked with another method is
// answered 405 with an Allow header, in OpenAI's error shape like every
// other error.
func (f *Frontend) Handler() http.Handler {
	routes := []struct {
		method, path string
		h            http.HandlerFunc
	}{
		{"POST", "/v1/completions", func(w http.ResponseWriter, r *http.Request) { f.serveOpenAI(w, r, endpointCompletions) }},
		{"POST", "/v1/chat/completions", func(w http.ResponseWriter, r *http.Request) { f.serveOpenAI(w, r, endpointChat) }},
		{"GET", "/v1/models", f.models},
		{"POST", "/router/best_worker", f.bestWorker},
		{"POST", "/router/potential_loads", f.potentialLoads},
		// Dynamo's KvPushRouter method names of the same calls.
		{"POST", "/router/best_worker_id", f.bestWorker},
		{"POST", "/router/get_potential_loads", f.potentialLoads},
		{"POST", "/router/mark_prefill_complete", f.adminOnly(f.markPrefillComplete)},
		{"POST", "/router/free", f.adminOnly(f.free)},
		{"GET", "/router/dump_events", f.adminOnly(f.dumpEvents)},
		{"GET", "/busy_threshold", f.listThresholds},
		{"POST", "/busy_threshold", f.adminOnly(f.postThreshold)},
		{"POST", "/router/drain", f.adminOnly(f.drainWorker)},
		{"GET", "/ui", f.servePage},
		{"GET", "/ui/api/state", f.uiState},
		{"GET", "/health", f.health},
		{"GET", "/live", f.live},
		{"GET", "/ready", f.ready},
		{"GET", "/metrics", f.limitScrapes(f.metricsHandler())},
	}
	mux := http.NewServeMux()
	allowed := map[string][]string{}
	for _, rt := range routes {
		h := rt.h
		if rt.method != "GET" && !strings.HasPrefix(rt.path, "/v1/") {
			h = jsonOnly(h)
		}
		mux.HandleFunc(rt.method+" "+rt.path, h)
		if rt.method == "GET" && !slices.Contains(allowed[rt.path], "HEAD") {
			allowed[rt.path] = append(allowed[rt.path], "GET", "HEAD")
		} else {
			allowed[rt.path] = append(allowed[rt.path], rt.method)
		}
	}
	for path, methods := range allowed {
		allow := strings.Join(methods, ", ")
		mux.HandleFunc(path, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Allow", allow)
			writeError(w, http.StatusMethodNotAllowed, "invalid_request_error", "method_not_allowed", "", "%s %s is not served; use %s", r.Method, r.URL.Path, allow)
		})
	}
	f.handlePprof(mux)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, http.StatusNotFound, "invalid_request_error", "not_found", "", "no route for %s %s", r.Method, r.URL.Path)
	})
	return f.guard(f.limit(mux))
}

// Drain turns /ready (and /health) to 503 while requests are still served:
// the first step of a graceful stop.
func (f *Frontend) Drain() { f.draining.Store(true) }

// Abort ends every request still in flight: streams with an error event
// and "data: [DONE]", the others with 503. The last step of a drain that
// ran out of time.
func (f *Frontend) Abort() { f.abort() }

// errShuttingDown is why requests cut by Abort end.
var errShuttingDown = errors.New("kvrouter is shutting down")

// requestContext is the request's context, also ended by Abort.
func (f *Frontend) requestContext(r *http.Request) (context.Context, func()) {
	ctx, cancel := context.WithCancelCause(r.Context())
	stop := context.AfterFunc(f.aborted, func() { cancel(errShuttingDown) })
	return ctx, func() {
		stop()
		cancel(nil)
	}
}

// newID is a booking id unique to this process (and, by its random part,
// unlikely to meet one a client picks for /router/best_worker).
func (f *Frontend) newID() string {
	return f.idBase + strconv.FormatUint(f.nextID.Add(1), 10)
}

// workersFor returns the workers serving model (all of them for "").
func (f *Frontend) workersFor(model string) (all, serving []Worker) {
	all = f.cfg.Workers()
	for _, w := range all {
		if model == "" || w.Model == "" || w.Model == model {
			serving = append(serving, w)
		}
	}
	return all, serving
}

func findWorker(ws []Worker, id uint64) (Worker, bool) {
	for _, w := range ws {
		if w.ID == id {
			return w, true
		}
	}
	return Worker{}, false
}
