package router

import (
	"fmt"

	"github.com/kvrouter/kvrouter/core/sched"
)

// SetSessionObserver makes fn see every change booked requests make to
// session bindings (sched.Sessions.SetObserver), for replicas to share.
// nil removes it.
func (r *Router) SetSessionObserver(fn func(sched.SessionUpdate)) { r.sessions.SetObserver(fn) }

// ApplyRemoteSession makes a change another replica made to a session's
// binding, so that the session's next request keeps its worker whichever
// replica it reaches. It reports whether anything changed (a binding this
// router holds a later one of changes nothing). A binding to a worker rank
// this router does not know is refused: it could never be followed.
func (r *Router) ApplyRemoteSession(u sched.SessionUpdate) (bool, error) {
	if u.Kind != sched.SessionClosed {
		w := u.Worker
		info, ok := r.fleet.Load().infos[w.ID]
		switch {
		case !ok:
			return false, fmt.Errorf("%w: %v", ErrUnknownWorker, w)
		case int(w.DPRank) >= info.DPSize:
			return false, fmt.Errorf("%w: rank %d of %d", ErrDPRankRange, w.DPRank, info.DPSize)
		}
	}
	return r.sessions.ApplyRemote(u, r.now())
}
