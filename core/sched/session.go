package sched

import (
	"fmt"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/core/kv"
)

// DefaultSessionTimeout is the sliding TTL of a session pin when the request
// gives none.
const DefaultSessionTimeout = 300 * time.Second

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
	mu   sync.Mutex // guards pins; held only for map access, never across calls out
	pins map[string]pin
}

type pin struct {
	worker   kv.Worker
	ttl      time.Duration
	lastUsed time.Time
}

func (p pin) expired(now time.Time) bool { return now.Sub(p.lastUsed) >= p.ttl }

// NewSessions returns an empty store.
func NewSessions() *Sessions { return &Sessions{pins: map[string]pin{}} }

// Lookup returns the worker id is pinned to and, since being looked up is a
// use, restarts its TTL.
func (s *Sessions) Lookup(id string, now time.Time) (kv.Worker, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	p, ok := s.pins[id]
	if !ok {
		return kv.Worker{}, false
	}
	if p.expired(now) {
		delete(s.pins, id)
		return kv.Worker{}, false
	}
	p.lastUsed = now
	s.pins[id] = p
	return p.worker, true
}

// Bind pins id to w, replacing any earlier pin; ttl ≤ 0 means
// DefaultSessionTimeout.
func (s *Sessions) Bind(id string, w kv.Worker, ttl time.Duration, now time.Time) {
	if ttl <= 0 {
		ttl = DefaultSessionTimeout
	}
	s.mu.Lock()
	s.pins[id] = pin{worker: w, ttl: ttl, lastUsed: now}
	s.mu.Unlock()
}

// Unbind drops id's pin, if any.
func (s *Sessions) Unbind(id string) {
	s.mu.Lock()
	delete(s.pins, id)
	s.mu.Unlock()
}

// Sweep drops every pin expired at now and returns how many it dropped.
// Call it periodically to bound memory for sessions that end without close.
func (s *Sessions) Sweep(now time.Time) int {
	s.mu.Lock()
	defer s.mu.Unlock()
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
