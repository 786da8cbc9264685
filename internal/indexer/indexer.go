// Package indexer runs kvrouter's standalone KV indexer (`kvrouter
// indexer`): engines registered over its HTTP API (package indexerapi)
// are subscribed to as `serve` subscribes to them (package enginesource:
// the same catch-up, gap replay, dumps and resets), one event-fed index
// per model and routing group, and routers or gateways ask it which
// instance caches how much of a prompt. At start it recovers the
// registrations and the indexes of the first peer that answers.
package indexer

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/adapters/enginesource"
	"github.com/kvrouter/kvrouter/adapters/indexerapi"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/core/sched"
)

// Config configures the service.
type Config struct {
	Addr string // host:port to listen on
	// Peers are indexers to recover from at start, and the initial peer
	// list of GET /peers.
	Peers []string
	// Workers are registered at start, before any peer's.
	Workers []indexerapi.Registration
	// EventThreads is each index's write parallelism
	// (--router-event-threads); 0 means the router's default.
	EventThreads int
	// ZMQMaxMessageBytes and SilenceProbe are enginesource's.
	ZMQMaxMessageBytes int64
	SilenceProbe       time.Duration
	// PeerTimeout bounds the recovery from one peer; 0 means 10 s.
	PeerTimeout time.Duration
	Logger      *slog.Logger
}

// Service is a running indexer.
type Service struct {
	cfg    Config
	log    *slog.Logger
	ctx    context.Context
	cancel context.CancelFunc
	api    *indexerapi.Server
	ln     net.Listener
	http   *http.Server
	wg     sync.WaitGroup

	mu     sync.Mutex
	groups map[indexerapi.GroupKey]*group
}

// group is one model's routing group: its index and its instances.
type group struct {
	key   indexerapi.GroupKey
	r     *router.Router
	insts map[uint64]*instance
}

type instance struct {
	salt  string
	ranks map[uint32]*listener
}

type listener struct {
	endpoint, replay string
	src              *enginesource.Source
	err              string
}

// Start recovers from the peers, registers cfg.Workers, binds the
// listener and serves.
func Start(ctx context.Context, cfg Config) (*Service, error) {
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	ctx, cancel := context.WithCancel(ctx)
	s := &Service{cfg: cfg, log: log, ctx: ctx, cancel: cancel, groups: map[indexerapi.GroupKey]*group{}}
	s.api = indexerapi.New(indexerapi.Config{Backend: s, Peers: cfg.Peers})
	for _, reg := range cfg.Workers {
		if err := s.Register(reg); err != nil {
			s.Close()
			return nil, fmt.Errorf("indexer: worker %d: %w", reg.InstanceID, err)
		}
	}
	s.recover()
	ln, err := net.Listen("tcp", cfg.Addr)
	if err != nil {
		s.Close()
		return nil, err
	}
	s.ln = ln
	s.http = &http.Server{Handler: s.api.Handler(), ReadHeaderTimeout: 10 * time.Second}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		_ = s.http.Serve(ln)
	}()
	return s, nil
}

// URL is the service's base URL.
func (s *Service) URL() string {
	addr := s.ln.Addr().String()
	if host, port, err := net.SplitHostPort(addr); err == nil {
		if ip := net.ParseIP(host); ip != nil && ip.IsUnspecified() {
			addr = net.JoinHostPort("127.0.0.1", port)
		}
	}
	return "http://" + addr
}

// Close stops serving and every subscription.
func (s *Service) Close() {
	if s.http != nil {
		_ = s.http.Close()
	}
	s.cancel()
	s.mu.Lock()
	var srcs []*enginesource.Source
	for _, g := range s.groups {
		for _, in := range g.insts {
			for _, l := range in.ranks {
				if l.src != nil {
					srcs = append(srcs, l.src)
				}
			}
		}
	}
	s.mu.Unlock()
	for _, src := range srcs {
		_ = src.Close()
	}
	s.wg.Wait()
}

// newIndex is one group's router: an event-fed index and nothing the
// indexer does not answer with (no predictions, no load).
func (s *Service) newIndex(blockSize int) (*router.Router, error) {
	rc := router.DefaultConfig()
	rc.BlockSize = blockSize
	rc.EventThreads = max(s.cfg.EventThreads, rc.EventThreads)
	rc.PredictedTTL, rc.KVEventsGrace = 0, 0
	rc.QueueThreshold = nil
	rc.TrackActiveBlocks = false
	rc.Mode = sched.ModeKV
	return router.New(rc)
}

// Register implements indexerapi.Backend.
func (s *Service) Register(reg indexerapi.Registration) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	g := s.groups[reg.Key]
	if g != nil && g.r.BlockSize() != reg.BlockSize {
		return fmt.Errorf("%w: %s indexes blocks of %d tokens, not %d", indexerapi.ErrConflict, reg.Key, g.r.BlockSize(), reg.BlockSize)
	}
	if g != nil {
		if l := g.insts[reg.InstanceID].rank(reg.DPRank); l != nil {
			if l.endpoint == reg.Endpoint && l.replay == reg.ReplayEndpoint {
				return nil // the same registration again
			}
			return fmt.Errorf("%w: instance %d rank %d of %s is registered with endpoint %s", indexerapi.ErrConflict, reg.InstanceID, reg.DPRank, reg.Key, l.endpoint)
		}
	}
	if err := checkZMQ(reg.Endpoint, reg.ReplayEndpoint); err != nil {
		return err
	}
	if g == nil {
		r, err := s.newIndex(reg.BlockSize)
		if err != nil {
			return err
		}
		g = &group{key: reg.Key, r: r, insts: map[uint64]*instance{}}
		s.groups[reg.Key] = g
	}
	in := g.insts[reg.InstanceID]
	if in == nil {
		in = &instance{salt: reg.AdditionalSalt, ranks: map[uint32]*listener{}}
		g.insts[reg.InstanceID] = in
	}
	// Ranks a peer's dump brought stay.
	dp := in.dpSize(reg.DPRank)
	for _, info := range g.r.Workers() {
		if info.ID == reg.InstanceID {
			dp = max(dp, info.DPSize)
		}
	}
	g.r.AddWorker(router.WorkerInfo{ID: reg.InstanceID, DPSize: dp, BlockSize: reg.BlockSize})
	l := &listener{endpoint: reg.Endpoint, replay: reg.ReplayEndpoint}
	src, err := enginesource.Start(s.ctx, enginesource.Config{
		Worker: kv.Worker{ID: reg.InstanceID, DPRank: reg.DPRank}, Events: reg.Endpoint, Replay: reg.ReplayEndpoint,
		Logger: s.log, MaxMessageBytes: s.cfg.ZMQMaxMessageBytes, SilenceProbe: s.cfg.SilenceProbe,
	}, g.r)
	if err != nil {
		l.err = err.Error()
	}
	l.src = src
	in.ranks[reg.DPRank] = l
	s.log.Info("worker registered", "instance", reg.InstanceID, "dp_rank", reg.DPRank, "model", reg.Key.Model, "routing_group", reg.Key.Group, "endpoint", reg.Endpoint)
	return nil
}

func (in *instance) rank(r uint32) *listener {
	if in == nil {
		return nil
	}
	return in.ranks[r]
}

// dpSize is the rank count that covers every registered rank and r.
func (in *instance) dpSize(r uint32) int {
	n := int(r) + 1
	for rk := range in.ranks {
		n = max(n, int(rk)+1)
	}
	return n
}

func checkZMQ(endpoints ...string) error {
	for i, e := range endpoints {
		if e == "" && i > 0 {
			continue
		}
		scheme, _, ok := strings.Cut(e, "://")
		if !ok || (scheme != "tcp" && scheme != "ipc") {
			name := []string{"endpoint", "replay_endpoint"}[min(i, 1)]
			return fmt.Errorf("%w: %s must be a ZMQ address such as tcp://host:5557, got %q", indexerapi.ErrBadRequest, name, e)
		}
	}
	return nil
}

// Unregister implements indexerapi.Backend.
func (s *Service) Unregister(id uint64, model string, groupName *string, rank *uint32) error {
	s.mu.Lock()
	var closing []*enginesource.Source
	found := false
	for key, g := range s.groups {
		if key.Model != model || (groupName != nil && key.Group != *groupName) {
			continue
		}
		in := g.insts[id]
		if in == nil {
			continue
		}
		for rk, l := range in.ranks {
			if rank != nil && rk != *rank {
				continue
			}
			found = true
			if l.src != nil {
				closing = append(closing, l.src)
			}
			delete(in.ranks, rk)
		}
		switch {
		case len(in.ranks) == 0:
			delete(g.insts, id)
			g.r.RemoveWorker(id)
		case rank != nil:
			// The rank's blocks go; the instance's other ranks stay.
			_ = g.r.ApplyEvent(&kv.Event{Worker: kv.Worker{ID: id, DPRank: *rank}, Kind: kv.KindCleared})
		}
		if len(g.insts) == 0 {
			delete(s.groups, key)
		}
	}
	s.mu.Unlock()
	for _, src := range closing {
		_ = src.Close()
	}
	if !found {
		return fmt.Errorf("%w: instance %d is not registered for model %q%s", indexerapi.ErrNotFound, id, model, describeGroup(groupName, rank))
	}
	return nil
}

func describeGroup(group *string, rank *uint32) string {
	var b strings.Builder
	if group != nil {
		fmt.Fprintf(&b, " routing_group %q", *group)
	}
	if rank != nil {
		fmt.Fprintf(&b, " dp_rank %d", *rank)
	}
	return b.String()
}

// Workers implements indexerapi.Backend.
func (s *Service) Workers(model, groupName string) []indexerapi.WorkerView {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []indexerapi.WorkerView
	for key, g := range s.groups {
		if (model != "" && key.Model != model) || (groupName != "" && key.Group != groupName) {
			continue
		}
		for id, in := range g.insts {
			v := indexerapi.WorkerView{InstanceID: id, Source: "zmq", ModelName: key.Model, RoutingGroup: key.Group, BlockSize: g.r.BlockSize(),
				Endpoints: map[string]string{}, Listeners: map[string]indexerapi.Listener{}}
			for rk, l := range in.ranks {
				k := strconv.FormatUint(uint64(rk), 10)
				v.Endpoints[k] = l.endpoint
				v.Listeners[k] = l.view()
			}
			v.Status = aggregate(v.Listeners)
			out = append(out, v)
		}
	}
	slices.SortFunc(out, func(a, b indexerapi.WorkerView) int {
		if c := strings.Compare(a.ModelName+":"+a.RoutingGroup, b.ModelName+":"+b.RoutingGroup); c != 0 {
			return c
		}
		return cmp.Compare(a.InstanceID, b.InstanceID)
	})
	return out
}

// view is the listener's state: active once a batch has come, failed
// when its subscription could not start.
func (l *listener) view() indexerapi.Listener {
	v := indexerapi.Listener{Endpoint: l.endpoint, ReplayEndpoint: l.replay, Status: indexerapi.StatusPending, LastError: l.err}
	switch {
	case l.src == nil:
		v.Status = indexerapi.StatusFailed
	case l.src.Stats().Batches > 0:
		v.Status = indexerapi.StatusActive
	}
	return v
}

// aggregate is an instance's status: failed before pending before active.
func aggregate(ls map[string]indexerapi.Listener) string {
	st := indexerapi.StatusActive
	for _, l := range ls {
		switch {
		case l.Status == indexerapi.StatusFailed:
			return l.Status
		case l.Status == indexerapi.StatusPending:
			st = l.Status
		}
	}
	return st
}

// Group implements indexerapi.Backend.
func (s *Service) Group(key indexerapi.GroupKey) (indexerapi.Group, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	g := s.groups[key]
	if g == nil {
		return nil, fmt.Errorf("%w: no indexer for model=%s routing_group=%s", indexerapi.ErrNotFound, key.Model, key.Group)
	}
	return indexerapi.RouterGroup{Router: g.r}, nil
}

// Groups implements indexerapi.Backend.
func (s *Service) Groups() []indexerapi.GroupKey {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Collect(maps.Keys(s.groups))
}

// recover loads the registrations and indexes of the first peer that
// answers: its indexes first, then its workers are subscribed to, whose
// streams then replay what the dump may have missed.
func (s *Service) recover() {
	for _, peer := range s.cfg.Peers {
		if err := s.recoverFrom(peer); err != nil {
			s.log.Warn("peer recovery failed; trying the next peer", "peer", peer, "err", err)
			continue
		}
		return
	}
	if len(s.cfg.Peers) > 0 {
		s.log.Warn("no peer answered; starting with an empty index", "peers", strings.Join(s.cfg.Peers, ","))
	}
}

func (s *Service) recoverFrom(peer string) error {
	timeout := s.cfg.PeerTimeout
	if timeout <= 0 {
		timeout = 10 * time.Second
	}
	ctx, cancel := context.WithTimeout(s.ctx, timeout)
	defer cancel()
	client := &http.Client{}
	workers, err := indexerapi.FetchWorkers(ctx, client, peer)
	if err != nil {
		return err
	}
	dump, err := indexerapi.FetchDump(ctx, client, peer)
	if err != nil {
		return err
	}
	events := 0
	for key, d := range dump {
		r, err := s.indexFor(key, d.BlockSize)
		if err != nil {
			s.log.Warn("peer's index skipped", "peer", peer, "index", key.String(), "err", err)
			continue
		}
		ranks := map[uint64]int{}
		for _, ev := range d.Events {
			ranks[ev.Worker.ID] = max(ranks[ev.Worker.ID], int(ev.Worker.DPRank)+1)
		}
		for id, n := range ranks {
			r.AddWorker(router.WorkerInfo{ID: id, DPSize: n, BlockSize: d.BlockSize})
		}
		for i := range d.Events {
			if r.ApplyEvent(&d.Events[i]) == nil {
				events++
			}
		}
	}
	registered := 0
	for _, w := range workers {
		for rk, ep := range w.Endpoints {
			rank, err := strconv.ParseUint(rk, 10, 32)
			if err != nil {
				continue
			}
			// Without the replay endpoint the batches published between
			// the peer's dump and this subscription's joining would be
			// lost for good: nothing else carries them.
			reg := indexerapi.Registration{InstanceID: w.InstanceID, DPRank: uint32(rank), Endpoint: ep,
				ReplayEndpoint: w.Listeners[rk].ReplayEndpoint,
				Key:            indexerapi.GroupKey{Model: w.ModelName, Group: w.RoutingGroup}, BlockSize: w.BlockSize}
			if err := s.Register(reg); err != nil {
				s.log.Warn("peer's worker not registered", "peer", peer, "instance", w.InstanceID, "err", err)
				continue
			}
			registered++
		}
	}
	s.log.Info("recovered from peer", "peer", peer, "indexes", len(dump), "events", events, "listeners", registered)
	return nil
}

// indexFor is the index of key, made with blockSize if there is none.
func (s *Service) indexFor(key indexerapi.GroupKey, blockSize int) (*router.Router, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if g := s.groups[key]; g != nil {
		if g.r.BlockSize() != blockSize {
			return nil, fmt.Errorf("%w: block size %d here, %d at the peer", indexerapi.ErrConflict, g.r.BlockSize(), blockSize)
		}
		return g.r, nil
	}
	r, err := s.newIndex(blockSize)
	if err != nil {
		return nil, err
	}
	s.groups[key] = &group{key: key, r: r, insts: map[uint64]*instance{}}
	return r, nil
}
