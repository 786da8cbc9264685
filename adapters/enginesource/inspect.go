package enginesource

import (
	"log/slog"

	"github.com/kvrouter/kvrouter/adapters/vllmevents"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
)

// Inspector applies payloads as a Source does, to a sink that keeps
// nothing, and counts what the router could not honour: `kvrouter doctor`
// reports an engine's unsupported fields with the very code that counts
// them under serve. It has no sockets and no continuity; Apply is not safe
// for concurrent use.
type Inspector struct {
	s   *Source
	seq uint64
}

// NewInspector returns an Inspector for the rank cfg describes; only
// cfg.Worker, cfg.HashBytes and cfg.Logger are used.
func NewInspector(cfg Config) *Inspector {
	return &Inspector{s: detached(cfg, discard{})}
}

// Apply decodes and applies one payload.
func (i *Inspector) Apply(payload []byte) {
	i.s.apply(i.seq, payload, false)
	i.seq++
}

// Unsupported counts, by field name, the events or blocks whose field the
// router could not honour (Stats.Unsupported); nil when none.
func (i *Inspector) Unsupported() map[string]uint64 { return i.s.unsup.snapshot() }

// detached is a Source without a subscriber: apply feeds it by hand.
func detached(cfg Config, sink Sink) *Source {
	logger := cfg.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return &Source{
		cfg: cfg, sink: sink, log: logger, opts: vllmevents.DecodeOptions{HashBytes: cfg.HashBytes},
		done: make(chan struct{}), ranks: map[uint32]struct{}{}, recent: make([]recent, recentSize),
	}
}

type discard struct{}

func (discard) ApplyEvent(*kv.Event) error                   { return nil }
func (discard) ApplyEngineStored(*router.EngineStored) error { return nil }
