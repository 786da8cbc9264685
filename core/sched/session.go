package sched

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/core/kv"
)

// DefaultSessionTimeout is the sliding TTL of a session pin when the request
// gives none.
const DefaultSessionTimeout = 300 * time.Second

// Bounds of the session store: ids and timeouts come from clients, and a
// pin is held until its timeout runs out, so each is bounded.
const (
	DefaultMaxSessions       = 100_000
	DefaultMaxSessionIDBytes = 256
	DefaultMaxSessionTimeout = 24 * time.Hour
)

// ErrTooManySessions is Select's answer to a new pin when the store is full
// of live ones.
var ErrTooManySessions = errors.New("sched: too many open sessions")

// SessionLimits bound what clients can make the session store hold; zero
// fields take the defaults.
type SessionLimits struct {
	MaxSessions int           // live pins at once
	MaxIDBytes  int           // length of a session id
	MaxTimeout  time.Duration // a pin's sliding TTL
}

func (l SessionLimits) withDefaults() SessionLimits {
	if l.MaxSessions <= 0 {
		l.MaxSessions = DefaultMaxSessions
	}
	if l.MaxIDBytes <= 0 {
		l.MaxIDBytes = DefaultMaxSessionIDBytes
	}
	if l.MaxTimeout <= 0 {
		l.MaxTimeout = DefaultMaxSessionTimeout
	}
	return l
}

// check reports what is wrong with c for the limits, in the request's
// terms.
func (l SessionLimits) check(c *SessionControl) error {
	switch {
	case c.ID == "":
		return fmt.Errorf("%w: session_control needs a session_id", ErrInvalidRequest)
	case len(c.ID) > l.MaxIDBytes:
		return fmt.Errorf("%w: session_control.session_id is %d bytes long, at most %d are allowed", ErrInvalidRequest, len(c.ID), l.MaxIDBytes)
	case c.Timeout > l.MaxTimeout:
		return fmt.Errorf("%w: session_control.timeout is %v s, at most %v s is allowed", ErrInvalidRequest, c.Timeout.Seconds(), l.MaxTimeout.Seconds())
	}
	return nil
}

// SessionAction is nvext.session_control.action.
type SessionAction string

const (
	// SessionUse ("" on the wire) follows an existing pin without changing it.
	SessionUse SessionAction = ""
	// SessionOpen and SessionBind pin the session to the worker this request
	// goes to. They differ only for the engine (open also starts an engine
	// session), which is the caller's business.
	SessionOpen SessionAction = "open"
	SessionBind SessionAction = "bind"
	// SessionClose routes by the pin one last time, then drops it.
	SessionClose SessionAction = "close"
)

// ParseSessionAction validates a wire value, so that a typo is a client
// error rather than a silently unpinned session.
func ParseSessionAction(s string) (SessionAction, error) {
	switch a := SessionAction(s); a {
	case SessionUse, SessionOpen, SessionBind, SessionClose:
		return a, nil
	}
	return "", fmt.Errorf("sched: unknown session action %q (valid: open, bind, close)", s)
}

// SessionAffinity is how firmly a session keeps its worker
// (--router-session-affinity-mode).
type SessionAffinity string

const (
	// AffinityHard keeps a session on its worker while the worker is
	// among the candidates, busy or not: the session's state lives there.
	AffinityHard SessionAffinity = "hard"
	// AffinitySoft lets the binding give way, and move to the worker the
	// policy chooses, when its worker is gone or much busier (see
	// MuchBusier).
	AffinitySoft SessionAffinity = "soft"
)

// ParseSessionAffinity reads --router-session-affinity-mode.
func ParseSessionAffinity(s string) (SessionAffinity, error) {
	switch a := SessionAffinity(strings.ToLower(strings.TrimSpace(s))); a {
	case AffinityHard, AffinitySoft:
		return a, nil
	}
	return "", fmt.Errorf("sched: unknown session affinity mode %q (valid: hard, soft)", s)
}

// MuchBusierFactor is how many times the least loaded candidate's load a
// soft binding's worker may carry (beyond the request's own prompt)
// before the binding gives way.
const MuchBusierFactor = 2

// MuchBusier reports whether cands[i], a soft binding's worker, is much
// busier than the fleet: busy by the thresholds, or carrying a load
// (prompt tokens awaiting prefill, in blocks, plus active decode blocks)
// above MuchBusierFactor × the least loaded candidate's plus the
// request's prompt blocks. The prompt term is what moving costs at most
// (the new worker prefills the prompt anew), so a binding never gives way
// for a difference smaller than the work it would throw away, and at low
// load it holds.
func MuchBusier(req *Request, cands []Candidate, i int) bool {
	if req.Busy.Busy(&cands[i]) {
		return true
	}
	bs := float64(req.BlockSize)
	load := func(c *Candidate) float64 { return float64(c.ActivePrefillTokens)/bs + c.ActiveDecodeBlocks }
	least := load(&cands[0])
	for j := 1; j < len(cands); j++ {
		least = min(least, load(&cands[j]))
	}
	return load(&cands[i]) > MuchBusierFactor*least+math.Ceil(float64(req.ISL)/bs)
}

// SessionControl is a request's session_control.
type SessionControl struct {
	ID     string
	Action SessionAction
	// Timeout is the pin's sliding TTL; ≤ 0 means DefaultSessionTimeout.
	Timeout time.Duration
}

// Sessions maps session ids to the worker they are pinned to. A pin lives
// for its timeout after its last use. Expired pins are dropped when looked
// up; Sweep drops the ones nobody asks for again. Safe for concurrent use.
type Sessions struct {
	limits   SessionLimits
	mu       sync.Mutex // guards pins; held only for map access, never across calls out
	pins     map[string]pin
	observer atomic.Pointer[func(SessionUpdate)] // see SetObserver
}

type pin struct {
	worker   kv.Worker
	ttl      time.Duration
	lastUsed time.Time
	seq      uint64 // see SessionUpdate.Seq
}

func (p pin) expired(now time.Time) bool { return now.Sub(p.lastUsed) >= p.ttl }

// supersedes reports whether p is a later binding than the one numbered
// seq to w. Of two bindings with the same number, made by two replicas
// at once, the one to the lower worker wins: every replica picks the same
// one without asking the others.
func (p pin) supersedes(seq uint64, w kv.Worker) bool {
	if p.seq != seq {
		return p.seq > seq
	}
	return p.worker.ID < w.ID || p.worker.ID == w.ID && p.worker.DPRank < w.DPRank
}

// SessionUpdateKind says what a SessionUpdate did to a binding.
type SessionUpdateKind uint8

// The kinds of session updates.
const (
	SessionBound     SessionUpdateKind = iota + 1 // bound to a worker, anew or moved
	SessionRefreshed                              // used: its TTL restarts
	SessionClosed                                 // closed: unbound
)

func (k SessionUpdateKind) String() string {
	switch k {
	case SessionBound:
		return "bind"
	case SessionRefreshed:
		return "refresh"
	case SessionClosed:
		return "close"
	}
	return fmt.Sprintf("SessionUpdateKind(%d)", uint8(k))
}

// SessionUpdate is one change a router made to a session's binding, in the
// form another router replica needs to make the same change, so that a
// session keeps its worker whichever replica its requests reach.
type SessionUpdate struct {
	Kind   SessionUpdateKind
	ID     string
	Worker kv.Worker
	// TTL is the binding's sliding timeout; the receiver counts it from
	// when the update arrives, on its own clock.
	TTL time.Duration
	// Seq numbers a session's bindings: a move to another worker takes the
	// next number, so that replicas keep the latest binding whatever order
	// updates cross in. A close unbinds bindings numbered up to its own.
	Seq uint64
}

// SetObserver makes fn see every binding, use and close that requests
// booked through a Scheduler made on this store (queries are not
// observed), in the order they happened; ApplyRemote's changes are not
// observed, so replicas never echo each other. nil removes it. fn runs on
// the routing path, possibly under the router's lock: it must be quick,
// must not block and must not call back into the store.
func (s *Sessions) SetObserver(fn func(SessionUpdate)) {
	if fn == nil {
		s.observer.Store(nil)
		return
	}
	s.observer.Store(&fn)
}

func (s *Sessions) observe(kind SessionUpdateKind, id string, p pin) {
	if fn := s.observer.Load(); fn != nil {
		(*fn)(SessionUpdate{Kind: kind, ID: id, Worker: p.worker, TTL: p.ttl, Seq: p.seq})
	}
}

// ApplyRemote makes a change another replica made: a binding (or a use,
// which carries its binding) is installed or refreshed unless this store
// holds a live binding that supersedes it; a close unbinds a binding
// numbered up to its own. It reports whether anything changed. A binding
// takes a slot like one of this router's own: refused when the store is
// full of live ones.
func (s *Sessions) ApplyRemote(u SessionUpdate, now time.Time) (bool, error) {
	switch {
	case u.ID == "":
		return false, errors.New("sched: session update without a session id")
	case len(u.ID) > s.limits.MaxIDBytes:
		return false, fmt.Errorf("sched: session id of %d bytes, at most %d are allowed", len(u.ID), s.limits.MaxIDBytes)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	p, held := s.pins[u.ID]
	switch u.Kind {
	case SessionBound, SessionRefreshed:
		ttl := u.TTL
		if ttl <= 0 {
			ttl = DefaultSessionTimeout
		}
		ttl = min(ttl, s.limits.MaxTimeout)
		if held && !p.expired(now) && p.supersedes(u.Seq, u.Worker) {
			return false, nil
		}
		if !held && len(s.pins) >= s.limits.MaxSessions {
			s.sweepLocked(now)
			if len(s.pins) >= s.limits.MaxSessions {
				return false, fmt.Errorf("%w: %d sessions are open, the most this router holds", ErrTooManySessions, len(s.pins))
			}
		}
		s.pins[u.ID] = pin{worker: u.Worker, ttl: ttl, lastUsed: now, seq: u.Seq}
		return true, nil
	case SessionClosed:
		if !held || p.seq > u.Seq {
			return false, nil
		}
		delete(s.pins, u.ID)
		return true, nil
	}
	return false, fmt.Errorf("sched: unknown session update kind %d", uint8(u.Kind))
}

// NewSessions returns an empty store bounded by limits.
func NewSessions(limits SessionLimits) *Sessions {
	return &Sessions{limits: limits.withDefaults(), pins: map[string]pin{}}
}

// Lookup returns the worker id is pinned to and, since being looked up is a
// use, restarts its TTL.
func (s *Sessions) Lookup(id string, now time.Time) (kv.Worker, bool) {
	p, ok := s.lookup(id, now)
	return p.worker, ok
}

func (s *Sessions) lookup(id string, now time.Time) (pin, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	p, ok := s.pins[id]
	if !ok {
		return pin{}, false
	}
	if p.expired(now) {
		delete(s.pins, id)
		return pin{}, false
	}
	p.lastUsed = now
	s.pins[id] = p
	return p, true
}

// Bind pins id to w, replacing any earlier pin; ttl ≤ 0 means
// DefaultSessionTimeout. A new id finding the store full of live pins is
// refused with ErrTooManySessions: expired pins are swept first, so only
// sessions still in use count.
func (s *Sessions) Bind(id string, w kv.Worker, ttl time.Duration, now time.Time) error {
	_, err := s.bind(id, w, ttl, now)
	return err
}

// bind is Bind, returning the pin made. A move to another worker takes
// the next number after the binding it replaces, expired or not.
func (s *Sessions) bind(id string, w kv.Worker, ttl time.Duration, now time.Time) (pin, error) {
	if ttl <= 0 {
		ttl = DefaultSessionTimeout
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	old, ok := s.pins[id]
	if !ok && len(s.pins) >= s.limits.MaxSessions {
		s.sweepLocked(now)
		if len(s.pins) >= s.limits.MaxSessions {
			return pin{}, fmt.Errorf("%w: %d sessions are open, the most this router holds", ErrTooManySessions, len(s.pins))
		}
	}
	p := pin{worker: w, ttl: ttl, lastUsed: now, seq: 1}
	if ok {
		p.seq = old.seq
		if old.worker != w {
			p.seq++
		}
	}
	s.pins[id] = p
	return p, nil
}

// full reports whether a new id would be refused now.
func (s *Sessions) full(id string, now time.Time) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.pins[id]; ok || len(s.pins) < s.limits.MaxSessions {
		return false
	}
	s.sweepLocked(now)
	return len(s.pins) >= s.limits.MaxSessions
}

// Unbind drops id's pin, if any.
func (s *Sessions) Unbind(id string) { s.unbind(id) }

// unbind is Unbind, returning the pin dropped.
func (s *Sessions) unbind(id string) (pin, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	p, ok := s.pins[id]
	delete(s.pins, id)
	return p, ok
}

// Sweep drops every pin expired at now and returns how many it dropped.
// Call it periodically to bound memory for sessions that end without close.
func (s *Sessions) Sweep(now time.Time) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.sweepLocked(now)
}

func (s *Sessions) sweepLocked(now time.Time) int {
	n := 0
	for id, p := range s.pins {
		if p.expired(now) {
			delete(s.pins, id)
			n++
		}
	}
	return n
}

// Len is the number of pins held, expired ones not yet swept included.
func (s *Sessions) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.pins)
}
