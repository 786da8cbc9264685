package natsplane

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/core/eventlog"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/sched"
)

// Sink is the router the plane feeds; *router.Router satisfies it.
type Sink interface {
	ApplyEvent(ev *kv.Event) error
	SetEngineLoad(w kv.Worker, l sched.EngineLoad)
	DumpEvents() []kv.Event
}

// Defaults of the subscriber.
const (
	DefaultSnapshotThreshold = 1_000_000
	DefaultRecoveryTimeout   = 2 * time.Second
	DefaultMaxHeld           = 100_000
	// StreamMaxAge is how long the durable stream keeps events.
	StreamMaxAge = time.Hour
	// consumerInactive lets the server delete the consumer of a replica that
	// is gone for good, so its position stops holding back purges.
	consumerInactive = 10 * time.Minute
	snapshotLockTTL  = time.Minute
	hdrStreamSeq     = "Kv-Stream-Seq"
)

// SubscriberConfig configures a router's side of the event plane.
type SubscriberConfig struct {
	Names    Names
	RouterID string
	// Durable selects the JetStream plane (--router-durable-kv-events);
	// otherwise NATS core with per-worker recovery.
	Durable bool
	// SnapshotThreshold is the stream length above which a snapshot is
	// written and the stream purged (--router-snapshot-threshold).
	SnapshotThreshold uint64
	// ResetStates purges the stream and the snapshot at start
	// (--router-reset-states).
	ResetStates     bool
	RecoveryTimeout time.Duration
	// MaxHeld bounds the events kept for workers that discovery has not
	// announced yet (their events can overtake their registration).
	MaxHeld int
	Logger  *slog.Logger
}

// SubscriberStats are the subscriber's counters.
type SubscriberStats struct {
	Applied, ApplyErrors, Malformed, Duplicates    uint64
	Gaps, RangesRecovered, Dumps, RecoveryFailures uint64
	Held, HeldDropped                              uint64
	LoadReports                                    uint64
	Snapshots, SnapshotBlocksLoaded                uint64
	// StreamSeq is the last stream sequence applied (durable mode).
	StreamSeq uint64
}

type durableEvent struct {
	msg jetstream.Msg
	ev  kv.Event
	ok  bool
}

type control struct {
	add    *Instance
	remove uint64
}

// Subscriber applies the plane's events to a router on one goroutine, so
// every rank's events stay in order and recovery never races a live event.
type Subscriber struct {
	nc   *nats.Conn
	js   jetstream.JetStream
	cfg  SubscriberConfig
	sink Sink
	log  *slog.Logger

	ctl chan control
	// Events are decoded on the NATS client's delivery goroutine, so that
	// decoding and applying use two cores.
	events  chan kv.Event
	metrics chan *nats.Msg
	durable chan durableEvent
	subs    []*nats.Subscription
	consume jetstream.ConsumeContext
	cancel  context.CancelFunc
	done    chan struct{}

	// Owned by the run goroutine.
	known    map[uint64]Instance
	cursor   *eventlog.Cursor
	reported map[kv.Worker]uint64 // newest id of the previous load report
	dirty    map[kv.Worker]bool   // recovery failed: resync at the next report
	held     map[uint64][]kv.Event
	heldN    int
	stream   jetstream.Stream
	lastSeq  uint64
	lastMsg  jetstream.Msg
	unacked  int
	// snapshotting is set while a snapshot is written aside; Close waits
	// for it on snapshots.
	snapshotting atomic.Bool
	snapshots    sync.WaitGroup

	// unsupportedMu guards unsupported, written by the run goroutine and
	// read by metrics and /health; it is a leaf: nothing is locked under it.
	unsupportedMu sync.Mutex
	unsupported   map[kv.Worker]map[string]uint64

	stats struct {
		applied, applyErrors, malformed, duplicates atomic.Uint64
		gaps, ranges, dumps, recoveryFailures       atomic.Uint64
		held, heldDropped, loadReports              atomic.Uint64
		snapshots, snapshotBlocks, streamSeq        atomic.Uint64
	}
}

// NewSubscriber prepares a subscriber; workers announced with WorkerAdded
// before Start are known when the first event or snapshot arrives.
func NewSubscriber(nc *nats.Conn, cfg SubscriberConfig, sink Sink) (*Subscriber, error) {
	cfg.Names = cfg.Names.orDefault()
	if err := cfg.Names.Validate(); err != nil {
		return nil, err
	}
	if cfg.RouterID == "" {
		return nil, errors.New("natsplane: subscriber needs a router id")
	}
	if cfg.SnapshotThreshold == 0 {
		cfg.SnapshotThreshold = DefaultSnapshotThreshold
	}
	if cfg.RecoveryTimeout <= 0 {
		cfg.RecoveryTimeout = DefaultRecoveryTimeout
	}
	if cfg.MaxHeld <= 0 {
		cfg.MaxHeld = DefaultMaxHeld
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, err
	}
	return &Subscriber{
		nc: nc, js: js, cfg: cfg, sink: sink, log: cfg.Logger,
		ctl: make(chan control, 4096), done: make(chan struct{}),
		known: map[uint64]Instance{}, cursor: eventlog.NewCursor(),
		reported: map[kv.Worker]uint64{}, dirty: map[kv.Worker]bool{}, held: map[uint64][]kv.Event{},
		unsupported: map[kv.Worker]map[string]uint64{},
	}, nil
}

// WorkerAdded announces a worker (or a new incarnation of one): in core
// mode its ranks are dumped whole; in both modes events held for it apply.
// The caller registers the worker with the router first.
func (s *Subscriber) WorkerAdded(inst Instance) { s.ctl <- control{add: &inst} }

// WorkerRemoved forgets a worker; the caller removes it from the router.
func (s *Subscriber) WorkerRemoved(id uint64) { s.ctl <- control{remove: id} }

// Start subscribes and, in durable mode, loads the snapshot and replays
// the stream from it before live events.
func (s *Subscriber) Start(ctx context.Context) error {
	ctx, s.cancel = context.WithCancel(ctx)
	s.metrics = make(chan *nats.Msg, 65536)
	sub, err := s.nc.ChanSubscribe(s.cfg.Names.KVMetrics(), s.metrics)
	if err != nil {
		return err
	}
	s.subs = append(s.subs, sub)
	if s.cfg.Durable {
		if err := s.startDurable(ctx); err != nil {
			s.unsubscribe()
			return err
		}
	} else {
		s.events = make(chan kv.Event, 1<<14)
		// The callback blocks while the apply loop is behind; NATS then
		// buffers in this process (no pending limit) instead of dropping.
		sub, err := s.nc.Subscribe(s.cfg.Names.KVEvents(), func(m *nats.Msg) {
			if ev, ok := s.decode(m.Data); ok {
				select {
				case s.events <- ev:
				case <-ctx.Done():
				}
			}
		})
		if err != nil {
			s.unsubscribe()
			return err
		}
		s.subs = append(s.subs, sub)
	}
	for _, sub := range s.subs {
		_ = sub.SetPendingLimits(-1, -1)
	}
	// Whatever is published once Start returns must reach this router.
	if err := s.nc.Flush(); err != nil {
		s.unsubscribe()
		return err
	}
	go s.run(ctx)
	return nil
}

func (s *Subscriber) unsubscribe() {
	for _, sub := range s.subs {
		_ = sub.Unsubscribe()
	}
	if s.consume != nil {
		s.consume.Stop()
	}
}

// Close stops the subscriber; the router keeps the state it has.
func (s *Subscriber) Close() {
	if s.cancel == nil {
		return
	}
	s.cancel()
	s.unsubscribe()
	<-s.done
	s.snapshots.Wait()
}

// Stats returns the counters.
func (s *Subscriber) Stats() SubscriberStats {
	st := &s.stats
	return SubscriberStats{
		Applied: st.applied.Load(), ApplyErrors: st.applyErrors.Load(), Malformed: st.malformed.Load(),
		Duplicates: st.duplicates.Load(), Gaps: st.gaps.Load(), RangesRecovered: st.ranges.Load(),
		Dumps: st.dumps.Load(), RecoveryFailures: st.recoveryFailures.Load(),
		Held: st.held.Load(), HeldDropped: st.heldDropped.Load(), LoadReports: st.loadReports.Load(),
		Snapshots: st.snapshots.Load(), SnapshotBlocksLoaded: st.snapshotBlocks.Load(), StreamSeq: st.streamSeq.Load(),
	}
}

func (s *Subscriber) run(ctx context.Context) {
	defer close(s.done)
	// Workers announced before Start come before any message about them.
	for len(s.ctl) > 0 {
		s.control(<-s.ctl)
	}
	snapshotCheck := time.NewTicker(2 * time.Second)
	defer snapshotCheck.Stop()
	for {
		select {
		case <-ctx.Done():
			s.ack()
			return
		case c := <-s.ctl:
			s.control(c)
		case ev := <-s.events:
			s.onCoreEvent(&ev)
		case m := <-s.durable:
			s.onDurableEvent(&m)
			if len(s.durable) == 0 || s.unacked >= 1024 {
				s.ack()
			}
		case m := <-s.metrics:
			s.onLoadReport(m.Data)
		case <-snapshotCheck.C:
			if s.cfg.Durable {
				s.maybeSnapshot(ctx)
			}
		}
	}
}

func (s *Subscriber) control(c control) {
	if c.add == nil {
		delete(s.known, c.remove)
		s.cursor.Forget(c.remove)
		drop := func(w kv.Worker, _ bool) bool { return w.ID == c.remove }
		maps.DeleteFunc(s.dirty, drop)
		maps.DeleteFunc(s.reported, func(w kv.Worker, _ uint64) bool { return w.ID == c.remove })
		s.unsupportedMu.Lock()
		maps.DeleteFunc(s.unsupported, func(w kv.Worker, _ map[string]uint64) bool { return w.ID == c.remove })
		s.unsupportedMu.Unlock()
		s.heldN -= len(s.held[c.remove])
		delete(s.held, c.remove)
		return
	}
	inst := *c.add
	s.known[inst.WorkerID] = inst
	if !s.cfg.Durable {
		s.cursor.Forget(inst.WorkerID)
		for rank := range inst.DPSize {
			s.resync(kv.Worker{ID: inst.WorkerID, DPRank: uint32(rank)})
		}
	}
	held := s.held[inst.WorkerID]
	s.heldN -= len(held)
	delete(s.held, inst.WorkerID)
	for i := range held {
		if s.cfg.Durable {
			s.apply(&held[i])
		} else {
			s.onKnownCoreEvent(&held[i])
		}
	}
}

func (s *Subscriber) hold(ev *kv.Event) {
	if s.heldN >= s.cfg.MaxHeld {
		s.stats.heldDropped.Add(1)
		return
	}
	s.stats.held.Add(1)
	s.held[ev.Worker.ID] = append(s.held[ev.Worker.ID], *ev)
	s.heldN++
}

func (s *Subscriber) apply(ev *kv.Event) {
	if err := s.sink.ApplyEvent(ev); err != nil {
		s.stats.applyErrors.Add(1)
		return
	}
	s.stats.applied.Add(1)
}

func (s *Subscriber) decode(data []byte) (kv.Event, bool) {
	var ev kv.Event
	if err := json.Unmarshal(data, &ev); err != nil {
		s.stats.malformed.Add(1)
		s.log.Debug("malformed KV event skipped", "err", err)
		return ev, false
	}
	return ev, true
}

func (s *Subscriber) onCoreEvent(ev *kv.Event) {
	if _, known := s.known[ev.Worker.ID]; !known {
		s.hold(ev)
		return
	}
	s.onKnownCoreEvent(ev)
}

func (s *Subscriber) onKnownCoreEvent(ev *kv.Event) {
	w := ev.Worker
	switch s.cursor.Check(w, ev.EventID) {
	case eventlog.Duplicate:
		s.stats.duplicates.Add(1)
		return
	case eventlog.Unsynced:
		// A rank beyond what discovery announced; the router refuses it.
		s.apply(ev)
		return
	case eventlog.Gap:
		s.stats.gaps.Add(1)
		s.recover(w, ev.EventID-1)
		if s.cursor.Check(w, ev.EventID) != eventlog.Apply {
			s.stats.duplicates.Add(1) // a dump already covered it
			return
		}
	}
	s.apply(ev)
	s.cursor.Set(w, ev.EventID)
}

// recover brings w up to event id to. When the worker cannot answer, the
// loss is accepted for now (the cursor moves on) and the rank is resynced
// whole at its next load report.
func (s *Subscriber) recover(w kv.Worker, to uint64) {
	if err := s.fetch(w, s.cursor.Next(w), to); err != nil {
		s.stats.recoveryFailures.Add(1)
		s.log.Warn("KV event recovery failed; will resync", "worker", w, "err", err)
		s.cursor.Set(w, to)
		s.dirty[w] = true
	}
}

// resync replaces everything known of rank w by the worker's dump.
func (s *Subscriber) resync(w kv.Worker) {
	delete(s.dirty, w)
	if err := s.fetch(w, 0, 0); err != nil {
		s.stats.recoveryFailures.Add(1)
		s.log.Warn("KV state dump failed; will retry", "worker", w, "err", err)
		if !s.cursor.Synced(w) {
			s.cursor.Set(w, 0)
		}
		s.dirty[w] = true
	}
}

// fetch asks the worker for events from..to (to = 0: a dump) and applies
// the answer as it streams in.
func (s *Subscriber) fetch(w kv.Worker, from, to uint64) error {
	inbox := s.nc.NewInbox()
	sub, err := s.nc.SubscribeSync(inbox)
	if err != nil {
		return err
	}
	defer sub.Unsubscribe()
	_ = sub.SetPendingLimits(-1, -1)
	req, _ := json.Marshal(recoveryRequest{DPRank: w.DPRank, From: from, To: to})
	if err := s.nc.PublishRequest(s.cfg.Names.Recovery(w.ID), inbox, req); err != nil {
		return err
	}
	first := true
	for {
		m, err := sub.NextMsg(s.cfg.RecoveryTimeout)
		if err != nil {
			return err
		}
		if m.Header.Get("Status") == "503" {
			return errors.New("no recovery service for this worker")
		}
		last, err := strconv.ParseUint(m.Header.Get(hdrLast), 10, 64)
		if err != nil {
			return fmt.Errorf("recovery reply without %s", hdrLast)
		}
		switch m.Header.Get(hdrKind) {
		case kindRange:
			var events []kv.Event
			if err := json.Unmarshal(m.Data, &events); err != nil {
				return err
			}
			for i := range events {
				if events[i].Worker != w || s.cursor.Check(w, events[i].EventID) != eventlog.Apply {
					continue
				}
				s.apply(&events[i])
				s.cursor.Set(w, events[i].EventID)
			}
			if first {
				s.stats.ranges.Add(1)
			}
		case kindDump:
			if first {
				s.stats.dumps.Add(1)
				clear := kv.ClearedEvent(w, 0)
				_ = s.sink.ApplyEvent(&clear)
			}
			err := DecodeDump(m.Data, func(ev *kv.Event) error {
				if ev.Worker == w {
					s.apply(ev)
				}
				return nil
			})
			if err != nil {
				return err
			}
			if m.Header.Get(hdrFinal) == "1" {
				s.cursor.Set(w, last)
			}
		default:
			return fmt.Errorf("recovery reply of kind %q", m.Header.Get(hdrKind))
		}
		first = false
		if m.Header.Get(hdrFinal) == "1" {
			return nil
		}
	}
}

func (s *Subscriber) onLoadReport(data []byte) {
	var r LoadReport
	if err := json.Unmarshal(data, &r); err != nil || r.WorkerID == 0 {
		s.stats.malformed.Add(1)
		return
	}
	inst, ok := s.known[r.WorkerID]
	if !ok || int(r.DPRank) >= inst.DPSize {
		return
	}
	s.stats.loadReports.Add(1)
	w := kv.Worker{ID: r.WorkerID, DPRank: r.DPRank}
	if r.LoadKnown {
		s.sink.SetEngineLoad(w, sched.EngineLoad{Known: true, Waiting: r.Waiting, Running: r.Running, KVUsage: r.KVUsage})
	}
	s.noteUnsupported(w, r.Unsupported)
	if s.cfg.Durable {
		return
	}
	// The report can overtake events sent just before it, so only the
	// previous report's id is taken as proof of loss, and only when no
	// event waits to be applied: behind a backlog every worker looks behind.
	if s.dirty[w] {
		s.resync(w)
	} else if prev := s.reported[w]; len(s.events) == 0 && s.cursor.Behind(w, prev) {
		s.stats.gaps.Add(1)
		s.recover(w, prev)
	}
	s.reported[w] = r.LastEventID
}

// The fields an agent reports become metric labels: only a bounded number
// of short ones are kept, whatever the agent sends.
const (
	maxUnsupportedFields   = 32
	maxUnsupportedFieldLen = 64
)

func (s *Subscriber) noteUnsupported(w kv.Worker, reported map[string]uint64) {
	var kept map[string]uint64
	for field, n := range reported {
		if len(kept) == maxUnsupportedFields {
			break
		}
		if n == 0 || field == "" || len(field) > maxUnsupportedFieldLen {
			continue
		}
		if kept == nil {
			kept = map[string]uint64{}
		}
		kept[field] = n
	}
	s.unsupportedMu.Lock()
	defer s.unsupportedMu.Unlock()
	if kept == nil {
		delete(s.unsupported, w)
		return
	}
	s.unsupported[w] = kept
}

// Unsupported is a worker's KV-event fields the router does not honour,
// its ranks summed, as its agent last reported them.
func (s *Subscriber) Unsupported(worker uint64) map[string]uint64 {
	s.unsupportedMu.Lock()
	defer s.unsupportedMu.Unlock()
	var out map[string]uint64
	for w, fields := range s.unsupported {
		if w.ID != worker {
			continue
		}
		if out == nil {
			out = map[string]uint64{}
		}
		for field, n := range fields {
			out[field] += n
		}
	}
	return out
}

// EnsureStream creates (or updates) the durable event stream.
func EnsureStream(ctx context.Context, js jetstream.JetStream, names Names) (jetstream.Stream, error) {
	names = names.orDefault()
	return js.CreateOrUpdateStream(ctx, jetstream.StreamConfig{
		Name: names.Stream(), Subjects: []string{names.KVEvents()},
		MaxAge: StreamMaxAge, Storage: jetstream.FileStorage,
	})
}

func (s *Subscriber) startDurable(ctx context.Context) error {
	stream, err := EnsureStream(ctx, s.js, s.cfg.Names)
	if err != nil {
		return fmt.Errorf("natsplane: event stream: %w", err)
	}
	s.stream = stream
	obs, err := s.snapshotStore(ctx)
	if err != nil {
		return err
	}
	// Consumer names cannot hold dots, which host names often do.
	durable := "router-" + strings.Map(func(r rune) rune {
		if r == '.' || r == '*' || r == '>' || r == ' ' || r == '\t' {
			return '_'
		}
		return r
	}, s.cfg.RouterID)
	if s.cfg.ResetStates {
		if err := stream.Purge(ctx); err != nil {
			return fmt.Errorf("natsplane: reset stream: %w", err)
		}
		if err := obs.Delete(ctx, SnapshotObject); err != nil && !errors.Is(err, jetstream.ErrObjectNotFound) {
			return fmt.Errorf("natsplane: reset snapshot: %w", err)
		}
		s.log.Info("router state reset: stream and snapshot purged")
	}
	// Announced workers must be known before the snapshot applies.
	for len(s.ctl) > 0 {
		s.control(<-s.ctl)
	}
	from, err := s.loadSnapshot(ctx, obs)
	if err != nil {
		return err
	}
	// The index lives in memory, so a restarted replica reads again from
	// its snapshot: its durable consumer is recreated at that position.
	if err := s.js.DeleteConsumer(ctx, stream.CachedInfo().Config.Name, durable); err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
		return fmt.Errorf("natsplane: consumer: %w", err)
	}
	cc := jetstream.ConsumerConfig{
		Durable: durable, AckPolicy: jetstream.AckAllPolicy, DeliverPolicy: jetstream.DeliverAllPolicy,
		InactiveThreshold: consumerInactive, MaxAckPending: -1,
	}
	if from > 0 {
		cc.DeliverPolicy, cc.OptStartSeq = jetstream.DeliverByStartSequencePolicy, from+1
	}
	cons, err := stream.CreateConsumer(ctx, cc)
	if err != nil {
		return fmt.Errorf("natsplane: consumer: %w", err)
	}
	s.durable = make(chan durableEvent, 8192)
	s.consume, err = cons.Consume(func(m jetstream.Msg) {
		ev, ok := s.decode(m.Data())
		select {
		case s.durable <- durableEvent{m, ev, ok}:
		case <-ctx.Done():
		}
	}, jetstream.PullMaxMessages(4096))
	if err != nil {
		return fmt.Errorf("natsplane: consume: %w", err)
	}
	return nil
}

func (s *Subscriber) snapshotStore(ctx context.Context) (jetstream.ObjectStore, error) {
	obs, err := s.js.CreateOrUpdateObjectStore(ctx, jetstream.ObjectStoreConfig{Bucket: s.cfg.Names.SnapshotBucket(), Storage: jetstream.FileStorage})
	if err != nil {
		return nil, fmt.Errorf("natsplane: snapshot store: %w", err)
	}
	return obs, nil
}

// loadSnapshot applies the stored snapshot, if any, and returns the stream
// sequence it covers.
func (s *Subscriber) loadSnapshot(ctx context.Context, obs jetstream.ObjectStore) (uint64, error) {
	info, err := obs.GetInfo(ctx, SnapshotObject)
	if errors.Is(err, jetstream.ErrObjectNotFound) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("natsplane: snapshot: %w", err)
	}
	seq, err := strconv.ParseUint(info.Headers.Get(hdrStreamSeq), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("natsplane: snapshot without a stream sequence")
	}
	data, err := obs.GetBytes(ctx, SnapshotObject)
	if err != nil {
		return 0, fmt.Errorf("natsplane: snapshot: %w", err)
	}
	var n uint64
	err = DecodeDump(data, func(ev *kv.Event) error {
		n++
		s.apply(ev)
		return nil
	})
	if err != nil {
		return 0, err
	}
	s.stats.snapshotBlocks.Add(n)
	s.lastSeq = seq
	s.stats.streamSeq.Store(seq)
	s.log.Info("index snapshot loaded", "blocks", n, "stream_seq", seq)
	return seq, nil
}

func (s *Subscriber) onDurableEvent(d *durableEvent) {
	if md, err := d.msg.Metadata(); err == nil {
		s.lastSeq = md.Sequence.Stream
		s.stats.streamSeq.Store(s.lastSeq)
	}
	s.lastMsg = d.msg
	s.unacked++
	if !d.ok {
		return
	}
	if _, known := s.known[d.ev.Worker.ID]; !known {
		s.hold(&d.ev)
		return
	}
	s.apply(&d.ev)
}

// ack acknowledges everything applied so far (the consumer acks all below
// the message acked).
func (s *Subscriber) ack() {
	if s.lastMsg != nil && s.unacked > 0 {
		_ = s.lastMsg.Ack()
		s.unacked = 0
	}
}

// maybeSnapshot writes the index to the object store once the stream is
// long, so that starting replicas read a snapshot instead of the whole
// stream, and purges what every replica has acknowledged. A lock with a TTL
// keeps replicas from writing at once; a crashed holder's lock expires.
func (s *Subscriber) maybeSnapshot(ctx context.Context) {
	if s.snapshotting.Load() {
		return
	}
	info, err := s.stream.Info(ctx)
	if err != nil || info.State.Msgs <= s.cfg.SnapshotThreshold || s.lastSeq == 0 {
		return
	}
	locks, err := s.js.CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{Bucket: s.cfg.Names.LockBucket(), TTL: snapshotLockTTL})
	if err != nil {
		s.log.Warn("snapshot lock unavailable", "err", err)
		return
	}
	if _, err := locks.Create(ctx, "snapshot", []byte(s.cfg.RouterID)); err != nil {
		return // another replica is writing
	}
	unlock := func() { _ = locks.Delete(context.Background(), "snapshot") }
	seq := s.lastSeq
	if s.lastMsg != nil && s.unacked > 0 {
		// Acknowledged for sure before the purge reads the ack floors.
		if err := s.lastMsg.DoubleAck(ctx); err != nil {
			unlock()
			s.log.Warn("index snapshot failed", "err", err)
			return
		}
		s.unacked = 0
	}
	// The dump must be taken here, between two events, to match seq; the
	// rest runs aside so that events keep applying meanwhile.
	events := s.sink.DumpEvents()
	s.snapshotting.Store(true)
	s.snapshots.Go(func() {
		defer s.snapshotting.Store(false)
		defer unlock()
		if err := s.writeSnapshot(ctx, seq, events); err != nil {
			s.log.Warn("index snapshot failed", "err", err)
		}
	})
}

func (s *Subscriber) writeSnapshot(ctx context.Context, seq uint64, events []kv.Event) error {
	data, err := EncodeDump(nil, events)
	if err != nil {
		return err
	}
	obs, err := s.snapshotStore(ctx)
	if err != nil {
		return err
	}
	meta := jetstream.ObjectMeta{Name: SnapshotObject, Headers: nats.Header{hdrStreamSeq: []string{strconv.FormatUint(seq, 10)}}}
	if _, err := obs.Put(ctx, meta, bytes.NewReader(data)); err != nil {
		return err
	}
	purgeTo := seq
	for ci := range s.stream.ListConsumers(ctx).Info() {
		purgeTo = min(purgeTo, ci.AckFloor.Stream)
	}
	if err := s.stream.Purge(ctx, jetstream.WithPurgeSequence(purgeTo+1)); err != nil {
		return err
	}
	s.stats.snapshots.Add(1)
	s.log.Info("index snapshot written", "bytes", len(data), "stream_seq", seq, "purged_below", purgeTo+1)
	return nil
}
