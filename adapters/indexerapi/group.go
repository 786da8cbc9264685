package indexerapi

import (
	"github.com/kvrouter/kvrouter/core/index"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
)

// RouterGroup serves a router's event-fed index as a Group: the
// standalone indexer keeps one router per model and routing group, and a
// router run with --serve-indexer serves its own. Only the ranks Serves
// accepts are listed; nil accepts every rank.
type RouterGroup struct {
	Router *router.Router
	Serves func(router.WorkerInfo) bool
}

// BlockSize implements Group.
func (g RouterGroup) BlockSize() int { return g.Router.BlockSize() }

// served are the engines Serves accepts; nil when it accepts all.
func (g RouterGroup) served() map[uint64]bool {
	if g.Serves == nil {
		return nil
	}
	keep := map[uint64]bool{}
	for _, info := range g.Router.Workers() {
		keep[info.ID] = g.Serves(info)
	}
	return keep
}

// Match implements Group.
func (g RouterGroup) Match(m *index.Matcher, seq []uint64) ([]index.Overlap, []index.TierOverlap) {
	dev, tiers, _ := g.Router.PrimaryMatch(m, seq)
	keep := g.served()
	if keep == nil {
		return dev, tiers
	}
	out := dev[:0:0]
	for _, o := range dev {
		if keep[o.Worker.ID] {
			out = append(out, o)
		}
	}
	var outT []index.TierOverlap
	for _, t := range tiers {
		if keep[t.Worker.ID] {
			outT = append(outT, t)
		}
	}
	return out, outT
}

// DumpTo implements Group.
func (g RouterGroup) DumpTo(d *index.Dumper, visit func([]kv.Event) error) error {
	keep := g.served()
	if keep == nil {
		return g.Router.DumpEventsTo(d, visit)
	}
	var kept []kv.Event
	return g.Router.DumpEventsTo(d, func(evs []kv.Event) error {
		kept = kept[:0]
		for _, ev := range evs {
			if keep[ev.Worker.ID] {
				kept = append(kept, ev)
			}
		}
		return visit(kept)
	})
}
