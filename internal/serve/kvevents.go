package serve

import (
	"context"
	"maps"
	"strconv"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/adapters/frontend"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
)

// watchKVEvents logs, once each time, an engine rank that the router
// starts routing by predicted caches because its KV events never came
// (router.Router.Eventless), and its return to the exact index. /health
// and the kvrouter_worker_kv_events_missing gauge say the same at any
// time; the log is what an operator reads first.
func (s *Server) watchKVEvents(ctx context.Context) {
	tick := time.NewTicker(s.cfg.HealthInterval)
	defer tick.Stop()
	reported := map[kv.Worker]bool{}
	overBound := map[kv.Worker]bool{}
	for {
		s.warnOverBound(overBound)
		now := map[kv.Worker]bool{}
		for _, e := range s.router.Eventless() {
			now[e.Worker] = true
			if !reported[e.Worker] {
				s.log.Warn("engine sends no KV events: routing it by predicted cache (approximate) until they come",
					"worker", s.workerName(e.Worker.ID), "dp_rank", e.Worker.DPRank, "serving_since", e.Served, "fix", frontend.KVEventsHint(s.workerEvents(e.Worker.ID)))
			}
		}
		for w := range reported {
			if !now[w] && s.router.KVEvents(w) == router.EventsReceived {
				s.log.Info("engine's KV events arrived: routing it by its exact index again", "worker", s.workerName(w.ID), "dp_rank", w.DPRank)
			}
		}
		reported = now
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// warnOverBound logs, once per rank, an engine whose KV events claim more
// blocks than its capacity allows (index.RankBound): the index refuses the
// rest, /health and kvrouter_worker_kv_blocks_over_bound_total count them.
func (s *Server) warnOverBound(warned map[kv.Worker]bool) {
	for _, ob := range s.router.OverBound() {
		if warned[ob.Worker] {
			continue
		}
		warned[ob.Worker] = true
		s.log.Warn("engine's KV events claim more blocks than its capacity: the index refuses the excess",
			"worker", s.workerName(ob.Worker.ID), "dp_rank", ob.Worker.DPRank, "bound", ob.Bound, "refused", ob.Refused,
			"fix", "check the engine's kv_blocks (every tier it publishes events for) or the engine itself")
	}
}

func (s *Server) workerName(id uint64) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if w := s.workers[id]; w != nil {
		return w.spec.Name
	}
	return "worker-" + strconv.FormatUint(id, 10)
}

func (s *Server) workerEvents(id uint64) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if w := s.workers[id]; w != nil {
		return w.spec.Events
	}
	return ""
}

// queryWatch tells when an engine rank's prefix-cache query counter grows:
// it is computing prompts, served by this router or another.
type queryWatch struct {
	mu   sync.Mutex
	last map[kv.Worker]float64
}

func newQueryWatch() *queryWatch { return &queryWatch{last: map[kv.Worker]float64{}} }

// grew records the counter of w and reports whether it rose since the
// previous reading; the first reading is a baseline, and a fall (an engine
// restart) starts a new one.
func (q *queryWatch) grew(w kv.Worker, v float64) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	prev, seen := q.last[w]
	q.last[w] = v
	return seen && v > prev
}

// forget drops a departed engine's readings.
func (q *queryWatch) forget(id uint64) {
	q.mu.Lock()
	defer q.mu.Unlock()
	maps.DeleteFunc(q.last, func(w kv.Worker, _ float64) bool { return w.ID == id })
}
