package serve

import (
	"cmp"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strconv"

	"github.com/kvrouter/kvrouter/adapters/enginesource"
	"github.com/kvrouter/kvrouter/adapters/indexerapi"
	"github.com/kvrouter/kvrouter/core/router"
)

// IndexerPath is where a router run with --serve-indexer serves its index
// with the standalone indexer's API: other routers use it with
// --use-remote-indexer http://HOST:PORT/indexer.
const IndexerPath = "/indexer"

// errServeAndUseRemote: a router that asks a remote primary keeps no
// event-fed index to serve, and a served index is never a copy of another.
var errServeAndUseRemote = fmt.Errorf("serve: --serve-indexer serves this router's own event-fed index, which --use-remote-indexer replaces with a remote one; give one of the two")

// remoteIndex makes the remote primary of --use-remote-indexer.
func remoteIndex(cfg *Config, log *slog.Logger) (*indexerapi.Remote, error) {
	if cfg.RemoteIndexer == "" {
		return nil, nil
	}
	if cfg.ServeIndexer {
		return nil, errServeAndUseRemote
	}
	return indexerapi.NewRemote(indexerapi.RemoteConfig{URL: cfg.RemoteIndexer, BlockSize: cfg.Router.BlockSize, Timeout: cfg.RemoteIndexerTimeout, Logger: log})
}

// withIndexer mounts the indexer API under IndexerPath beside h.
func (s *Server) withIndexer(h http.Handler) http.Handler {
	if !s.cfg.ServeIndexer {
		return h
	}
	api := indexerapi.New(indexerapi.Config{Backend: servedIndex{s}, Health: s.indexerHealth})
	mux := http.NewServeMux()
	mux.Handle(IndexerPath+"/", http.StripPrefix(IndexerPath, api.Handler()))
	mux.Handle("/", h)
	return mux
}

func (s *Server) indexerHealth() map[string]string {
	return map[string]string{"engines": strconv.Itoa(len(s.liveWorkers())) + " in routing"}
}

// servedIndex is a serving router's index as the indexer API's backend:
// one routing group per model its engines serve, the engines those of its
// configuration and discovery.
type servedIndex struct{ s *Server }

var errRegisterHere = fmt.Errorf("%w: a router's engines come from its --worker flags, its config and discovery; register them there, or run kvrouter indexer", indexerapi.ErrForbidden)

func (b servedIndex) Register(indexerapi.Registration) error { return errRegisterHere }

func (b servedIndex) Unregister(uint64, string, *string, *uint32) error { return errRegisterHere }

func (b servedIndex) Workers(model, group string) []indexerapi.WorkerView {
	if group != "" && group != indexerapi.DefaultRoutingGroup {
		return nil
	}
	b.s.mu.Lock()
	defer b.s.mu.Unlock()
	var out []indexerapi.WorkerView
	for _, w := range b.s.workers {
		if model != "" && w.spec.Model != model && w.spec.Model != "" {
			continue
		}
		v := indexerapi.WorkerView{InstanceID: w.spec.ID, Source: "zmq", Status: indexerapi.StatusPending, ModelName: w.spec.Model,
			RoutingGroup: indexerapi.DefaultRoutingGroup, BlockSize: b.s.router.BlockSize(), Endpoints: map[string]string{}, Listeners: map[string]indexerapi.Listener{}}
		if w.up {
			v.Status = indexerapi.StatusActive
		}
		for rank := range max(w.spec.DPSize, 1) {
			ep, _ := enginesource.RankEndpoint(w.spec.Events, rank)
			replay, _ := enginesource.RankEndpoint(w.spec.Replay, rank)
			k := strconv.Itoa(rank)
			v.Endpoints[k] = ep
			v.Listeners[k] = indexerapi.Listener{Endpoint: ep, ReplayEndpoint: replay, Status: v.Status}
		}
		out = append(out, v)
	}
	slices.SortFunc(out, func(a, b indexerapi.WorkerView) int { return cmp.Compare(a.InstanceID, b.InstanceID) })
	return out
}

func (b servedIndex) models() []string {
	b.s.mu.Lock()
	defer b.s.mu.Unlock()
	var out []string
	for _, w := range b.s.workers {
		if !slices.Contains(out, w.spec.Model) {
			out = append(out, w.spec.Model)
		}
	}
	return out
}

func (b servedIndex) Group(key indexerapi.GroupKey) (indexerapi.Group, error) {
	models := b.models()
	if key.Group != indexerapi.DefaultRoutingGroup || (!slices.Contains(models, key.Model) && !slices.Contains(models, "")) {
		return nil, fmt.Errorf("%w: no indexer for model=%s routing_group=%s", indexerapi.ErrNotFound, key.Model, key.Group)
	}
	return indexerapi.RouterGroup{Router: b.s.router, Serves: func(info router.WorkerInfo) bool {
		return info.Model == "" || info.Model == key.Model
	}}, nil
}

func (b servedIndex) Groups() []indexerapi.GroupKey {
	var out []indexerapi.GroupKey
	for _, m := range b.models() {
		out = append(out, indexerapi.GroupKey{Model: m, Group: indexerapi.DefaultRoutingGroup})
	}
	return out
}
