package sched

import (
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/core/kv"
)

// Errors of Select. ErrAllBusy is the one a frontend turns into 503.
var (
	ErrInvalidRequest = errors.New("sched: invalid request")
	ErrNoCandidates   = errors.New("sched: no workers to choose from")
	ErrAllBusy        = errors.New("sched: all workers are busy")
	ErrUnknownWorker  = errors.New("sched: requested worker is not among the candidates")
	ErrNoTarget       = errors.New("sched: direct mode needs the request to name a worker")
)

// Request is what Select needs to know about one request besides the
// candidates.
type Request struct {
	ISL int // prompt tokens
	// OSL is the expected output length (nvext agent_hints.osl), 0 when
	// not given.
	OSL       int
	meanOSL   float64 // set by Select
	BlockSize int     // tokens per KV block, > 0
	Params    Params
	// Target names the worker to use (nvext backend_instance_id and
	// dp_rank); the caller fills DPRank, 0 when the client gave none. A
	// named worker is used in every mode, not only in ModeDirect, unless
	// it is busy: a pin must not let a client pile work on an overloaded
	// engine.
	Target *kv.Worker
	// OverrideBusy sends a Target to its worker even when it is busy: an
	// operator's pin.
	OverrideBusy bool
	// Session, when set, routes by and maintains a session pin.
	Session *SessionControl
	// Busy are the thresholds of the request's model (Thresholds.Get).
	Busy BusyThreshold
	// Now is the time sessions are judged by.
	Now time.Time
	// Tokens is the prompt, for the policies that keep their own view of
	// what each worker has seen (sglang-cache-aware, gie-approx-prefix).
	Tokens []uint32
	// Commit says the choice will be booked: the policies that learn from
	// their own decisions record it. A query-only decision leaves them as
	// they were.
	Commit bool
	// Pool tells apart the candidate sets of one fleet that stateful
	// policies keep apart (round-robin cycles each on its own): 0 for the
	// decode-capable workers, PoolPrefill for a disaggregated request's
	// prefill workers.
	Pool int
	// Lightest, when not nil, is LightestOf the candidates given to
	// Select, summarised by the caller while it built them: at a thousand
	// candidates a pass over them less. Select does not pass it on to a
	// policy that sees only some of them.
	Lightest *Lightest
}

// PoolPrefill is Request.Pool of a disaggregated request's prefill half.
const PoolPrefill = 1

// Via tells how a Choice was made, for metrics and logs.
type Via uint8

const (
	ViaPolicy  Via = iota // the mode's policy chose among non-busy workers
	ViaTarget             // the request named the worker
	ViaSession            // the session was pinned to the worker
)

func (v Via) String() string {
	switch v {
	case ViaPolicy:
		return "policy"
	case ViaTarget:
		return "target"
	case ViaSession:
		return "session"
	}
	return "unknown"
}

// Choice is the outcome of Select. Index points into the candidates given
// to Select, so the caller can read the chosen worker's overlap and loads.
type Choice struct {
	Index  int
	Worker kv.Worker
	Via    Via
}

// Scheduler applies one routing mode. It is safe for concurrent use as
// long as the Rand given to Select is.
type Scheduler struct {
	mode     Mode
	policy   policy
	sessions *Sessions
	affinity SessionAffinity
	// oslSum and oslN are the output-length hints of the booked requests,
	// for their mean (Lightest.MeanOSL).
	oslSum, oslN atomic.Uint64
}

// meanOSL books req's output-length hint when req is committed and returns
// the mean hint so far (req's included), 0 before any.
func (s *Scheduler) meanOSL(req *Request) float64 {
	if req.OSL <= 0 {
		return 0
	}
	sum, n := s.oslSum.Load(), s.oslN.Load()
	if req.Commit {
		sum, n = s.oslSum.Add(uint64(req.OSL)), s.oslN.Add(1)
	} else {
		sum, n = sum+uint64(req.OSL), n+1
	}
	return float64(sum) / float64(n)
}

// New returns a scheduler for mode. sessions may be nil, in which case
// session control is ignored.
func New(mode Mode, sessions *Sessions) (*Scheduler, error) {
	mk, ok := policies[mode]
	if !ok {
		_, err := ParseMode(string(mode))
		return nil, err
	}
	return &Scheduler{mode: mode, policy: mk(), sessions: sessions}, nil
}

// SetSessionAffinity sets how firmly sessions keep their worker; the
// default is AffinityHard. Call it before the first Select.
func (s *Scheduler) SetSessionAffinity(a SessionAffinity) { s.affinity = a }

// Mode is the mode the scheduler was built for.
func (s *Scheduler) Mode() Mode { return s.mode }

// Select chooses a worker among cands for req. Precedence: a worker the
// request names (ErrAllBusy when it is busy, unless OverrideBusy); then a
// live session pin to a worker still among cands (session pins bypass busy
// thresholds, since the session's state lives on that worker); then the mode's policy over the workers that are not busy.
//
// Session pins are updated as the actions say. A pin to a worker that has
// gone (or, with AffinitySoft, is much busier) is ignored and, unless the
// action is close, moved to the new choice so the session stays sticky
// from then on.
func (s *Scheduler) Select(req *Request, cands []Candidate, rng Rand) (Choice, error) {
	if req.BlockSize <= 0 || req.ISL < 0 {
		return Choice{}, fmt.Errorf("%w: block size %d, isl %d", ErrInvalidRequest, req.BlockSize, req.ISL)
	}
	if len(cands) == 0 {
		return Choice{}, ErrNoCandidates
	}
	req.meanOSL = s.meanOSL(req)
	if req.Target != nil {
		i := indexOf(cands, *req.Target)
		if i < 0 {
			return Choice{}, fmt.Errorf("%w: %v", ErrUnknownWorker, *req.Target)
		}
		if !req.OverrideBusy && req.Busy.Busy(&cands[i]) {
			return Choice{}, fmt.Errorf("sched: the named worker %v is busy (%w)", *req.Target, ErrAllBusy)
		}
		return Choice{Index: i, Worker: cands[i].Worker, Via: ViaTarget}, nil
	}

	sess := req.Session
	if s.sessions == nil {
		sess = nil
	}
	stale := false
	if sess != nil {
		if _, err := ParseSessionAction(string(sess.Action)); err != nil {
			return Choice{}, fmt.Errorf("%w: %v", ErrInvalidRequest, err)
		}
		if err := s.sessions.limits.check(sess); err != nil {
			return Choice{}, err
		}
		if p, ok := s.sessions.lookup(sess.ID, req.Now); ok {
			if i := indexOf(cands, p.worker); i >= 0 && (s.affinity != AffinitySoft || !MuchBusier(req, cands, i)) {
				if sess.Action == SessionClose {
					s.unbind(req, sess.ID)
				} else if req.Commit {
					s.sessions.observe(SessionRefreshed, sess.ID, p)
				}
				return Choice{Index: i, Worker: p.worker, Via: ViaSession}, nil
			}
			stale = true
		}
	}

	pinning := sess != nil && (sess.Action == SessionOpen || sess.Action == SessionBind || stale && sess.Action == SessionUse)
	if pinning && s.sessions.full(sess.ID, req.Now) {
		// Refused before routing, so that nothing is chosen for a request
		// that will not be served.
		return Choice{}, fmt.Errorf("%w: session %q cannot be opened", ErrTooManySessions, sess.ID)
	}
	i, err := s.route(req, cands, rng)
	if err != nil {
		return Choice{}, err
	}
	if sess != nil {
		switch {
		case pinning:
			// A race with another new session may fill the store between
			// the check and here; this request is routed all the same,
			// unpinned.
			if p, err := s.sessions.bind(sess.ID, cands[i].Worker, sess.Timeout, req.Now); err == nil && req.Commit {
				s.sessions.observe(SessionBound, sess.ID, p)
			}
		case stale && sess.Action == SessionClose:
			s.unbind(req, sess.ID)
		}
	}
	return Choice{Index: i, Worker: cands[i].Worker, Via: ViaPolicy}, nil
}

// unbind closes a session, observed when req is booked.
func (s *Scheduler) unbind(req *Request, id string) {
	if p, ok := s.sessions.unbind(id); ok && req.Commit {
		s.sessions.observe(SessionClosed, id, p)
	}
}

// route runs the policy over the non-busy candidates. The common case, no
// busy worker, copies nothing.
func (s *Scheduler) route(req *Request, cands []Candidate, rng Rand) (int, error) {
	if !req.Busy.enabled() {
		return s.policy.pick(req, cands, rng)
	}
	busy := 0
	for i := range cands {
		if req.Busy.Busy(&cands[i]) {
			busy++
		}
	}
	switch busy {
	case 0:
		return s.policy.pick(req, cands, rng)
	case len(cands):
		return 0, ErrAllBusy
	}
	// The caller's summary is of every candidate, busy ones included.
	all := req.Lightest
	req.Lightest = nil
	defer func() { req.Lightest = all }()
	free := make([]Candidate, 0, len(cands)-busy)
	orig := make([]int, 0, len(cands)-busy)
	for i := range cands {
		if !req.Busy.Busy(&cands[i]) {
			free = append(free, cands[i])
			orig = append(orig, i)
		}
	}
	j, err := s.policy.pick(req, free, rng)
	if err != nil {
		return 0, err
	}
	return orig[j], nil
}

func indexOf(cands []Candidate, w kv.Worker) int {
	for i := range cands {
		if cands[i].Worker == w {
			return i
		}
	}
	return -1
}
