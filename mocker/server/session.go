package server

import (
	"encoding/json"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// maxEngineSessions bounds the sessions one engine holds: ids come from
// clients, and a session that is never closed lives until its timeout.
const maxEngineSessions = 100_000

// openSessionRequest is the body of SGLang's /open_session.
type openSessionRequest struct {
	CapacityOfStrLen *int     `json:"capacity_of_str_len"`
	SessionID        *string  `json:"session_id"`
	Streaming        *bool    `json:"streaming"`
	Timeout          *float64 `json:"timeout"` // seconds of inactivity
}

// closeSessionRequest is the body of SGLang's /close_session.
type closeSessionRequest struct {
	SessionID *string `json:"session_id"`
}

// sessions are the engine sessions opened through /open_session. The
// mocker keeps no per-session KV state (its prefix cache already keeps a
// conversation's blocks); it keeps the bookkeeping a router can observe:
// which ids are open, a duplicate open refused, a timeout that ends them.
type sessions struct {
	mu      sync.Mutex
	open    map[string]engineSession
	next    uint64
	now     func() time.Time
	entered int // opens accepted, for the metric
}

type engineSession struct {
	timeout  time.Duration // 0: until closed
	lastUsed time.Time
}

func (e engineSession) expired(now time.Time) bool {
	return e.timeout > 0 && now.Sub(e.lastUsed) >= e.timeout
}

func (ss *sessions) init() {
	if ss.open == nil {
		ss.open = map[string]engineSession{}
	}
	if ss.now == nil {
		ss.now = time.Now
	}
}

// add opens id ("" picks one) and returns it; ok is false when id is
// already open or the engine holds its maximum.
func (ss *sessions) add(id string, timeout time.Duration) (string, bool) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	ss.init()
	now := ss.now()
	ss.sweep(now)
	if id == "" {
		ss.next++
		id = "mock-session-" + strconv.FormatUint(ss.next, 36)
	}
	if _, dup := ss.open[id]; dup || len(ss.open) >= maxEngineSessions {
		return "", false
	}
	ss.open[id] = engineSession{timeout: timeout, lastUsed: now}
	ss.entered++
	return id, true
}

func (ss *sessions) remove(id string) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	ss.init()
	delete(ss.open, id)
}

func (ss *sessions) sweep(now time.Time) {
	for id, e := range ss.open {
		if e.expired(now) {
			delete(ss.open, id)
		}
	}
}

// count is the number of sessions open now.
func (ss *sessions) count() int {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	ss.init()
	ss.sweep(ss.now())
	return len(ss.open)
}

func (ss *sessions) opened() int {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return ss.entered
}

// sglangError answers as SGLang's session endpoints fail: 400 with
// {"error": {"message"}}.
func sglangError(w http.ResponseWriter, msg string) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusBadRequest)
	_ = json.NewEncoder(w).Encode(map[string]any{"error": map[string]string{"message": msg}})
}

// openSession answers as SGLang's /open_session: the session's id as a
// JSON string, or 400 when the id is already open. capacity_of_str_len is
// required, as in SGLang; the mocker does not otherwise use it.
func (s *Server) openSession(w http.ResponseWriter, r *http.Request) {
	var req openSessionRequest
	if !s.decode(w, r, &req) {
		return
	}
	if req.CapacityOfStrLen == nil {
		sglangError(w, "capacity_of_str_len: field required")
		return
	}
	var timeout time.Duration
	if t := req.Timeout; t != nil {
		if !(*t >= 0) || *t > 1e9 {
			sglangError(w, "timeout must be a number of seconds >= 0")
			return
		}
		timeout = time.Duration(*t * float64(time.Second))
	}
	id := ""
	if req.SessionID != nil {
		id = *req.SessionID
	}
	got, ok := s.sessions.add(id, timeout)
	if !ok {
		sglangError(w, "Failed to open the session. Check if a session with the same id is still open.")
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(got)
}

// closeSession answers as SGLang's /close_session: 200 with no body, for
// an id that is not open too (SGLang only logs that).
func (s *Server) closeSession(w http.ResponseWriter, r *http.Request) {
	var req closeSessionRequest
	if !s.decode(w, r, &req) {
		return
	}
	if req.SessionID == nil {
		sglangError(w, "session_id: field required")
		return
	}
	s.sessions.remove(*req.SessionID)
	w.WriteHeader(http.StatusOK)
}
