package router

import (
	"sync"
	"sync/atomic"

	"github.com/kvrouter/kvrouter/core/index"
	"github.com/kvrouter/kvrouter/core/kv"
)

// maxRemotePrefills bounds the other replicas' bookings watched for their
// prompt's blocks: a replica that stops sending first tokens and ends
// must not grow it without end (the tracker expires them by its TTL).
const maxRemotePrefills = 1 << 16

// remotePrefills settles another replica's booking's prefill from the
// engine's own KV events. The replica that booked it hears the first token
// and relays it, a hop later than the engine's events reach every replica:
// an engine publishes a step's blocks as the step ends, the step that also
// yields the first token. Until the relayed first token arrives, a replica
// would still count the prompt as prefill work on that engine, and route
// a burst away from an engine a single router already sees free of it.
// Once the engine holds the booking's whole prompt, its prefill has
// ended; the relayed first token that follows is then already applied.
type remotePrefills struct {
	mu sync.Mutex
	// pending are the bookings awaiting their first token, by rank: the
	// sequence hashes the engine will hold once it has prefilled them.
	pending map[kv.Worker]map[string][]uint64
	where   map[string]kv.Worker
	// n counts pending, read without the lock so that a router without
	// replicas pays one atomic load per stored event.
	n atomic.Int64
	// settled are the bookings settled from events, awaiting the relayed
	// first token that is then no news.
	settled map[string]struct{}
	m       index.Matcher
}

// watch starts watching id's prompt on w.
func (p *remotePrefills) watch(id string, w kv.Worker, seq []uint64) {
	if len(seq) == 0 {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.n.Load() >= maxRemotePrefills {
		return
	}
	if p.pending == nil {
		p.pending = map[kv.Worker]map[string][]uint64{}
		p.where = map[string]kv.Worker{}
	}
	byID := p.pending[w]
	if byID == nil {
		byID = map[string][]uint64{}
		p.pending[w] = byID
	}
	if _, dup := byID[id]; !dup {
		p.n.Add(1)
	}
	byID[id] = seq
	p.where[id] = w
}

// ended forgets id, whose first token or end was relayed, and reports
// whether events had already settled its prefill.
func (p *remotePrefills) ended(id string) (settled bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.settled[id]; ok {
		delete(p.settled, id)
		return true
	}
	if w, ok := p.where[id]; ok {
		p.forget(w, id)
	}
	return false
}

func (p *remotePrefills) forget(w kv.Worker, id string) {
	delete(p.pending[w], id)
	delete(p.where, id)
	p.n.Add(-1)
}

// stored returns the bookings on w whose whole prompt ix now holds there,
// and stops watching them until their relayed first token.
func (p *remotePrefills) stored(ix exactIndex, w kv.Worker) []string {
	if p.n.Load() == 0 {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	var done []string
	for id, seq := range p.pending[w] {
		for _, o := range ix.FindMatches(&p.m, seq) {
			if o.Worker == w && int(o.Blocks) >= len(seq) {
				done = append(done, id)
				break
			}
		}
	}
	for _, id := range done {
		p.forget(w, id)
		if p.settled == nil {
			p.settled = map[string]struct{}{}
		}
		if len(p.settled) < maxRemotePrefills {
			p.settled[id] = struct{}{}
		}
	}
	return done
}

// removeWorker forgets the bookings on a rank that left.
func (p *remotePrefills) removeWorker(id uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for w, byID := range p.pending {
		if w.ID == id {
			for q := range byID {
				p.forget(w, q)
			}
		}
	}
}

// remoteStored settles the other replicas' bookings whose prompt w's
// stored event just completed.
func (r *Router) remoteStored(w kv.Worker) {
	done := r.remotePrefill.stored(r.exact, w)
	for _, id := range done {
		if r.tracker.MarkPrefillCompleted(id) {
			r.settlePrediction(id)
		}
	}
	if len(done) > 0 {
		r.drain()
	}
}
