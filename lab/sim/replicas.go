package sim

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/kvrouter/kvrouter/adapters/natsplane"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/core/sched"
	"github.com/kvrouter/kvrouter/lab/workload"
)

// Replicas is a fleet routed by several router replicas, as serve runs
// them behind a load balancer (--router-replica-sync): each replica keeps
// its own index from every engine's KV events and its own predict-on-route
// index, and learns the others' bookings, their prefill completions and
// their ends through the messages the NATS replica sync sends
// (natsplane.EncodeLoadUpdate and DecodeLoadUpdate), delivered SyncDelay
// of model time after they were booked. Spread says how the load balancer
// in front of them hands out requests.
type Replicas struct {
	// Count is the replicas (--router-replicas); 0 is one router and no
	// agreement measured, 1 one router measured against its shadow.
	Count int
	// SyncDelay is how long a replica's booking takes to reach the others
	// (--replica-sync-delay): the NATS hop, the subscriber and the apply
	// loop. 0 applies it before the next event.
	SyncDelay time.Duration
	// NoSync runs the replicas without replica sync: each scores against
	// its own bookings alone (--replica-sync-delay off).
	NoSync bool
	// Spread is the load balancer's policy (--replica-spread); "" is
	// SpreadRequest.
	Spread Spread
}

// Spread is how a load balancer in front of the replicas hands them
// requests.
type Spread string

const (
	// SpreadRequest sends each request to the next replica in turn, as an
	// L7 balancer's round-robin does: request i to replica i mod Count.
	SpreadRequest Spread = "request"
	// SpreadBurst keeps the requests that arrive at one instant on the
	// replica the first of them went to, and sends the next instant's to
	// the next replica in turn: a burst from one client over one
	// connection (HTTP/2, or a keep-alive connection balanced at L4 as a
	// Kubernetes Service balances) reaches one replica.
	SpreadBurst Spread = "burst"
	// SpreadSession hashes the request's session (conversation) to a
	// replica, as a balancer's consistent hash on a session header does
	// (Envoy's ring hash, nginx's hash ... consistent); requests without
	// one go round-robin.
	SpreadSession Spread = "session"
)

// Spreads are the load-balancer policies, the default first.
func Spreads() []Spread { return []Spread{SpreadRequest, SpreadBurst, SpreadSession} }

// ParseSpread reads --replica-spread.
func ParseSpread(s string) (Spread, error) {
	for _, v := range Spreads() {
		if s == string(v) {
			return v, nil
		}
	}
	return "", fmt.Errorf("unknown replica spread %q (valid: request, burst, session)", s)
}

// Enabled reports replicas measured against a single router.
func (r Replicas) Enabled() bool { return r.Count > 0 }

// ReplicaStats is Point.replicas: how the replicas' decisions compare
// with a single router's.
//
// A decision is identical when the replica chose an engine that a single
// router, in the same fleet at the same instant, rates cheapest: the
// shadow, a router of the same configuration that receives every KV event
// and engine-load read as the replicas do and books every decision the
// moment it is made, whichever replica made it, is asked to price the
// replica's choice against the others (ties count as identical, since a
// single router breaks them at random). Comparing with the engines a
// separate single-router run chose would measure something else: one
// decision that differs sends a conversation to another engine, whose
// cache then differs, so every later turn of it differs in both runs
// although each replica decided as the single router would have.
type ReplicaStats struct {
	Replicas    int     `json:"replicas"`
	Sync        bool    `json:"sync"`
	SyncDelayMS float64 `json:"sync_delay_ms"`
	// Decisions and Identical count the measured requests' decisions (kv
	// modes; the other modes do not score by cost).
	Decisions      int64   `json:"decisions"`
	Identical      int64   `json:"identical"`
	IdenticalShare float64 `json:"identical_share"`
	// Messages are the replica-sync messages sent; Applied the deliveries
	// a replica applied, Refused those ApplyRemoteLoad refused (a free of
	// a booking that expired).
	Messages int64 `json:"sync_messages"`
	// Bytes are the sent messages' bodies, as NATS carries them once to
	// the subject (each subscriber receives them again).
	Bytes   int64 `json:"sync_bytes"`
	Applied int64 `json:"sync_applied"`
	Refused int64 `json:"sync_refused"`
}

// syncMsg is a replica-sync message on its way to the other replicas.
type syncMsg struct {
	from int
	data []byte
}

// replicaState is the sim's part for replicas.
type replicaState struct {
	cfg    Replicas
	ids    []string
	shadow *router.Router
	tap    lastDecision
	// out collects the messages booked during a router call; inflight
	// holds them until their delivery, oldest first (one delay for all,
	// so they arrive in the order they were sent).
	out, inflight []syncMsg
	agreeing      bool // the mode scores by cost: decisions are compared
	stats         ReplicaStats
	// of is the replica each request went to; next the replica the next
	// request (burst) goes to in turn; last the instant and replica of the
	// last arrival, for SpreadBurst.
	of     []int32
	next   int
	lastAt int64
	lastTo int32
}

// lastDecision is the shadow's decision tap: it keeps the record of the
// last query.
type lastDecision struct{ rec router.DecisionRecord }

func (t *lastDecision) Want() bool                     { return true }
func (t *lastDecision) Record(r router.DecisionRecord) { t.rec = r }

func (c Replicas) validate(d Disagg, speculative bool) error {
	switch {
	case c.Count < 0:
		return fmt.Errorf("sim: %d router replicas", c.Count)
	case c.Count > 1 && d.Enabled():
		return errors.New("sim: router replicas are simulated on aggregated fleets only")
	case c.Count > 1 && speculative:
		// A speculative prefill is booked by the replica that routed the
		// turn; the sim books it on replica 0 alone.
		return errors.New("sim: router replicas are not simulated with --speculative-prefill")
	case c.SyncDelay < 0:
		return fmt.Errorf("sim: negative replica sync delay %v", c.SyncDelay)
	case c.Spread != "":
		if _, err := ParseSpread(string(c.Spread)); err != nil {
			return fmt.Errorf("sim: %w", err)
		}
	}
	return nil
}

// newReplicas builds the replicas beside s.r, which is replica 0, and the
// shadow. Replica k draws its tie-breaks from its own stream, as separate
// processes do; replica 0's is a single router's.
func (s *sim) newReplicas(rcfg router.Config) error {
	c := s.cfg.Replicas
	if err := c.validate(s.cfg.Disagg, s.cfg.SpeculativePrefill); err != nil {
		return err
	}
	s.routers = []*router.Router{s.r}
	if !c.Enabled() {
		return nil
	}
	rs := &replicaState{cfg: c, agreeing: rcfg.Mode == sched.ModeKV, of: make([]int32, s.w.Len()), lastAt: -1}
	rs.stats = ReplicaStats{Replicas: c.Count, Sync: !c.NoSync, SyncDelayMS: ms(c.SyncDelay)}
	for k := 1; k < c.Count; k++ {
		seed := s.cfg.Seed + uint64(k)
		rcfg.Rand = rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
		r, err := router.New(rcfg)
		if err != nil {
			return err
		}
		s.routers = append(s.routers, r)
	}
	for k, r := range s.routers {
		rs.ids = append(rs.ids, "sim-"+strconv.Itoa(k))
		if !c.NoSync && c.Count > 1 {
			id := rs.ids[k]
			r.SetLoadObserver(func(u router.LoadUpdate) {
				b, err := natsplane.EncodeLoadUpdate(id, u)
				if err != nil {
					panic(fmt.Sprintf("sim: encoding a replica-sync message: %v", err)) // a bug: every update encodes
				}
				rs.out = append(rs.out, syncMsg{from: k, data: b})
			})
		}
	}
	// The shadow never queues: it only prices decisions and books them.
	shadow := rcfg
	shadow.QueueThreshold = nil
	seed := s.cfg.Seed ^ 0x5851f42d4c957f2d
	shadow.Rand = rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	var err error
	if rs.shadow, err = router.New(shadow); err != nil {
		return err
	}
	rs.shadow.SetDecisionTap(&rs.tap)
	s.rep = rs
	return nil
}

// routerOf is the replica that routes request i.
func (s *sim) routerOf(i int) *router.Router {
	if s.rep == nil {
		return s.r
	}
	return s.routers[s.rep.of[i]]
}

// assign hands request i, arriving now, to a replica as the load
// balancer does.
func (rs *replicaState) assign(i int, now int64, req *workload.Request) {
	n := len(rs.ids)
	turn := func() int32 {
		k := rs.next
		rs.next = (rs.next + 1) % n
		return int32(k)
	}
	var k int32
	switch rs.cfg.Spread {
	case SpreadBurst:
		k = rs.lastTo
		if now != rs.lastAt {
			k = turn()
		}
	case SpreadSession:
		if req.Session == "" {
			k = turn()
			break
		}
		h := fnv.New64a()
		_, _ = h.Write([]byte(req.Session))
		k = int32(h.Sum64() % uint64(n))
	default:
		// Numbered in the workload's order, which is the arrival order
		// but for closed-loop turns: the same spread as round-robin.
		k = int32(i % n)
	}
	rs.of[i], rs.lastAt, rs.lastTo = k, now, k
}

// everyRouter runs fn on every replica and the shadow: what every router
// of the fleet hears (KV events, engine loads, new workers).
func (s *sim) everyRouter(fn func(*router.Router)) {
	for _, r := range s.routers {
		fn(r)
	}
	if s.rep != nil {
		fn(s.rep.shadow)
	}
}

// prefillDone and free reach the replica that booked request i, and the
// shadow.
func (s *sim) prefillDone(i int, id string) {
	s.routerOf(i).MarkPrefillCompleted(id)
	if s.rep != nil {
		s.rep.shadow.MarkPrefillCompleted(id)
	}
}

func (s *sim) free(i int, id string) {
	s.routerOf(i).Free(id)
	if s.rep != nil {
		s.rep.shadow.Free(id)
	}
}

// decided compares a replica's decision for request i with the shadow's
// view, then books it on the shadow.
func (s *sim) decided(i int, w kv.Worker, req *workload.Request) {
	rs := s.rep
	if rs == nil {
		return
	}
	// A copy the request points to: w itself would be moved to the heap
	// at every call, with or without replicas.
	target := w
	q := router.Request{Tokens: req.Tokens, OSL: req.OSL, CacheSalt: s.salt(req), Target: &target, OverrideBusy: true}
	if rs.agreeing && s.measured(&s.reqs[i]) {
		rs.tap.rec = router.DecisionRecord{}
		if _, err := rs.shadow.BestWorker(context.Background(), &q); err == nil {
			rs.stats.Decisions++
			if cheapest(rs.tap.rec.Top, w) {
				rs.stats.Identical++
			}
		}
	}
	q.ID = strconv.Itoa(i)
	_, _, _ = rs.shadow.Submit(&q, nil)
}

// cheapest reports whether w is among the cheapest workers that are not
// busy in top, a decision record's candidates: cheapest first, the chosen
// worker (w) first among equals. Only busy workers may come before it.
func cheapest(top []router.CandidateCost, w kv.Worker) bool {
	for k, c := range top {
		if c.Worker == w {
			// Listed last behind busy ones, w may have been moved up
			// from further down, past cheaper workers not listed: not
			// counted, as it cannot be told apart.
			return k == 0 || k < router.TopCandidates-1
		}
		if !c.Busy {
			return false
		}
	}
	return false
}

// flushSync sends the messages the last event's router calls booked:
// delivered at once without delay, or scheduled. Deliveries may dispatch
// queued requests, whose bookings are messages too.
func (s *sim) flushSync() error {
	rs := s.rep
	if rs == nil {
		return nil
	}
	for len(rs.out) > 0 {
		out := rs.out
		rs.out = nil
		rs.stats.Messages += int64(len(out))
		for _, m := range out {
			rs.stats.Bytes += int64(len(m.data))
		}
		if rs.cfg.SyncDelay > 0 {
			for range out {
				s.schedule(s.now+int64(rs.cfg.SyncDelay), evSync, 0)
			}
			rs.inflight = append(rs.inflight, out...)
			continue
		}
		for _, m := range out {
			s.deliverSync(m)
		}
		if err := s.flushDispatched(); err != nil {
			return err
		}
	}
	return nil
}

// syncArrived delivers the oldest message in flight.
func (s *sim) syncArrived() error {
	rs := s.rep
	m := rs.inflight[0]
	rs.inflight[0] = syncMsg{}
	rs.inflight = rs.inflight[1:]
	s.deliverSync(m)
	return s.flushDispatched()
}

// deliverSync hands a message to every replica, as the subject does, the
// sender included: each decodes it as its ReplicaSync does and applies
// the others'.
func (s *sim) deliverSync(m syncMsg) {
	rs := s.rep
	for k, r := range s.routers {
		from, u, err := natsplane.DecodeLoadUpdate(m.data)
		if from == rs.ids[k] {
			continue
		}
		if err == nil {
			err = r.ApplyRemoteLoad(u)
		}
		if err != nil {
			rs.stats.Refused++
			continue
		}
		rs.stats.Applied++
	}
}

// replicaStats is the run's ReplicaStats, nil without replicas.
func (s *sim) replicaStats() *ReplicaStats {
	if s.rep == nil {
		return nil
	}
	st := s.rep.stats
	if st.Decisions > 0 {
		st.IdenticalShare = float64(st.Identical) / float64(st.Decisions)
	}
	return &st
}
