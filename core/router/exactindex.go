package router

import (
	"errors"

	"github.com/kvrouter/kvrouter/core/index"
	"github.com/kvrouter/kvrouter/core/kv"
)

// exactIndex is what the router asks of its event-fed index: index.Index,
// or index.Single for a caller on one goroutine (Config.OneGoroutine).
type exactIndex interface {
	Apply(ev *kv.Event) error
	FindMatches(m *index.Matcher, seq []uint64) []index.Overlap
	Reserve(w kv.Worker, blocks int)
	RemoveWorker(id uint64)
	RemoveRank(w kv.Worker)
	Blocks(w kv.Worker) int
	Held(w kv.Worker) []uint64
	HeldOn(w kv.Worker, tier kv.StorageTier) ([]uint64, bool)
	Inferred(w kv.Worker) int
	OverBound() []index.OverBound
	Pairs() uint64
	Stats() index.Stats
}

// ErrNoDump is returned by DumpEventsTo of a router whose index keeps no
// dumps (Config.OneGoroutine).
var ErrNoDump = errors.New("router: this router's index keeps no dumps (one-goroutine index)")
