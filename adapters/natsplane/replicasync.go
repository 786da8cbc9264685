package natsplane

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/nats-io/nats.go"

	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/load"
	"github.com/kvrouter/kvrouter/core/router"
)

// ReplicaSyncConfig configures one router replica's side of replica sync.
type ReplicaSyncConfig struct {
	Names Names
	// RouterID tells this replica's messages apart; unique among the
	// replicas of a fleet, without '/'.
	RouterID string
	Logger   *slog.Logger
}

// ReplicaSyncStats are a replica sync's counters.
type ReplicaSyncStats struct {
	// PublishErrors are updates other replicas never got: refused by NATS
	// or dropped because the outbox was full.
	Published, PublishErrors uint64
	// Applied are other replicas' updates applied; Ignored are this
	// replica's own, which come back on the subject.
	Applied, Ignored, Malformed, ApplyErrors uint64
	// Dropped are messages NATS discarded because the apply loop fell a
	// whole buffer behind: from then on this replica's loads diverge until
	// the requests concerned end or expire.
	Dropped uint64
}

// syncPending is the subscription's buffer. Updates arrive at the fleet's
// whole request rate, and a drop loses a booking (or leaks one until its
// TTL), so it is generous: a pointer per message.
const syncPending = 1 << 16

// syncOutbox holds this replica's updates until they are published; it
// only fills if NATS stalls for thousands of bookings.
const syncOutbox = 1 << 14

// ReplicaSync shares a router's bookings with the other replicas of its
// fleet and applies theirs, so that every replica scores against the load
// the whole fleet put on each worker.
type ReplicaSync struct {
	nc   *nats.Conn
	subj string
	id   string
	r    *router.Router
	log  *slog.Logger
	sub  *nats.Subscription
	msgs chan *nats.Msg
	out  chan router.LoadUpdate
	stop chan struct{}
	wg   sync.WaitGroup
	once sync.Once

	published, publishErrors                 atomic.Uint64
	applied, ignored, malformed, applyErrors atomic.Uint64
	dropped                                  atomic.Uint64 // as of Close, which resets the subscription's
}

// syncHead is what every replica-sync message carries.
type syncHead struct {
	RouterID  string `json:"router_id"`
	Kind      string `json:"kind"`
	RequestID string `json:"request_id"`
}

// syncAdd is a booking; it also decodes every kind. WorkerID is a pointer
// so that a booking without a worker is refused rather than sent to 0.
// The overrides stay pointers so "not given" means the receiver's config.
type syncAdd struct {
	syncHead
	WorkerID       *uint64  `json:"worker_id"`
	DPRank         uint32   `json:"dp_rank"`
	SequenceHashes []uint64 `json:"sequence_hashes"`
	ISL            int      `json:"isl"`
	OverlapBlocks  int      `json:"overlap_blocks"`
	OSL            int      `json:"osl"`
	TrackPrefill   *bool    `json:"track_prefill_tokens,omitempty"`
	AssumeReuse    *bool    `json:"assume_kv_reuse,omitempty"`
	TrackBlocks    *bool    `json:"track_active_blocks,omitempty"`
	// PredictBlocks are the leading sequence_hashes the worker is
	// predicted to cache (router.LoadUpdate.Predict); absent, as from
	// replicas that predate it, predicts none.
	PredictBlocks int `json:"predict_blocks,omitempty"`
}

// StartReplicaSync subscribes to the fleet's replica-sync subject and makes
// r publish its bookings there. It replaces r's load observer until Close.
func StartReplicaSync(nc *nats.Conn, cfg ReplicaSyncConfig, r *router.Router) (*ReplicaSync, error) {
	cfg.Names = cfg.Names.orDefault()
	if err := cfg.Names.Validate(); err != nil {
		return nil, err
	}
	if cfg.RouterID == "" || strings.Contains(cfg.RouterID, "/") {
		return nil, fmt.Errorf("natsplane: replica sync needs a router id without '/', got %q", cfg.RouterID)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	s := &ReplicaSync{
		nc: nc, subj: cfg.Names.ActiveSequences(), id: cfg.RouterID, r: r, log: cfg.Logger,
		msgs: make(chan *nats.Msg, syncPending), out: make(chan router.LoadUpdate, syncOutbox),
		stop: make(chan struct{}),
	}
	sub, err := nc.ChanSubscribe(s.subj, s.msgs)
	if err != nil {
		return nil, fmt.Errorf("natsplane: replica sync: %w", err)
	}
	// Once the server knows the subscription, nothing a peer publishes
	// from now on is missed.
	if err := nc.Flush(); err != nil {
		_ = sub.Unsubscribe()
		return nil, fmt.Errorf("natsplane: replica sync: %w", err)
	}
	s.sub = sub
	s.wg.Go(s.receive)
	s.wg.Go(s.send)
	r.SetLoadObserver(s.enqueue)
	return s, nil
}

// Stats returns the counters.
func (s *ReplicaSync) Stats() ReplicaSyncStats {
	st := ReplicaSyncStats{
		Published: s.published.Load(), PublishErrors: s.publishErrors.Load(),
		Applied: s.applied.Load(), Ignored: s.ignored.Load(),
		Malformed: s.malformed.Load(), ApplyErrors: s.applyErrors.Load(), Dropped: s.dropped.Load(),
	}
	if n, err := s.sub.Dropped(); err == nil {
		st.Dropped = uint64(n)
	}
	return st
}

// Close stops applying and publishing, once the updates already booked are
// sent; the router keeps the remote bookings it has, which end with their
// frees or their TTL.
func (s *ReplicaSync) Close() error {
	var err error
	s.once.Do(func() {
		s.r.SetLoadObserver(nil)
		if n, e := s.sub.Dropped(); e == nil {
			s.dropped.Store(uint64(n))
		}
		err = s.sub.Unsubscribe()
		close(s.stop)
		s.wg.Wait()
	})
	return err
}

// enqueue is the router's load observer. It runs under the router's lock,
// where neither encoding a prompt's hashes nor nc.Publish belongs: once
// the connection's write buffer is full, Publish writes to the socket
// itself, and a stalled server would stall every booking.
func (s *ReplicaSync) enqueue(u router.LoadUpdate) {
	select {
	case s.out <- u:
	default:
		s.count(&s.publishErrors, "replica sync: outbox full; other replicas miss this update", "kind", u.Kind)
	}
}

// send publishes in booking order, so that peers see a request's add
// before its free.
func (s *ReplicaSync) send() {
	for {
		select {
		case u := <-s.out:
			s.publish(u)
		case <-s.stop:
			for {
				select {
				case u := <-s.out:
					s.publish(u)
				default:
					return
				}
			}
		}
	}
}

func (s *ReplicaSync) publish(u router.LoadUpdate) {
	b, err := EncodeLoadUpdate(s.id, u)
	if err == nil {
		err = s.nc.Publish(s.subj, b)
	}
	if err != nil {
		s.count(&s.publishErrors, "replica sync: publish failed; other replicas miss this update", "kind", u.Kind, "err", err)
		return
	}
	s.published.Add(1)
}

// EncodeLoadUpdate is the replica-sync message that tells the other
// replicas of routerID's fleet about u, one of its router's bookings: what
// a ReplicaSync publishes.
func EncodeLoadUpdate(routerID string, u router.LoadUpdate) ([]byte, error) {
	head := syncHead{RouterID: routerID, Kind: u.Kind.String(), RequestID: u.ID}
	var v any = head
	if u.Kind == router.LoadAdd {
		q := u.Request
		head.RequestID = q.ID
		v = syncAdd{
			syncHead: head, WorkerID: &q.Worker.ID, DPRank: q.Worker.DPRank,
			SequenceHashes: q.Blocks, ISL: q.ISL, OverlapBlocks: q.OverlapBlocks, OSL: q.OSL,
			TrackPrefill: q.TrackPrefill, AssumeReuse: q.AssumeReuse, TrackBlocks: q.TrackBlocks,
			PredictBlocks: u.Predict,
		}
	}
	return json.Marshal(v)
}

// ErrUndecodable is DecodeLoadUpdate's error for a message that is not a
// replica-sync message at all.
var ErrUndecodable = errors.New("natsplane: undecodable replica-sync message")

// DecodeLoadUpdate reads a replica-sync message: its sender's router id
// (whenever the message has one, even with an error) and the update to
// apply with router.ApplyRemoteLoad, whose request id is qualified with
// the sender's. A replica skips its own messages, which come back on the
// subject.
func DecodeLoadUpdate(data []byte) (routerID string, u router.LoadUpdate, err error) {
	var m syncAdd
	if err := json.Unmarshal(data, &m); err != nil {
		return "", router.LoadUpdate{}, fmt.Errorf("%w: %v", ErrUndecodable, err)
	}
	u, err = m.update()
	return m.RouterID, u, err
}

// receive applies messages one at a time, in arrival order: a request's
// add must come before its free.
func (s *ReplicaSync) receive() {
	for {
		select {
		case m := <-s.msgs:
			s.handle(m.Data)
		case <-s.stop:
			return
		}
	}
}

func (s *ReplicaSync) handle(data []byte) {
	from, u, err := DecodeLoadUpdate(data)
	switch {
	case errors.Is(err, ErrUndecodable):
		s.count(&s.malformed, "replica sync: undecodable message skipped", "err", err)
		return
	case from == s.id:
		s.ignored.Add(1)
		return
	case err != nil:
		s.count(&s.malformed, "replica sync: malformed message skipped", "router_id", from, "err", err)
		return
	}
	if err := s.r.ApplyRemoteLoad(u); err != nil {
		s.count(&s.applyErrors, "replica sync: update not applied", "router_id", from, "err", err)
		return
	}
	s.applied.Add(1)
}

// update converts a message to the router's form. Request ids are
// qualified with the sender's id, which has no '/', so that replicas may
// use the same ids without their bookings colliding.
func (m *syncAdd) update() (router.LoadUpdate, error) {
	switch {
	case m.RouterID == "" || strings.Contains(m.RouterID, "/"):
		return router.LoadUpdate{}, fmt.Errorf("bad router_id %q", m.RouterID)
	case m.RequestID == "":
		return router.LoadUpdate{}, errors.New("no request_id")
	}
	id := m.RouterID + "/" + m.RequestID
	switch m.Kind {
	case router.LoadAdd.String():
		if m.WorkerID == nil {
			return router.LoadUpdate{}, errors.New("add without worker_id")
		}
		return router.LoadUpdate{Kind: router.LoadAdd, Request: load.Request{
			ID: id, Worker: kv.Worker{ID: *m.WorkerID, DPRank: m.DPRank}, Blocks: m.SequenceHashes,
			ISL: m.ISL, OverlapBlocks: m.OverlapBlocks, OSL: m.OSL,
			TrackPrefill: m.TrackPrefill, AssumeReuse: m.AssumeReuse, TrackBlocks: m.TrackBlocks,
		}, Predict: max(m.PredictBlocks, 0)}, nil
	case router.LoadPrefillDone.String():
		return router.LoadUpdate{Kind: router.LoadPrefillDone, ID: id}, nil
	case router.LoadFree.String():
		return router.LoadUpdate{Kind: router.LoadFree, ID: id}, nil
	}
	return router.LoadUpdate{}, fmt.Errorf("unknown kind %q", m.Kind)
}

// count bumps c and logs: the first occurrence as a warning, the rest at
// debug level, since a broken peer can repeat the same fault at the
// fleet's request rate.
func (s *ReplicaSync) count(c *atomic.Uint64, msg string, args ...any) {
	if c.Add(1) == 1 {
		s.log.Warn(msg, args...)
	} else {
		s.log.Debug(msg, args...)
	}
}
