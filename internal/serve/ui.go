package serve

import (
	"fmt"
	"slices"

	"github.com/kvrouter/kvrouter/adapters/frontend"
)

// engineStatuses is every engine the registry holds, for the dashboard.
func (s *Server) engineStatuses() []frontend.EngineStatus {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]frontend.EngineStatus, 0, len(s.workers))
	for _, w := range s.workers {
		st := frontend.EngineStatus{ID: w.spec.ID, Name: w.spec.Name, URL: w.spec.URL, Events: w.spec.Events, Model: w.spec.Model, DPSize: w.spec.DPSize, Role: w.spec.Role, State: "down"}
		switch {
		case w.drained:
			st.State = "drained"
		case w.up:
			st.State = "up"
		}
		if !w.up {
			st.Why = w.why
			if st.Why == "" {
				st.Why = "engine url=" + w.spec.URL + " has not answered its first health probe yet"
			}
		}
		for rank, src := range w.sources {
			ss := src.Stats()
			if lost := ss.Gaps - min(ss.Recovered, ss.Gaps); lost > 0 {
				st.Warnings = append(st.Warnings, fmt.Sprintf("dp rank %d: %d replay gaps not recovered (its blocks were dropped and rebuilt)", rank, lost))
			}
			if ss.HistoryLost > 0 {
				st.Warnings = append(st.Warnings, fmt.Sprintf("dp rank %d: event history lost %d times: its index is rebuilt from traffic", rank, ss.HistoryLost))
			}
			for field, n := range ss.Unsupported {
				if st.Unsupported == nil {
					st.Unsupported = map[string]uint64{}
				}
				st.Unsupported[field] += n
			}
		}
		out = append(out, st)
	}
	slices.SortFunc(out, func(a, b frontend.EngineStatus) int {
		switch {
		case a.ID < b.ID:
			return -1
		case a.ID > b.ID:
			return 1
		}
		return 0
	})
	return out
}

// setDrained takes a configured engine out of routing until re-admitted:
// its health probe no longer brings it back. Re-admitting wakes the probe,
// which lets it join as soon as it answers.
func (s *Server) setDrained(id uint64, drained bool) error {
	s.mu.Lock()
	w := s.workers[id]
	if w == nil {
		s.mu.Unlock()
		return frontend.ErrUnknownEngine
	}
	if w.discovered {
		return s.setDiscoveredDrained(w, drained)
	}
	w.drained = drained
	s.notifyLocked()
	s.mu.Unlock()
	if drained {
		s.leave(w, "drained by an operator")
		return nil
	}
	select {
	case w.wake <- struct{}{}:
	default:
	}
	return nil
}

// setDrained for an engine found by discovery: its lease, not a probe,
// says whether it is alive, so draining takes it out of the router only,
// and re-admitting adds it back as its announcement described it. Called
// with s.mu held; releases it.
func (s *Server) setDiscoveredDrained(w *supervised, drained bool) error {
	was := w.drained
	w.drained = drained
	if drained {
		w.up, w.why = false, "engine url="+w.spec.URL+" drained by an operator"
	}
	s.notifyLocked()
	in := w.instance
	s.mu.Unlock()
	switch {
	case drained && !was:
		s.router.RemoveWorker(w.spec.ID)
		s.plane.sub.WorkerRemoved(w.spec.ID)
		s.log.Warn("engine left routing", "worker", w.spec.Name, "why", "drained by an operator")
	case !drained && was:
		s.discovered(in)
	}
	return nil
}
