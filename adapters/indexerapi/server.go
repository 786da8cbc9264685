package indexerapi

import (
	"bufio"
	"cmp"
	"encoding/json"
	"errors"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/index"
	"github.com/kvrouter/kvrouter/core/kv"
)

// Errors a Backend wraps to choose the status of its answer.
var (
	ErrBadRequest = errors.New("invalid request")                          // 400
	ErrNotFound   = errors.New("not found")                                // 404
	ErrConflict   = errors.New("conflicts with an earlier registration")   // 409
	ErrForbidden  = errors.New("this indexer does not take registrations") // 403
)

// Registration is a validated POST /register.
type Registration struct {
	InstanceID     uint64
	DPRank         uint32
	Endpoint       string
	ReplayEndpoint string
	Key            GroupKey
	BlockSize      int
	AdditionalSalt string
}

// GroupKey names one index: a model's routing group.
type GroupKey struct{ Model, Group string }

func (k GroupKey) String() string { return k.Model + ":" + k.Group }

// Group is one index the API answers from. *router.Router is one, through
// RouterGroup.
type Group interface {
	BlockSize() int
	// Match is the index's device overlaps and, when it holds lower tiers,
	// its overlaps on every tier.
	Match(m *index.Matcher, seq []uint64) ([]index.Overlap, []index.TierOverlap)
	DumpTo(d *index.Dumper, visit func([]kv.Event) error) error
}

// Backend is what the API serves.
type Backend interface {
	Register(Registration) error
	// Unregister removes an instance from one routing group, or from
	// every group of the model when group is nil; from one rank, or all.
	Unregister(id uint64, model string, group *string, rank *uint32) error
	Workers(model, group string) []WorkerView
	Group(GroupKey) (Group, error)
	Groups() []GroupKey
}

// Config configures a Server.
type Config struct {
	Backend Backend
	// Peers are indexers to recover from (see Recover); more may be
	// registered with POST /register_peer.
	Peers []string
	// MaxBodyBytes bounds a request body; 0 means 64 MiB (a 4 M-token
	// prompt as JSON).
	MaxBodyBytes int64
	// Health, when set, adds to GET /health what the server depends on.
	Health func() map[string]string
	// Registry receives the API's metrics; nil makes one.
	Registry *prometheus.Registry
}

// Server serves the API.
type Server struct {
	cfg      Config
	matchers sync.Pool

	peersMu sync.Mutex
	peers   []string

	requests *prometheus.CounterVec
	errs     *prometheus.CounterVec
	latency  *prometheus.HistogramVec
}

// New returns a Server.
func New(cfg Config) *Server {
	if cfg.MaxBodyBytes <= 0 {
		cfg.MaxBodyBytes = 64 << 20
	}
	if cfg.Registry == nil {
		cfg.Registry = prometheus.NewRegistry()
	}
	s := &Server{cfg: cfg, matchers: sync.Pool{New: func() any { return new(index.Matcher) }}}
	for _, p := range cfg.Peers {
		s.addPeer(p)
	}
	s.requests = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "dynamo_kvindexer_requests_total", Help: "HTTP requests to the indexer API."}, []string{"endpoint", "method"})
	s.errs = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "dynamo_kvindexer_errors_total", Help: "Indexer API answers with a 4xx or 5xx status."}, []string{"endpoint", "status_class"})
	s.latency = prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "dynamo_kvindexer_request_duration_seconds", Help: "Indexer API request latency.", Buckets: []float64{50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 100e-3, 1}}, []string{"endpoint"})
	models := prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "dynamo_kvindexer_models", Help: "Indexes kept: one per model and routing group."}, func() float64 { return float64(len(cfg.Backend.Groups())) })
	workers := prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "dynamo_kvindexer_workers", Help: "Registered worker instances."}, func() float64 { return float64(len(cfg.Backend.Workers("", ""))) })
	cfg.Registry.MustRegister(s.requests, s.errs, s.latency, models, workers)
	return s
}

// Handler routes the API. A known path asked with another method is
// answered 405 with an Allow header.
func (s *Server) Handler() http.Handler {
	routes := []struct {
		method, path string
		h            http.HandlerFunc
	}{
		{"POST", "/register", s.register},
		{"POST", "/unregister", s.unregister},
		{"GET", "/workers", s.workers},
		{"POST", "/query", s.query},
		{"POST", "/query_by_hash", s.queryByHash},
		{"GET", "/dump", s.dump},
		{"POST", "/register_peer", s.registerPeer},
		{"POST", "/deregister_peer", s.deregisterPeer},
		{"GET", "/peers", s.listPeers},
		{"GET", "/health", s.health},
	}
	mux := http.NewServeMux()
	for _, rt := range routes {
		mux.Handle(rt.method+" "+rt.path, s.instrument(rt.path, rt.h))
		other := "GET"
		if rt.method == "GET" {
			other = "POST"
		}
		allow := rt.method
		if rt.method == "GET" {
			allow = "GET, HEAD"
		}
		mux.HandleFunc(other+" "+rt.path, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Allow", allow)
			fail(w, r, http.StatusMethodNotAllowed, "%s %s is not served; use %s", r.Method, r.URL.Path, allow)
		})
	}
	mux.Handle("GET /metrics", promhttp.HandlerFor(s.cfg.Registry, promhttp.HandlerOpts{}))
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		fail(w, r, http.StatusNotFound, "no route for %s %s", r.Method, r.URL.Path)
	})
	return mux
}

// statusWriter records the status an answer had.
type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	w.status = code
	w.ResponseWriter.WriteHeader(code)
}

func (s *Server) instrument(endpoint string, h http.HandlerFunc) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		t0 := time.Now()
		sw := &statusWriter{ResponseWriter: w, status: http.StatusOK}
		h(sw, r)
		s.requests.WithLabelValues(endpoint, r.Method).Inc()
		s.latency.WithLabelValues(endpoint).Observe(time.Since(t0).Seconds())
		if sw.status >= 400 {
			s.errs.WithLabelValues(endpoint, strconv.Itoa(sw.status/100)+"xx").Inc()
		}
	})
}

// backendStatus is the status of a backend's error.
func backendStatus(err error) int {
	switch {
	case errors.Is(err, ErrNotFound):
		return http.StatusNotFound
	case errors.Is(err, ErrConflict):
		return http.StatusConflict
	case errors.Is(err, ErrForbidden):
		return http.StatusForbidden
	case isBodyErr(err), errors.Is(err, ErrBadRequest):
		return http.StatusBadRequest
	}
	return http.StatusInternalServerError
}

func (s *Server) register(w http.ResponseWriter, r *http.Request) {
	var req RegisterRequest
	if err := decode(r, &req, s.cfg.MaxBodyBytes); err != nil {
		fail(w, r, http.StatusBadRequest, "%v", err)
		return
	}
	reg, err := req.validate()
	if err != nil {
		fail(w, r, http.StatusBadRequest, "%v", err)
		return
	}
	if err := s.cfg.Backend.Register(reg); err != nil {
		fail(w, r, backendStatus(err), "%v", err)
		return
	}
	write(w, r, http.StatusCreated, ok)
}

func (req *RegisterRequest) validate() (Registration, error) {
	switch {
	case req.InstanceID == nil:
		return Registration{}, errMissing("instance_id")
	case req.Endpoint == "":
		return Registration{}, errMissing("endpoint")
	case req.ModelName == "":
		return Registration{}, errMissing("model_name")
	case req.BlockSize <= 0:
		return Registration{}, &errBody{"block_size is required and must be a positive number of tokens"}
	}
	reg := Registration{
		InstanceID: *req.InstanceID, Endpoint: req.Endpoint, ReplayEndpoint: req.ReplayEndpoint,
		Key: GroupKey{req.ModelName, groupOr(req.RoutingGroup)}, BlockSize: req.BlockSize,
		AdditionalSalt: req.AdditionalSalt,
	}
	if reg.AdditionalSalt == "" {
		reg.AdditionalSalt = req.AdditionalSaltRFC
	}
	if req.DPRank != nil {
		reg.DPRank = *req.DPRank
	}
	return reg, nil
}

func groupOr(g string) string {
	if g == "" {
		return DefaultRoutingGroup
	}
	return g
}

func (s *Server) unregister(w http.ResponseWriter, r *http.Request) {
	var req UnregisterRequest
	if err := decode(r, &req, s.cfg.MaxBodyBytes); err != nil {
		fail(w, r, http.StatusBadRequest, "%v", err)
		return
	}
	switch {
	case req.InstanceID == nil:
		fail(w, r, http.StatusBadRequest, "%v", errMissing("instance_id"))
		return
	case req.ModelName == "":
		fail(w, r, http.StatusBadRequest, "%v", errMissing("model_name"))
		return
	}
	if err := s.cfg.Backend.Unregister(*req.InstanceID, req.ModelName, req.RoutingGroup, req.DPRank); err != nil {
		fail(w, r, backendStatus(err), "%v", err)
		return
	}
	write(w, r, http.StatusOK, ok)
}

func (s *Server) workers(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	out := s.cfg.Backend.Workers(q.Get("model_name"), q.Get("routing_group"))
	if out == nil {
		out = []WorkerView{}
	}
	write(w, r, http.StatusOK, out)
}

func (s *Server) query(w http.ResponseWriter, r *http.Request) {
	var req QueryRequest
	if err := decode(r, &req, s.cfg.MaxBodyBytes); err != nil {
		fail(w, r, http.StatusBadRequest, "%v", err)
		return
	}
	switch {
	case req.TokenIDs == nil:
		fail(w, r, http.StatusBadRequest, "%v", errMissing("token_ids"))
		return
	case req.ModelName == "":
		fail(w, r, http.StatusBadRequest, "%v", errMissing("model_name"))
		return
	}
	g, err := s.group(req.ModelName, req.RoutingGroup)
	if err != nil {
		fail(w, r, backendStatus(err), "%v", err)
		return
	}
	h := blockhash.NewKeyed(g.BlockSize(), req.LoRAName, req.CacheSalt)
	_, seq := h.Hashes(req.TokenIDs)
	write(w, r, http.StatusOK, s.score(g, seq))
}

func (s *Server) queryByHash(w http.ResponseWriter, r *http.Request) {
	var req QueryByHashRequest
	if err := decode(r, &req, s.cfg.MaxBodyBytes); err != nil {
		fail(w, r, http.StatusBadRequest, "%v", err)
		return
	}
	switch {
	case req.BlockHashes == nil:
		fail(w, r, http.StatusBadRequest, "%v", errMissing("block_hashes"))
		return
	case req.ModelName == "":
		fail(w, r, http.StatusBadRequest, "%v", errMissing("model_name"))
		return
	case req.CacheSalt != nil:
		fail(w, r, http.StatusBadRequest, "cache_salt must be omitted on /query_by_hash: block hashes are salted when they are computed; use /query to have the indexer salt token ids")
		return
	}
	g, err := s.group(req.ModelName, req.RoutingGroup)
	if err != nil {
		fail(w, r, backendStatus(err), "%v", err)
		return
	}
	local := make([]uint64, len(req.BlockHashes))
	for i, h := range req.BlockHashes {
		local[i] = uint64(h)
	}
	write(w, r, http.StatusOK, s.score(g, blockhash.SequenceHashes(local)))
}

func (s *Server) group(model, group string) (Group, error) {
	return s.cfg.Backend.Group(GroupKey{model, groupOr(group)})
}

// score matches seq in g and words the answer in tokens.
func (s *Server) score(g Group, seq []uint64) Score {
	m := s.matchers.Get().(*index.Matcher)
	defer s.matchers.Put(m)
	dev, tiers := g.Match(m, seq)
	return BuildScore(g.BlockSize(), dev, tiers)
}

// BuildScore words an index's answer in tokens: every rank holding the
// prompt's first block with its device overlap, the number of ranks
// holding each block, and each instance's overlap on every tier.
// Instances holding nothing of the prompt are left out: at a thousand
// engines, listing them all with 0 made every answer ten times longer
// (GET /workers lists them).
func BuildScore(blockSize int, dev []index.Overlap, tiers []index.TierOverlap) Score {
	bs := uint32(blockSize)
	out := Score{Scores: map[string]map[string]uint32{}, Instances: map[string]Instance{}}
	inst := func(id uint64) (string, Instance) {
		k := strconv.FormatUint(id, 10)
		in, found := out.Instances[k]
		if !found {
			in.DP = map[string]uint32{}
			out.Scores[k] = map[string]uint32{}
		}
		return k, in
	}
	setRank := func(w kv.Worker, blocks uint32) {
		k, in := inst(w.ID)
		r := strconv.FormatUint(uint64(w.DPRank), 10)
		tokens := blocks * bs
		in.DP[r] = max(in.DP[r], tokens)
		out.Scores[k][r] = in.DP[r]
		in.GPU = max(in.GPU, tokens)
		in.CPU, in.Disk = max(in.CPU, in.GPU), max(in.Disk, in.GPU)
		in.LongestMatched = max(in.GPU, in.CPU, in.Disk)
		out.Instances[k] = in
	}
	deepest := uint32(0)
	for _, o := range dev {
		setRank(o.Worker, o.Blocks)
		deepest = max(deepest, o.Blocks)
	}
	for _, t := range tiers {
		k, in := inst(t.Worker.ID)
		in.CPU = max(in.CPU, t.Host*bs, in.GPU)
		in.Disk = max(in.Disk, t.Disk*bs, (t.Device+t.Shared)*bs, in.CPU)
		in.LongestMatched = max(in.GPU, in.CPU, in.Disk)
		out.Instances[k] = in
	}
	out.Frequencies = make([]int, deepest)
	for _, o := range dev {
		for i := range o.Blocks {
			out.Frequencies[i]++
		}
	}
	return out
}

// dump streams {"model:group": {"block_size": n, "events": [...]}, ...}:
// the events that rebuild every index, as RouterEvents.
func (s *Server) dump(w http.ResponseWriter, r *http.Request) {
	keys := s.cfg.Backend.Groups()
	slices.SortFunc(keys, func(a, b GroupKey) int {
		return cmp.Or(cmp.Compare(a.Model, b.Model), cmp.Compare(a.Group, b.Group))
	})
	w.Header().Set("Content-Type", contentJSON)
	bw := bufio.NewWriterSize(w, 64<<10)
	defer bw.Flush()
	bw.WriteString("{")
	var d index.Dumper
	var buf []byte
	for i, k := range keys {
		g, err := s.cfg.Backend.Group(k)
		if err != nil {
			continue // unregistered meanwhile
		}
		name, _ := json.Marshal(k.String())
		if i > 0 {
			bw.WriteString(",")
		}
		bw.Write(name)
		bw.WriteString(`:{"block_size":` + strconv.Itoa(g.BlockSize()) + `,"events":[`)
		first := true
		_ = g.DumpTo(&d, func(evs []kv.Event) error {
			for _, ev := range evs {
				if !first {
					bw.WriteByte(',')
				}
				first = false
				buf, _ = ev.AppendJSON(buf[:0])
				if _, err := bw.Write(buf); err != nil {
					return err
				}
			}
			return nil
		})
		bw.WriteString("]}")
	}
	bw.WriteString("}\n")
}

func (s *Server) addPeer(url string) {
	s.peersMu.Lock()
	defer s.peersMu.Unlock()
	if !slices.Contains(s.peers, url) {
		s.peers = append(s.peers, url)
	}
}

// Peers are the peers registered, in order.
func (s *Server) Peers() []string {
	s.peersMu.Lock()
	defer s.peersMu.Unlock()
	return slices.Clone(s.peers)
}

func (s *Server) registerPeer(w http.ResponseWriter, r *http.Request) {
	var req PeerRequest
	if err := decode(r, &req, s.cfg.MaxBodyBytes); err != nil {
		fail(w, r, http.StatusBadRequest, "%v", err)
		return
	}
	if err := checkPeerURL(req.URL); err != nil {
		fail(w, r, http.StatusBadRequest, "%v", err)
		return
	}
	s.addPeer(req.URL)
	write(w, r, http.StatusCreated, ok)
}

func (s *Server) deregisterPeer(w http.ResponseWriter, r *http.Request) {
	var req PeerRequest
	if err := decode(r, &req, s.cfg.MaxBodyBytes); err != nil {
		fail(w, r, http.StatusBadRequest, "%v", err)
		return
	}
	s.peersMu.Lock()
	i := slices.Index(s.peers, req.URL)
	if i >= 0 {
		s.peers = slices.Delete(s.peers, i, i+1)
	}
	s.peersMu.Unlock()
	if i < 0 {
		fail(w, r, http.StatusNotFound, "peer not found")
		return
	}
	write(w, r, http.StatusOK, ok)
}

func (s *Server) listPeers(w http.ResponseWriter, r *http.Request) {
	write(w, r, http.StatusOK, s.Peers())
}

// health answers 200 {"status": "ok"}, with what the server depends on
// when Config.Health says; "degraded" entries answer 200 too, since the
// indexer still answers, from what it has.
func (s *Server) health(w http.ResponseWriter, r *http.Request) {
	body := map[string]any{"status": "ok"}
	if s.cfg.Health != nil {
		if deps := s.cfg.Health(); len(deps) > 0 {
			body["dependencies"] = deps
		}
	}
	write(w, r, http.StatusOK, body)
}
