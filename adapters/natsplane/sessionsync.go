package natsplane

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/core/sched"
)

// SessionSync shares a router's session bindings (nvext.session_control,
// X-Dynamo-Session-ID) with the other replicas of its fleet and applies
// theirs, so that a session keeps its engine whichever replica a load
// balancer sends its requests to: each binding, each use (which restarts
// the binding's TTL) and each close is published.
type SessionSync struct {
	*relay[sched.SessionUpdate]
	r *router.Router
}

// sessionMsg is a session-sync message. WorkerID is a pointer so that a
// binding without a worker is refused rather than sent to 0.
type sessionMsg struct {
	RouterID  string  `json:"router_id"`
	Kind      string  `json:"kind"`
	SessionID string  `json:"session_id"`
	WorkerID  *uint64 `json:"worker_id,omitempty"`
	DPRank    uint32  `json:"dp_rank"`
	Sequence  uint64  `json:"sequence"`
	TTLSecs   float64 `json:"ttl_secs,omitempty"`
}

// StartSessionSync subscribes to the fleet's session-sync subject and
// makes r publish its session changes there. It replaces r's session
// observer until Close.
func StartSessionSync(nc *nats.Conn, cfg ReplicaSyncConfig, r *router.Router) (*SessionSync, error) {
	apply := func(u sched.SessionUpdate) error {
		_, err := r.ApplyRemoteSession(u)
		return err
	}
	rl, err := startRelay(nc, cfg, "session sync", cfg.Names.orDefault().SessionAffinity(),
		EncodeSessionUpdate, DecodeSessionUpdate, apply)
	if err != nil {
		return nil, err
	}
	r.SetSessionObserver(rl.enqueue)
	return &SessionSync{relay: rl, r: r}, nil
}

// Close stops applying and publishing, once the changes already made are
// sent; the router keeps the bindings it learned, which end with their
// TTL or a close.
func (s *SessionSync) Close() error {
	return s.close(func() { s.r.SetSessionObserver(nil) })
}

// EncodeSessionUpdate is the session-sync message that tells the other
// replicas of routerID's fleet about u.
func EncodeSessionUpdate(routerID string, u sched.SessionUpdate) ([]byte, error) {
	m := sessionMsg{RouterID: routerID, Kind: u.Kind.String(), SessionID: u.ID, Sequence: u.Seq}
	if u.Kind != sched.SessionClosed {
		m.WorkerID, m.DPRank, m.TTLSecs = &u.Worker.ID, u.Worker.DPRank, u.TTL.Seconds()
	}
	return json.Marshal(m)
}

// DecodeSessionUpdate reads a session-sync message: its sender's router
// id (whenever the message has one, even with an error) and the change to
// apply with router.ApplyRemoteSession.
func DecodeSessionUpdate(data []byte) (routerID string, u sched.SessionUpdate, err error) {
	var m sessionMsg
	if err := json.Unmarshal(data, &m); err != nil {
		return "", sched.SessionUpdate{}, fmt.Errorf("%w: %v", ErrUndecodable, err)
	}
	u, err = m.update()
	return m.RouterID, u, err
}

// maxSessionTTLSecs bounds a binding's TTL on the wire (a year) so that it
// converts to a time.Duration; each receiver caps it further by its own
// --router-max-session-timeout-secs.
const maxSessionTTLSecs = 365 * 24 * 3600

func (m *sessionMsg) update() (sched.SessionUpdate, error) {
	switch {
	case m.RouterID == "":
		return sched.SessionUpdate{}, errors.New("no router_id")
	case m.SessionID == "":
		return sched.SessionUpdate{}, errors.New("no session_id")
	case math.IsNaN(m.TTLSecs) || m.TTLSecs < 0 || m.TTLSecs > maxSessionTTLSecs:
		return sched.SessionUpdate{}, fmt.Errorf("ttl_secs %v out of range", m.TTLSecs)
	}
	u := sched.SessionUpdate{ID: m.SessionID, Seq: m.Sequence}
	switch m.Kind {
	case sched.SessionBound.String():
		u.Kind = sched.SessionBound
	case sched.SessionRefreshed.String():
		u.Kind = sched.SessionRefreshed
	case sched.SessionClosed.String():
		u.Kind = sched.SessionClosed
		return u, nil
	default:
		return sched.SessionUpdate{}, fmt.Errorf("unknown kind %q", m.Kind)
	}
	if m.WorkerID == nil {
		return sched.SessionUpdate{}, fmt.Errorf("%s without worker_id", m.Kind)
	}
	u.Worker = kv.Worker{ID: *m.WorkerID, DPRank: m.DPRank}
	u.TTL = time.Duration(m.TTLSecs * float64(time.Second))
	return u, nil
}
