package natsplane

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"

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
	*relay[router.LoadUpdate]
	r *router.Router
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
	rl, err := startRelay(nc, cfg, "replica sync", cfg.Names.orDefault().ActiveSequences(),
		EncodeLoadUpdate, DecodeLoadUpdate, r.ApplyRemoteLoad)
	if err != nil {
		return nil, err
	}
	r.SetLoadObserver(rl.enqueue)
	return &ReplicaSync{relay: rl, r: r}, nil
}

// Close stops applying and publishing, once the updates already booked are
// sent; the router keeps the remote bookings it has, which end with their
// frees or their TTL.
func (s *ReplicaSync) Close() error {
	return s.close(func() { s.r.SetLoadObserver(nil) })
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
