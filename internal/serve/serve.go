// Package serve assembles kvrouter's frontend: one router, a KV-event
// source per engine rank, health supervision of the engines, and the
// OpenAI HTTP frontend. `kvrouter serve` and `kvrouter up` run it.
package serve

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/kvrouter/kvrouter/adapters/enginemetrics"
	"github.com/kvrouter/kvrouter/adapters/enginesource"
	"github.com/kvrouter/kvrouter/adapters/frontend"
	"github.com/kvrouter/kvrouter/adapters/indexerapi"
	"github.com/kvrouter/kvrouter/adapters/modeltok"
	"github.com/kvrouter/kvrouter/adapters/natsplane"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/outlier"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/core/sched"
	"github.com/kvrouter/kvrouter/internal/ratelog"
)

// WorkerSpec describes one engine as the router sees it.
type WorkerSpec struct {
	ID   uint64 `json:"id"`
	Name string `json:"name"`
	URL  string `json:"url"` // HTTP base URL
	// Events is the KV-event PUB endpoint of rank 0; rank r publishes on
	// the next ports (port + r), as vLLM numbers them. Replay likewise.
	Events string `json:"events"`
	Replay string `json:"replay"`
	// Dump is the engine's full-state endpoint (kvrouter's mocker serves
	// /kv_events/dump; vLLM has none), asked with ?dp_rank=r when a rank's
	// events cannot be replayed.
	Dump             string `json:"dump"`
	Model            string `json:"model"`
	DPSize           int    `json:"dp_size"`
	KVBlocks         int    `json:"kv_blocks"`
	MaxBatchedTokens int    `json:"max_num_batched_tokens"`
	// Role is prefill, decode or both (aggregated, the default): a model
	// with prefill and decode-capable engines is served disaggregated.
	Role string `json:"role,omitempty"`
	// Tokenizer is the model's Hugging Face tokenizer (directory or
	// tokenizer.json), for tokenizing its prompts in process.
	Tokenizer string `json:"tokenizer,omitempty"`
	// Device is what the engine computes on: cpu, or an accelerator
	// (cuda, the default), for --router-mode device-aware-weighted.
	Device string `json:"device,omitempty"`
}

// Config is the frontend's configuration.
type Config struct {
	Router  router.Config
	Workers []WorkerSpec
	Addr    string // host:port to listen on
	// HealthInterval is how often engines are probed on /health; an
	// engine failing two probes in a row leaves routing. 0 means 2 s.
	HealthInterval time.Duration
	// EngineMetricsInterval is how often engines' /metrics are read when
	// the router's mode scores by engine-reported load (llm-d-precise,
	// gie-approx-prefix) or a decode busy threshold is set at start; 0
	// means 50 ms, the Inference Extension's default.
	EngineMetricsInterval time.Duration
	Logger                *slog.Logger
	// ZMQMaxMessageBytes bounds one ZMQ message from an engine (see
	// enginesource.Config.MaxMessageBytes); 0 means the default.
	ZMQMaxMessageBytes int64
	// SilenceProbe is enginesource.Config.SilenceProbe for every engine.
	SilenceProbe time.Duration
	// MaxBookings is frontend.Config.MaxBookings.
	MaxBookings int
	// StrictNvext is frontend.Config.StrictNvext.
	StrictNvext bool
	// DynamoMetricNames is frontend.Config.DynamoMetricNames.
	DynamoMetricNames bool
	// HTTP bounds the frontend's clients: body size, timeouts, concurrency.
	HTTP HTTPLimits
	// Plane, when set, adds the NATS plane: discovery, event plane,
	// replica sync.
	Plane *Plane
	// Discovery, when set, adds the engines it finds (Kubernetes pods).
	Discovery Discovery
	// MigrationLimit is --migration-limit: how many times a broken
	// stream may continue on another engine.
	MigrationLimit int
	// Access and TLS of the HTTP listener.
	Access Access
	// Disagg configures disaggregated prefill/decode serving.
	Disagg frontend.Disagg
	// MinInitialWorkers holds routing until this many engines have been
	// in routing at once (--router-min-initial-workers); 0 = none.
	MinInitialWorkers int
	// Tokenizers are the in-process tokenizers by model; the one under ""
	// serves every model without its own. A model without one is
	// tokenized by its engines' /tokenize, unless an engine announces one
	// in discovery or TokenizerCacheLookup finds one.
	Tokenizers map[string]*modeltok.Model
	// MMPlaceholders is the frontend's placeholder token id per modality
	// (frontend.Config.MMPlaceholders).
	MMPlaceholders map[string]uint32
	// TokenizerCacheLookup looks a model without a tokenizer up by its name
	// (org/name) in the local Hugging Face cache.
	TokenizerCacheLookup bool
	// EngineHeaderTimeout and EngineResponseTimeout are the frontend's
	// HeaderTimeout and ResponseTimeout; Outlier its ejection of engines
	// that keep failing requests.
	EngineHeaderTimeout   time.Duration
	EngineResponseTimeout time.Duration
	Outlier               outlier.Config
	// LoRA configures the serving and loading of LoRA adapters; its
	// Reread is the server's own.
	LoRA frontend.LoRA
	// LoRAPollInterval is how often every engine's adapters are re-read
	// from its /v1/models (besides when it joins and after the router
	// loads one); 0 means DefaultLoRAPollInterval, a negative value never.
	LoRAPollInterval time.Duration
	// EPPAddr, when set, serves the Gateway API Inference Extension's
	// endpoint picker (Envoy ext_proc over gRPC, package epp) there,
	// routing with the frontend; EPPHealthAddr, optional, serves its gRPC
	// health service alone on a port of its own too.
	EPPAddr       string
	EPPHealthAddr string
	// ServeIndexer is --serve-indexer: the router's event-fed index is
	// also served, under IndexerPath, with the standalone indexer's API.
	ServeIndexer bool
	// RemoteIndexer is --use-remote-indexer: the base URL of the indexer
	// (kvrouter indexer, or a router's IndexerPath) whose index this
	// router asks instead of subscribing to the engines' events itself;
	// RemoteIndexerTimeout bounds one query (0: the default).
	RemoteIndexer        string
	RemoteIndexerTimeout time.Duration
	// SystemAddr, when set, also serves /metrics, /health, /live and
	// /ready there (Dynamo's DYN_SYSTEM_PORT).
	SystemAddr string
}

// Server is a running frontend.
type Server struct {
	cfg    Config
	router *router.Router
	ln     net.Listener
	http   *http.Server
	cancel context.CancelFunc
	wg     sync.WaitGroup
	log    *slog.Logger
	// closeOnce: Close may follow Shutdown.
	closeOnce sync.Once

	mu      sync.Mutex // guards workers and changed
	workers map[uint64]*supervised
	// changed is closed and replaced whenever an engine joins or leaves.
	changed chan struct{}

	plane *planeState
	fe    *frontend.Frontend
	toks  *tokenizers
	tls   bool // the listener serves HTTPS

	sizesMu     sync.Mutex
	sizesWarned map[uint64]int // the block size last logged per engine

	loraClient   *http.Client
	adaptersKick chan struct{}

	epp *eppState // nil without EPPAddr

	// remote is the primary index asked for overlaps, nil when the router
	// keeps its own.
	remote *indexerapi.Remote

	system   *http.Server // nil without Config.SystemAddr
	systemLn net.Listener
}

type supervised struct {
	spec WorkerSpec
	// transit orders joining and leaving: the probe loop and a refused
	// request may both move the engine at once.
	transit sync.Mutex
	up      bool // guarded by Server.mu
	sources []*enginesource.Source
	// discovered engines come and go with their discovery lease.
	discovered bool
	// drained keeps the engine out of routing, healthy or not, until an
	// operator re-admits it (guarded by Server.mu); wake then cuts the
	// probe's wait short.
	drained bool
	wake    chan struct{}
	// instance is a discovered engine's announcement, to re-admit it by.
	instance natsplane.Instance
	// stop ends the supervision of an engine from Config.Discovery; gone
	// (guarded by Server.mu) says it has been reported gone, so that a
	// probe on the way does not bring it back.
	stop context.CancelFunc
	gone bool
	// why the engine is not in routing, "" while it is (guarded by
	// Server.mu): /health, the dashboard and the log name it.
	why string
	// adapters are the LoRA adapters the engine listed when last read
	// (guarded by Server.mu, replaced, never changed in place);
	// adaptersRead orders the reads.
	adapters     []string
	adaptersRead sync.Mutex
}

func (w *WorkerSpec) validate() error {
	if w.URL == "" {
		return fmt.Errorf("serve: worker %q has no url", w.Name)
	}
	if err := w.CheckAddresses(); err != nil {
		return fmt.Errorf("serve: worker %q: %w", w.Name, err)
	}
	if w.DPSize <= 0 {
		w.DPSize = 1
	}
	if w.Name == "" {
		w.Name = "worker-" + strconv.FormatUint(w.ID, 10)
	}
	if _, err := router.ParseRole(w.Role); err != nil {
		return fmt.Errorf("serve: worker %q: %w", w.Name, err)
	}
	if _, err := router.ParseDevice(w.Device); err != nil {
		return fmt.Errorf("serve: worker %q: %w", w.Name, err)
	}
	_, err := enginesource.RankEndpoint(w.Events, w.DPSize-1)
	return err
}

// info is what the router knows of the engine; validate has checked it.
func (w *WorkerSpec) info() router.WorkerInfo {
	role, _ := router.ParseRole(w.Role)
	cpu, _ := router.ParseDevice(w.Device)
	return router.WorkerInfo{ID: w.ID, Model: w.Model, DPSize: w.DPSize, TotalKVBlocks: w.KVBlocks, MaxNumBatchedTokens: w.MaxBatchedTokens, Role: role, CPU: cpu}
}

// CheckAddresses reports a malformed url=, events=, replay= or dump= with
// the fix: the commonest mistake, a missing scheme, otherwise surfaces as
// "first path segment in URL cannot contain colon" or a connection that
// never comes.
func (w *WorkerSpec) CheckAddresses() error {
	for _, a := range []struct{ key, val string }{{"url", w.URL}, {"dump", w.Dump}} {
		if err := checkHTTPAddress(a.key, a.val); err != nil {
			return err
		}
	}
	for _, a := range []struct{ key, val string }{{"events", w.Events}, {"replay", w.Replay}} {
		if err := checkZMQAddress(a.key, a.val); err != nil {
			return err
		}
	}
	return nil
}

func checkHTTPAddress(key, v string) error {
	if v == "" {
		return nil
	}
	if !strings.Contains(v, "://") {
		return fmt.Errorf("%s=%s has no scheme: add the scheme: %s=http://%s", key, v, key, v)
	}
	u, err := url.Parse(v)
	switch {
	case err != nil:
		return fmt.Errorf("%s=%s: %w", key, v, err)
	case u.Scheme != "http" && u.Scheme != "https":
		return fmt.Errorf("%s=%s: the scheme must be http:// or https://, e.g. %s=http://%s", key, v, key, v[strings.Index(v, "://")+3:])
	case u.Host == "":
		return fmt.Errorf("%s=%s has no host: write %s=http://HOST:PORT", key, v, key)
	}
	return nil
}

func checkZMQAddress(key, v string) error {
	if v == "" {
		return nil
	}
	scheme, rest, ok := strings.Cut(v, "://")
	switch {
	case !ok:
		return fmt.Errorf("%s=%s has no scheme: add the scheme: %s=tcp://%s", key, v, key, v)
	case scheme == "http" || scheme == "https":
		return fmt.Errorf("%s=%s is an HTTP address; KV events are ZMQ: %s=tcp://%s", key, v, key, rest)
	case scheme != "tcp" && scheme != "ipc":
		return fmt.Errorf("%s=%s: the scheme must be tcp:// (or ipc://), e.g. %s=tcp://%s", key, v, key, rest)
	}
	return nil
}

// Start binds the listener and starts everything; engines join routing as
// soon as they answer /health.
func Start(ctx context.Context, cfg Config) (*Server, error) {
	if cfg.HealthInterval <= 0 {
		cfg.HealthInterval = 2 * time.Second
	}
	if len(cfg.Workers) == 0 && cfg.Plane == nil && cfg.Discovery == nil {
		return nil, errNoEngines
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	// A failing engine fails every request and probe: one warning per kind
	// every 10 s says as much.
	log = slog.New(ratelog.New(log.Handler(), slog.LevelWarn, 10*time.Second, nil))
	cfg.HTTP = cfg.HTTP.withDefaults()
	for i := range cfg.Workers {
		if err := cfg.Workers[i].validate(); err != nil {
			return nil, err
		}
	}
	if err := checkWorkers(cfg.Workers); err != nil {
		return nil, err
	}
	warnModelTypos(log, cfg.Workers)
	remote, err := remoteIndex(&cfg, log)
	if err != nil {
		return nil, err
	}
	if remote != nil {
		cfg.Router.Remote = remote
	}
	r, err := router.New(cfg.Router)
	if err != nil {
		return nil, err
	}
	s := &Server{cfg: cfg, router: r, log: log, remote: remote, workers: map[uint64]*supervised{}, changed: make(chan struct{}), sizesWarned: map[uint64]int{},
		loraClient: &http.Client{}, adaptersKick: make(chan struct{}, 1)}
	lcfg := cfg.LoRA
	lcfg.Reread = s.rereadAdapters
	r.SetBlockSizeObserver(s.blockSizeLearned)
	s.toks = newTokenizers(cfg.Tokenizers, cfg.TokenizerCacheLookup, log)
	for _, w := range cfg.Workers {
		s.workers[w.ID] = &supervised{spec: w, wake: make(chan struct{}, 1)}
		s.toks.engine(w.Model, w.Tokenizer)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(newSourceCollector(s))
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	fe, err := frontend.New(frontend.Config{
		Router: r, Workers: s.liveWorkers, Registry: reg, Logger: log, Dependencies: s.dependencies,
		Models: s.models, APIKey: cfg.Access.APIKey, AdminToken: cfg.Access.AdminToken,
		MigrationLimit: cfg.MigrationLimit, EngineRefused: s.engineRefused,
		MaxBodyBytes: cfg.HTTP.MaxBodyBytes, MaxConcurrentRequests: cfg.HTTP.MaxConcurrentRequests, WriteTimeout: cfg.HTTP.WriteTimeout,
		MaxInflightBodyBytes: cfg.HTTP.MaxInflightBodyBytes, MaxBookings: cfg.MaxBookings, StrictNvext: cfg.StrictNvext, DynamoMetricNames: cfg.DynamoMetricNames,
		AfterBurst: newReclaimer(10 * time.Second).request, Disagg: cfg.Disagg, MinInitialWorkers: cfg.MinInitialWorkers,
		Tokenizer: s.toks.of, MMPlaceholders: cfg.MMPlaceholders,
		Engines: s.engineStatuses, SetDrained: s.setDrained,
		HeaderTimeout: cfg.EngineHeaderTimeout, ResponseTimeout: cfg.EngineResponseTimeout, Outlier: cfg.Outlier,
		LoRA: lcfg,
	})
	if err != nil {
		return nil, err
	}
	s.fe = fe
	tlsConfig, err := cfg.Access.tlsConfig()
	if err != nil {
		return nil, err
	}
	s.tls = tlsConfig != nil
	ln, err := net.Listen("tcp", cfg.Addr)
	if err != nil {
		return nil, err
	}
	cfg.Access.warnIfOpen(log, ln.Addr())
	ln = limitConnections(ln, cfg.HTTP.MaxConnections)
	if tlsConfig != nil {
		ln = tls.NewListener(ln, tlsConfig)
	}
	ctx, cancel := context.WithCancel(ctx)
	s.ln, s.cancel = ln, cancel
	if cfg.Plane != nil {
		if err := s.startPlane(ctx); err != nil {
			cancel()
			ln.Close()
			return nil, err
		}
		s.warnIfNoEngines()
	}
	if cfg.Discovery != nil {
		err := cfg.Discovery.Start(ctx, DiscoveryHandler{
			Join:  func(spec WorkerSpec) { s.dynamicJoin(ctx, spec) },
			Leave: s.dynamicLeave,
		})
		if err != nil {
			cancel()
			ln.Close()
			s.closePlane()
			return nil, err
		}
	}
	if cfg.EPPAddr != "" {
		if err := s.startEPP(ctx, reg, tlsConfig); err != nil {
			cancel()
			ln.Close()
			if cfg.Discovery != nil {
				cfg.Discovery.Close()
			}
			s.closePlane()
			return nil, err
		}
	}
	if cfg.SystemAddr != "" {
		if err := s.startSystem(fe.Handler()); err != nil {
			cancel()
			ln.Close()
			if cfg.Discovery != nil {
				cfg.Discovery.Close()
			}
			s.stopEPP()
			s.closePlane()
			return nil, err
		}
	}
	s.http = httpServer(s.withIndexer(fe.Handler()), cfg.HTTP)
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		_ = s.http.Serve(ln)
	}()
	// Discovery runs by now and changes the map under s.mu; the engines
	// it brings are supervised (or leased) by its own path, so only the
	// configured ones are started here.
	s.mu.Lock()
	var configured []*supervised
	for _, w := range s.workers {
		if !w.discovered && w.stop == nil {
			configured = append(configured, w)
		}
	}
	s.mu.Unlock()
	for _, w := range configured {
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.supervise(ctx, w)
		}()
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.watchKVEvents(ctx)
	}()
	if every := cmp.Or(cfg.LoRAPollInterval, DefaultLoRAPollInterval); every > 0 {
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.watchAdapters(ctx, every)
		}()
	}
	// Engine reports feed the modes scoring by them and, given a decode
	// threshold, busy detection.
	if cfg.Router.Mode.UsesEngineLoad() || cfg.Router.Busy.ActiveDecodeBlocks != nil {
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.pollEngineMetrics(ctx)
		}()
	}
	return s, nil
}

// Addr is the address the frontend listens on.
func (s *Server) Addr() string { return s.ln.Addr().String() }

// URL is the frontend's base URL, https with TLS, as a client on this
// machine reaches it (see browsable).
func (s *Server) URL() string { return browsable(s.Addr(), s.tls) }

// browsable is the URL of a listener's address: one on every address
// (0.0.0.0, ::) is named 127.0.0.1, since "http://[::]:8000" is not an
// address to browse to.
func browsable(addr string, tls bool) string {
	if host, port, err := net.SplitHostPort(addr); err == nil {
		if ip := net.ParseIP(host); ip != nil && ip.IsUnspecified() {
			addr = net.JoinHostPort("127.0.0.1", port)
		}
	}
	if tls {
		return "https://" + addr
	}
	return "http://" + addr
}

// Router is the routing engine, for inspection.
func (s *Server) Router() *router.Router { return s.router }

// WaitReady blocks until every configured engine is in routing or ctx ends.
func (s *Server) WaitReady(ctx context.Context) error {
	return s.WaitWorkers(ctx, func(live int) bool { return live == len(s.cfg.Workers) })
}

// WaitWorkers blocks until cond holds for the number of engines in
// routing, re-checking whenever one joins or leaves.
func (s *Server) WaitWorkers(ctx context.Context, cond func(live int) bool) error {
	for {
		s.mu.Lock()
		live := 0
		for _, w := range s.workers {
			if w.up {
				live++
			}
		}
		ch := s.changed
		s.mu.Unlock()
		if cond(live) {
			return nil
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-ch:
		}
	}
}

func (s *Server) notifyLocked() {
	close(s.changed)
	s.changed = make(chan struct{})
}

// Sources returns the event sources of a worker that is up.
func (s *Server) Sources(id uint64) []*enginesource.Source {
	s.mu.Lock()
	defer s.mu.Unlock()
	if w := s.workers[id]; w != nil {
		return slices.Clone(w.sources)
	}
	return nil
}

func (s *Server) liveWorkers() []frontend.Worker {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []frontend.Worker
	for _, w := range s.workers {
		if w.up {
			out = append(out, frontend.Worker{ID: w.spec.ID, Name: w.spec.Name, BaseURL: w.spec.URL, Model: w.spec.Model, DPSize: w.spec.DPSize, Events: w.spec.Events, Adapters: w.adapters})
		}
	}
	slices.SortFunc(out, func(a, b frontend.Worker) int { return int(a.ID) - int(b.ID) })
	return out
}

// supervise probes one engine's health: it joins routing (registered,
// its events followed from whatever its replay buffer holds) when it
// answers, and leaves it, with all its blocks and load, after two failed
// probes in a row. An engine that refused a request's connection has left
// already (engineRefused); the probe brings it back.
func (s *Server) supervise(ctx context.Context, w *supervised) {
	// A busy engine can be slow to answer while it is perfectly healthy,
	// and dropping it would throw away its whole cache; a dead one refuses
	// the connection at once, so a lenient timeout costs no detection time.
	client := &http.Client{Timeout: max(3*s.cfg.HealthInterval, 5*time.Second)}
	failures := 0
	for {
		perr := probe(ctx, client, w.spec.URL)
		healthy := perr == nil
		s.mu.Lock()
		up, drained := w.up, w.drained
		s.mu.Unlock()
		switch {
		case drained:
		case healthy && !up:
			failures = 0
			if err := s.join(ctx, w); err != nil {
				s.outOfRouting(w, fmt.Sprintf("engine url=%s could not join routing: %v", w.spec.URL, err))
			}
		case healthy:
			failures = 0
		case up:
			if failures++; failures >= 2 {
				s.leave(w, "stopped answering /health")
				s.outOfRouting(w, unreachable(w.spec.URL, perr))
			}
		case ctx.Err() == nil:
			s.outOfRouting(w, unreachable(w.spec.URL, perr))
		}
		select {
		case <-ctx.Done():
			s.leave(w, "shutting down")
			return
		case <-time.After(s.cfg.HealthInterval):
		case <-w.wake:
		}
	}
}

// outOfRouting records why an engine is not in routing and logs it the
// first time and whenever the reason changes: an engine that never
// answers must not be silent, nor fill the log every probe.
func (s *Server) outOfRouting(w *supervised, why string) {
	s.mu.Lock()
	changed := !w.up && w.why != why
	if changed {
		w.why = why
	}
	s.mu.Unlock()
	if changed {
		s.log.Warn("engine not in routing: "+why, "worker", w.spec.Name, "url", w.spec.URL)
	}
}

// unreachable says why a health probe failed in the operator's words:
// "connection refused" rather than the whole dial error.
func unreachable(base string, err error) string {
	var status *probeStatus
	switch {
	case errors.As(err, &status):
		return fmt.Sprintf("engine url=%s is not healthy: GET /health answered %d", base, status.code)
	case errors.Is(err, syscall.ECONNREFUSED):
		return fmt.Sprintf("engine url=%s unreachable: connection refused (is it running, on this port?)", base)
	}
	var uerr *url.Error
	if errors.As(err, &uerr) {
		err = uerr.Err
	}
	return fmt.Sprintf("engine url=%s unreachable: %v", base, err)
}

type probeStatus struct{ code int }

func (p *probeStatus) Error() string { return fmt.Sprintf("/health answered %d", p.code) }

// probe is nil when the engine answers GET /health with 200.
func probe(ctx context.Context, client *http.Client, base string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimSuffix(base, "/")+"/health", nil)
	if err != nil {
		return err
	}
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return &probeStatus{code: resp.StatusCode}
	}
	return nil
}

// engineRefused takes an engine that refused a connection out of routing
// at once: it is dead or not listening, and until the next probe it would
// otherwise look like the idlest engine of all. Discovered engines are not
// probed here and stay, each request avoiding the ones that failed it,
// until their lease ends.
func (s *Server) engineRefused(id uint64) {
	s.mu.Lock()
	w := s.workers[id]
	s.mu.Unlock()
	if w != nil && !w.discovered {
		s.leave(w, "refused a connection")
	}
}

func (s *Server) join(ctx context.Context, w *supervised) error {
	w.transit.Lock()
	defer w.transit.Unlock()
	s.mu.Lock()
	drained := w.drained || w.gone
	s.mu.Unlock()
	if drained { // drained or gone while its probe was on the way
		return nil
	}
	spec := w.spec
	// A restarted engine has lost the adapters loaded at run time: none
	// is routed to it before its list is read.
	s.mu.Lock()
	w.adapters = nil
	s.mu.Unlock()
	s.rereadAdapters(ctx, spec.ID)
	s.router.AddWorker(spec.info())
	var sources []*enginesource.Source
	// With a remote primary, the indexer follows the engines' events.
	if spec.Events != "" && s.remote == nil {
		for rank := range spec.DPSize {
			events, _ := enginesource.RankEndpoint(spec.Events, rank)
			replay, err := enginesource.RankEndpoint(spec.Replay, rank)
			if err != nil {
				return err
			}
			dump := ""
			if spec.Dump != "" {
				dump = spec.Dump + "?dp_rank=" + strconv.Itoa(rank)
			}
			src, err := enginesource.Start(ctx, enginesource.Config{Worker: kv.Worker{ID: spec.ID, DPRank: uint32(rank)}, Events: events, Replay: replay, Dump: dump, Logger: s.log, MaxMessageBytes: s.cfg.ZMQMaxMessageBytes, SilenceProbe: s.cfg.SilenceProbe}, s.router)
			if err != nil {
				for _, src := range sources {
					_ = src.Close()
				}
				s.router.RemoveWorker(spec.ID)
				return err
			}
			sources = append(sources, src)
		}
	}
	s.mu.Lock()
	w.up, w.sources, w.why = true, sources, ""
	s.notifyLocked()
	s.mu.Unlock()
	s.log.Info("engine joined routing", "worker", spec.Name, "url", spec.URL, "ranks", spec.DPSize)
	return nil
}

func (s *Server) leave(w *supervised, why string) {
	w.transit.Lock()
	defer w.transit.Unlock()
	s.mu.Lock()
	up, sources := w.up, w.sources
	w.up, w.sources = false, nil // the frontend stops sending to it now
	if up {
		w.why = "engine url=" + w.spec.URL + " " + why
	}
	s.mu.Unlock()
	if !up {
		return
	}
	for _, src := range sources {
		_ = src.Close()
	}
	s.router.RemoveWorker(w.spec.ID)
	s.mu.Lock()
	s.notifyLocked() // only once the router has forgotten it too
	s.mu.Unlock()
	level := slog.LevelWarn
	if why == "shutting down" {
		level = slog.LevelInfo
	}
	s.log.Log(context.Background(), level, "engine left routing", "worker", w.spec.Name, "why", why)
}

// Close stops serving, the sources and the supervisors at once; Shutdown
// first lets requests in flight finish.
func (s *Server) Close() error {
	var err error
	s.closeOnce.Do(func() {
		s.cancel()
		err = s.http.Close()
		s.stopEPP()
		s.stopSystem()
		if s.cfg.Discovery != nil {
			s.cfg.Discovery.Close()
		}
		s.wg.Wait()
		s.closePlane()
		if errors.Is(err, http.ErrServerClosed) {
			err = nil
		}
	})
	return err
}

// pollEngineMetrics feeds the engines' own load reports to the router for
// the modes that score by them. A failed scrape keeps the last report: the
// health probes, not this, decide whether an engine is routable. It follows
// the engine set: configured engines and those of Config.Discovery (pods)
// are polled from when they are known until they are gone; engines
// announced through NATS are not, their agents report their load.
func (s *Server) pollEngineMetrics(ctx context.Context) {
	interval := s.cfg.EngineMetricsInterval
	if interval <= 0 {
		interval = 50 * time.Millisecond
	}
	queries := newQueryWatch()
	var capMu sync.Mutex
	capacity := map[kv.Worker]int{}
	p := enginemetrics.Poller{
		Interval: interval,
		OnSamples: func(id uint64, samples map[int]enginemetrics.Sample) {
			for rank, smp := range samples {
				w := kv.Worker{ID: id, DPRank: uint32(rank)}
				capMu.Lock()
				if smp.CacheBlocks > 0 && capacity[w] != smp.CacheBlocks {
					capacity[w] = smp.CacheBlocks
					s.router.EngineCapacity(w, smp.CacheBlocks)
				}
				capMu.Unlock()
				s.router.SetEngineLoad(w, sched.EngineLoad{
					Waiting: smp.Waiting, Running: smp.Running, KVUsage: smp.KVUsage,
				})
				if queries.grew(w, smp.PrefixCacheQueries) {
					s.router.Served(w)
				}
			}
		},
		OnError: func(id uint64, err error) { s.log.Debug("engine metrics", "worker", id, "err", err) },
	}
	// polled is one engine's poll and how to end it. A discovered engine
	// reported again (a restarted pod, or one at a new address) is a new
	// *supervised: polled anew, its capacity read again.
	type polled struct {
		w    *supervised
		stop context.CancelFunc
	}
	polling := map[uint64]polled{}
	var wg sync.WaitGroup
	defer func() {
		for _, pl := range polling {
			pl.stop()
		}
		wg.Wait()
	}()
	for {
		s.mu.Lock()
		want := make(map[uint64]*supervised, len(s.workers))
		for id, w := range s.workers {
			if !w.discovered {
				want[id] = w
			}
		}
		changed := s.changed
		s.mu.Unlock()
		for id, pl := range polling {
			if want[id] != pl.w {
				pl.stop()
				delete(polling, id)
				capMu.Lock()
				maps.DeleteFunc(capacity, func(w kv.Worker, _ int) bool { return w.ID == id })
				capMu.Unlock()
				queries.forget(id)
			}
		}
		for id, w := range want {
			if _, ok := polling[id]; ok {
				continue
			}
			pctx, stop := context.WithCancel(ctx)
			polling[id] = polled{w: w, stop: stop}
			wg.Go(func() { p.Run(pctx, []enginemetrics.Target{{ID: id, URL: w.spec.URL}}) })
		}
		select {
		case <-ctx.Done():
			return
		case <-changed:
		}
	}
}
