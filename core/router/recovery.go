package router

import (
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/core/kv"
)

// A rank whose events hang below blocks the index never saw (its event
// history was lost: a router started after the engine's replay ring
// wrapped, or a gap replay could not close) would stay blind: vLLM's events
// carry no position, engines keep hot prefixes forever, and every new
// Stored chains off one of them. The router itself knows where such
// blocks sit: it has just routed the requests that made the engine store
// them. While a rank is recovering, the prompts booked to it are kept, and
// a Stored event with an unknown parent whose first blocks appear at
// position k ≥ 1 of one of them is placed there: its parent is that
// prompt's block k−1, and the engine holds blocks 0..k−1 (see
// index.Config.Locate for how the index keeps those it infers).

// DefaultRecoveryWindow is how long a rank counts as recovering after its
// last event with an unknown parent.
const DefaultRecoveryWindow = 30 * time.Second

// recentRoutes is how many prompts booked to a recovering rank are kept to
// place its events: those still prefilling and decoding, with margin.
const recentRoutes = 512

// Recovery describes a rank rebuilding its index from traffic.
type Recovery struct {
	Worker kv.Worker
	Since  time.Time // first event with an unknown parent of this episode
	Last   time.Time // latest one
	// Refused are the events no recent prompt could place, Reanchored
	// those placed, during this episode.
	Refused, Reanchored uint64
	// Inferred is how many of the rank's blocks are held on inference.
	Inferred int
}

type recovery struct {
	window time.Duration
	now    func() time.Time
	// active counts ranks in ranks, so that booking skips the lock when
	// no rank recovers.
	active atomic.Int32
	mu     sync.Mutex
	ranks  map[kv.Worker]*rankRecovery
}

type rankRecovery struct {
	Recovery
	prompts [][]uint64 // local hashes of the latest booked prompts, a ring
	next    int
}

func newRecovery(window time.Duration, now func() time.Time) *recovery {
	if window <= 0 {
		window = DefaultRecoveryWindow
	}
	return &recovery{window: window, now: now, ranks: map[kv.Worker]*rankRecovery{}}
}

// rankLocked returns w's episode, ending one that timed out; nil if none.
func (rc *recovery) rankLocked(w kv.Worker, now time.Time) *rankRecovery {
	rr := rc.ranks[w]
	if rr != nil && now.Sub(rr.Last) > rc.window {
		rc.endLocked(w)
		return nil
	}
	return rr
}

func (rc *recovery) endLocked(w kv.Worker) {
	delete(rc.ranks, w)
	rc.active.Add(-1)
}

// booked keeps the local hashes of a prompt booked to w while w recovers.
func (rc *recovery) booked(w kv.Worker, local []uint64) {
	if rc.active.Load() == 0 || len(local) < 2 {
		return
	}
	rc.mu.Lock()
	defer rc.mu.Unlock()
	rr := rc.rankLocked(w, rc.now())
	if rr == nil {
		return
	}
	kept := slices.Clone(local)
	if len(rr.prompts) < recentRoutes {
		rr.prompts = append(rr.prompts, kept)
		return
	}
	rr.prompts[rr.next] = kept
	rr.next = (rr.next + 1) % recentRoutes
}

// locate is the index's Locator: the path down to the parent of blocks,
// from the recent prompt that agrees with most of them (the newest on a
// tie), or nil.
func (rc *recovery) locate(w kv.Worker, blocks []kv.Block) []uint64 {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	now := rc.now()
	rr := rc.rankLocked(w, now)
	if rr == nil {
		rr = &rankRecovery{Recovery: Recovery{Worker: w, Since: now}}
		rc.ranks[w] = rr
		rc.active.Add(1)
	}
	rr.Last = now
	var best []uint64
	bestLen := 0
	for i := range rr.prompts {
		p := rr.prompts[(rr.next+len(rr.prompts)-1-i)%len(rr.prompts)] // newest first
		for k := 1; k < len(p); k++ {
			n := agree(p[k:], blocks)
			if n > bestLen {
				best, bestLen = p[:k], n
			}
		}
	}
	if best == nil {
		rr.Refused++
		return nil
	}
	rr.Reanchored++
	return best
}

// agree is how many leading blocks have the local hashes of prompt.
func agree(prompt []uint64, blocks []kv.Block) int {
	n := 0
	for n < len(prompt) && n < len(blocks) && prompt[n] == blocks[n].LocalHash {
		n++
	}
	return n
}

// snapshot lists the recovering ranks, ending episodes that timed out.
func (rc *recovery) snapshot() []Recovery {
	if rc.active.Load() == 0 {
		return nil
	}
	rc.mu.Lock()
	defer rc.mu.Unlock()
	now := rc.now()
	var out []Recovery
	for w := range rc.ranks {
		if rr := rc.rankLocked(w, now); rr != nil {
			out = append(out, rr.Recovery)
		}
	}
	slices.SortFunc(out, func(a, b Recovery) int {
		if c := cmpU64(a.Worker.ID, b.Worker.ID); c != 0 {
			return c
		}
		return cmpU64(uint64(a.Worker.DPRank), uint64(b.Worker.DPRank))
	})
	return out
}

// forget ends the episodes of every rank of engine id.
func (rc *recovery) forget(id uint64) {
	rc.mu.Lock()
	defer rc.mu.Unlock()
	for w := range rc.ranks {
		if w.ID == id {
			rc.endLocked(w)
		}
	}
}

// Recovering lists the ranks rebuilding their index from traffic: those
// with an event below an unknown parent in the last RecoveryWindow.
func (r *Router) Recovering() []Recovery {
	out := r.recovery.snapshot()
	for i := range out {
		if r.exact != nil {
			out[i].Inferred = r.exact.Inferred(out[i].Worker)
		}
	}
	return out
}
