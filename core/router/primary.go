package router

import (
	"errors"
	"sync/atomic"

	"github.com/kvrouter/kvrouter/core/index"
)

// A primary index is the event-fed index one process keeps for others:
// a router serving it (--serve-indexer) or the standalone indexer answers
// with PrimaryMatch, and routers that use it (--use-remote-indexer) ask
// through Config.Remote instead of keeping one themselves.

// PrimaryMatch is what this router's event-fed index alone says of seq:
// every rank's device overlap and, when the index holds lower tiers,
// their overlaps on every tier. The predict-on-route side index and the
// approximate index are never consulted: what a router only guessed is
// not served to others. ok is false when the router keeps no event-fed
// index. Both slices are valid until the next call on m.
func (r *Router) PrimaryMatch(m *index.Matcher, seq []uint64) (device []index.Overlap, tiers []index.TierOverlap, ok bool) {
	if r.exact == nil {
		return nil, nil, false
	}
	device = r.exact.FindMatches(m, seq)
	return device, m.Tiers(), true
}

// RemoteIndex is a primary index kept by another process. Overlaps is
// called on the routing path, outside the router's locks, with the
// request's local block hashes (blockhash: keyed by its adapter and salt,
// in the router's block size); it must bound its own wait, since a
// decision waits for it. An error degrades the decision to the local
// approximate index.
type RemoteIndex interface {
	Overlaps(q RemoteQuery) ([]index.Overlap, []index.TierOverlap, error)
}

// RemoteQuery is one question to a RemoteIndex.
type RemoteQuery struct {
	Model string
	// Local are the request's local block hashes, up to the blocks that
	// may be matched.
	Local []uint64
}

// remoteState counts how the remote primary answered.
type remoteState struct {
	idx      RemoteIndex
	answered atomic.Uint64
	failed   atomic.Uint64
}

// RemoteStats counts the answers of the remote primary index.
type RemoteStats struct {
	Answered, Failed uint64
}

// RemoteStats is how often the remote primary answered and failed; zero
// without one.
func (r *Router) RemoteStats() RemoteStats {
	if r.remote == nil {
		return RemoteStats{}
	}
	return RemoteStats{Answered: r.remote.answered.Load(), Failed: r.remote.failed.Load()}
}

// errRemoteWithoutEvents: a remote primary is an event-fed index; without
// events every router's decisions are its cache, and nothing is shared.
var errRemoteWithoutEvents = errors.New("router: a remote indexer needs KV events (drop --no-router-kv-events) and overlap credit")

// matchRemote asks the remote primary; false means it did not answer and
// the approximate index must be read instead.
func (r *Router) matchRemote(p *prepared) bool {
	local := p.local[:p.matchable]
	dev, tiers, err := r.remote.idx.Overlaps(RemoteQuery{Model: p.req.Model, Local: local})
	if err != nil {
		r.remote.failed.Add(1)
		return false
	}
	r.remote.answered.Add(1)
	for _, o := range dev {
		if int(o.Blocks) > len(local) {
			o.Blocks = uint32(len(local)) // a primary never credits more than was asked
		}
		p.overlaps = append(p.overlaps, o)
	}
	p.tiers = append(p.tiers[:0], tiers...)
	for i := range p.tiers {
		t := &p.tiers[i]
		n := uint32(len(local))
		t.Device, t.Host, t.Disk, t.Shared = min(t.Device, n), min(t.Host, n), min(t.Disk, n), min(t.Shared, n-min(t.Device, n))
	}
	return true
}
