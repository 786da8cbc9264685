// Package enginesource feeds one engine rank's live KV events into the
// router: it subscribes to the rank's ZMQ PUB socket (package zmqevents),
// decodes each batch (package vllmevents) and applies its events, in order,
// to a Sink (a *router.Router), keeping the router's view of that rank
// consistent across lost messages and engine restarts (SPEC §3.2).
//
// # Events
//
// BlockStored becomes Sink.ApplyEngineStored (the router hashes the token
// ids itself), BlockRemoved a kv.RemovedEvent and AllBlocksCleared a
// kv.ClearedEvent. Every event of a batch is applied for Config.Worker,
// except that a dp rank carried by the batch overrides Worker.DPRank. The
// batch's sequence number is the events' EventID.
//
// Only one KV-cache group is indexed: on hybrid models (full attention plus
// sliding window, mamba, ...) vLLM reports one group per attention kind, and
// the router matches prefixes on the first main-attention group, chosen by
// kv_cache_spec_kind (group 0 when the engine does not say; see
// GroupFilter). Events of other groups are skipped and counted
// (Stats.OtherGroup); those the router cannot honour also under
// Stats.Unsupported.
//
// A payload that does not decode is skipped whole and counted
// (Stats.Malformed); a malformed or unknown event inside a good batch is
// skipped alone (Stats.Skipped). Errors returned by the sink (unknown
// worker, unknown parent, mis-sized blocks, ...) are counted
// (Stats.ApplyErrors; the router counts them by reason) and never stop the
// source.
//
// # Continuity
//
// The source tracks the next sequence number it expects.
//
//   - Start-up: when the engine has a dump endpoint (Config.Dump;
//     kvrouter's mocker serves GET /kv_events/dump, vLLM has none), the
//     rank's whole cache is loaded from it, numbered with the first batch
//     it does not include, and the replay endpoint is asked only for the
//     batches from there on. Otherwise everything the replay endpoint
//     buffers is fetched (replay from 0) and applied before live messages,
//     so a router started after the engine learns its cache. Live messages
//     that the dump or the replay already covered are recognised by
//     sequence number and dropped (Stats.Duplicates): a seq is never
//     applied twice and the source never goes backwards. The same catch-up
//     runs when the first live message is not the one expected (ZeroMQ's
//     slow joiner).
//   - Joining: a PUB socket sends nothing to a subscriber before its
//     subscription arrives, and the start-up catch-up does not wait for
//     the subscriber to connect (an engine whose PUB socket cannot be
//     reached still has its cache learnt). A batch published after the
//     catch-up and before the subscription joined would then show only
//     with the next gap or the next silence probe. So each time the
//     subscriber connects and has sent its subscription, the source asks
//     the replay endpoint from the last seq applied, as a silence probe
//     does (Stats.Joins), before any message of that connection: what
//     was published before the join comes by replay, what follows it
//     live. A reconnection after a broken connection is caught up the
//     same way.
//   - Gap (a live seq above the one expected): the source asks the replay
//     endpoint for [expected, ...] and applies the batches up to the
//     current one, in order, then the current one (Stats.Gaps,
//     Stats.Recovered). When replay cannot close it (no replay endpoint,
//     a failure or timeout after Config.ReplayTimeout, or a ring that no
//     longer holds the expected seq), the engine's dump replaces the
//     rank's blocks (Stats.Dumps); without one, the source drops the
//     blocks of every rank it has fed (a Cleared event per rank) and
//     rebuilds from what comes next (Stats.Rebuilds).
//   - History lost (Stats.HistoryLost): when the source goes on without
//     the earlier events and without a dump (a ring that wrapped before
//     the router started, a gap rebuilt), new events hang below blocks the
//     router never saw; the router places them from the requests it routes
//     (router.Router.Recovering) until the index has caught up.
//   - Reset (the seq went backwards: the engine restarted; also a seq
//     already applied whose payload differs): the ranks' blocks are dropped
//     (Stats.Resets and Stats.Rebuilds) and the new incarnation's stream is
//     caught up like at start-up.
//   - Silence (nothing live for Config.SilenceProbe, 3 s by default): a
//     loss at the end of a stream, or a restarted engine's first batches
//     published while the subscriber was reconnecting, would otherwise only
//     show when the next batch arrives, which may be never. So a silent
//     source asks the replay endpoint from the last seq it applied
//     (Stats.Probes). That seq with the same payload means the same
//     engine: whatever follows it is applied (Stats.Gaps, Stats.Recovered).
//     A ring starting above it is a gap, handled as above. Nothing at or
//     above it, or another payload at it, means a restarted engine: a reset.
//     A silent source that has applied nothing yet catches up as at
//     start-up. While the stream stays silent, probes back off (twice the
//     wait each time, up to 16 × SilenceProbe); any live message ends the
//     silent period. A probe waits at most Config.ReplayTimeout (live
//     messages queue meanwhile). Without a replay endpoint there is nothing
//     to ask.
//
// An engine that restarts and publishes past the last seq seen before the
// subscriber reconnects looks like a gap, not a reset, when the batches
// arrive live: nothing on the wire tells them apart. A silence probe tells
// them apart by the payload at the last seq applied, except after a dump
// (no payload to compare), when it only finds what follows.
//
// An engine peer that announces a message above Config.MaxMessageBytes, or
// sends a handshake the ZMQ library would fail on, is disconnected and
// counted (Stats.Oversized, Stats.BadHandshakes); the subscriber redials
// and a replay that met one counts as failed. A replay holds at most
// zmqevents.DefaultReplayMaxBatches batches and DefaultReplayMaxBytes
// bytes; beyond, what fits is applied (Stats.ReplayTruncated).
//
// Closing the source leaves the router's state as it is; the caller removes
// the worker when the engine goes away.
package enginesource

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/zeebo/xxh3"

	"github.com/kvrouter/kvrouter/adapters/vllmevents"
	"github.com/kvrouter/kvrouter/adapters/zmqevents"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
)

// Sink receives the events; *router.Router satisfies it. It is called from
// one goroutine per Source, so one rank's events stay ordered.
type Sink interface {
	ApplyEvent(ev *kv.Event) error
	ApplyEngineStored(es *router.EngineStored) error
}

var _ Sink = (*router.Router)(nil)

// DefaultReplayTimeout bounds one replay request.
const DefaultReplayTimeout = 2 * time.Second

// DefaultSilenceProbe is how long a stream stays silent before the source
// asks the replay endpoint whether it missed something.
const DefaultSilenceProbe = 3 * time.Second

// maxProbeBackoff bounds how far apart the probes of a long silence grow,
// as a multiple of Config.SilenceProbe.
const maxProbeBackoff = 16

// DefaultDumpTimeout bounds one dump request.
const DefaultDumpTimeout = 10 * time.Second

// Config describes one engine rank.
type Config struct {
	// Worker is the rank's identity in the router; a dp rank carried by a
	// batch overrides Worker.DPRank.
	Worker kv.Worker
	// Events is the engine's ZMQ PUB endpoint, e.g. "tcp://10.0.0.5:5557".
	Events string
	// Replay is the engine's replay ROUTER endpoint; "" if it has none.
	Replay string
	// Topic is the subscription prefix; "" receives everything.
	Topic string
	// HashBytes says how 32-byte block hashes become ids: vLLM's (the
	// default) or SGLang's.
	HashBytes vllmevents.HashBytes
	// ReplayTimeout bounds each replay request; 0 means
	// DefaultReplayTimeout.
	ReplayTimeout time.Duration
	// SilenceProbe is how long the stream stays silent before the replay
	// endpoint is asked for what may have been lost at its end; 0 means
	// DefaultSilenceProbe, negative never asks.
	SilenceProbe time.Duration
	// Dump is the engine's full-state endpoint for this rank, e.g.
	// "http://10.0.0.5:8000/kv_events/dump?dp_rank=0" (kvrouter's mocker
	// serves one; vLLM has none); "" if it has none.
	Dump string
	// DumpTimeout bounds each dump request; 0 means DefaultDumpTimeout.
	DumpTimeout time.Duration
	// HTTPClient fetches dumps; nil means http.DefaultClient.
	HTTPClient *http.Client
	// MaxMessageBytes bounds one ZMQ message from the engine; a peer
	// announcing a bigger one is disconnected (Stats.Oversized). 0 means
	// zmqevents.DefaultMaxMessageBytes.
	MaxMessageBytes int64
	// Logger receives gaps, rebuilds, resets and skipped input; nil
	// discards.
	Logger *slog.Logger
}

// Stats are a Source's counters.
type Stats struct {
	LastSeq uint64 // as LastSeq()
	HaveSeq bool

	Received   uint64 // well-formed messages received live (including those not processed yet)
	BadFrames  uint64 // live messages of the wrong shape (not 3 frames, bad seq frame)
	Batches    uint64 // batches decoded and applied, live or replayed
	Replayed   uint64 // of Batches, those fetched by replay
	Duplicates uint64 // live messages dropped: their seq was already applied

	Events        uint64 // events passed to the sink
	BlocksStored  uint64 // blocks of the BlockStored events passed on
	BlocksRemoved uint64 // blocks of the BlockRemoved events passed on
	Clears        uint64 // AllBlocksCleared events passed on

	Malformed  uint64 // payloads that did not decode, skipped whole
	Skipped    uint64 // events skipped: malformed, unknown type, another group, unknown medium, not local
	OtherGroup uint64 // of Skipped, events of a KV-cache group the router does not index (see GroupFilter)

	Gaps         uint64 // live seqs above the one expected, after the first batch
	Recovered    uint64 // gaps closed by replay or dump
	Rebuilds     uint64 // times the rank's blocks were dropped (gap not recovered, or reset)
	Resets       uint64 // engine restarts seen (seq went backwards)
	ReplayErrors uint64 // replay requests that failed or timed out
	ApplyErrors  uint64 // errors returned by the sink

	Dumps           uint64 // engine dumps loaded (the rank's blocks replaced whole)
	DumpErrors      uint64 // dump requests that failed, timed out or did not decode
	HistoryLost     uint64 // times the source went on without the events before (neither replay nor dump had them)
	Oversized       uint64 // connections dropped, live or replay: a message above MaxMessageBytes
	BadHandshakes   uint64 // live connections dropped: the engine's ZMTP handshake was malformed or stalled
	ReplayTruncated uint64 // of ReplayErrors, replays stopped at their bound (zmqevents.ReplayConfig)
	Probes          uint64 // replay requests sent because the stream was silent
	Joins           uint64 // subscriptions that joined the stream and the replays from the last seq applied that followed, done

	// Unsupported counts, by field name, the events or blocks whose field
	// the router could not honour (see unsupported.go); nil when none.
	Unsupported map[string]uint64
}

type counters struct {
	batches, replayed, duplicates          atomic.Uint64
	events, blocksStored, blocksRemoved    atomic.Uint64
	clears, malformed, skipped, otherGroup atomic.Uint64
	gaps, recovered, rebuilds, resets      atomic.Uint64
	replayErrors, applyErrors              atomic.Uint64
	dumps, dumpErrors, historyLost         atomic.Uint64
	replayOversized, replayTruncated       atomic.Uint64
	probes, joins                          atomic.Uint64
}

// ErrClosed is returned by WaitSeq once the source has stopped.
var ErrClosed = errors.New("enginesource: closed")

// recentSize is how many applied seqs keep a payload fingerprint, to tell a
// duplicate (same payload) from a restarted engine (different payload).
const recentSize = 1024

type recent struct {
	seq, sum uint64
	ok       bool
}

// Source feeds one engine rank's events to a Sink.
type Source struct {
	cfg    Config
	sink   Sink
	log    *slog.Logger
	opts   vllmevents.DecodeOptions
	sub    *zmqevents.Subscriber
	client *http.Client
	ctx    context.Context
	cancel context.CancelFunc
	done   chan struct{}
	st     counters
	unsup  unsupportedFields
	groups GroupFilter   // owned by the run goroutine
	joined chan struct{} // a subscription joined the stream; buffered 1

	// Owned by the run goroutine.
	started bool   // a batch has been applied since start or the last reset
	next    uint64 // the seq expected next
	ranks   map[uint32]struct{}
	recent  []recent
	// salts carries each rank's cache salts down its salted chains.
	salts map[uint32]*router.SaltChains

	mu       sync.Mutex
	last     uint64 // the last seq processed (applied or given up on)
	haveLast bool
	stopped  bool
	changed  chan struct{} // closed when last changes or the source stops; nil without waiters
}

// Start subscribes and returns at once; the source runs until ctx ends or
// Close is called. Connecting happens in the background and is retried (the
// engine may start after the router).
func Start(ctx context.Context, cfg Config, sink Sink) (*Source, error) {
	if cfg.Events == "" {
		return nil, errors.New("enginesource: no events endpoint")
	}
	if sink == nil {
		return nil, errors.New("enginesource: nil sink")
	}
	if cfg.ReplayTimeout <= 0 {
		cfg.ReplayTimeout = DefaultReplayTimeout
	}
	if cfg.DumpTimeout <= 0 {
		cfg.DumpTimeout = DefaultDumpTimeout
	}
	if cfg.SilenceProbe == 0 {
		cfg.SilenceProbe = DefaultSilenceProbe
	}
	client := cfg.HTTPClient
	if client == nil {
		client = http.DefaultClient
	}
	logger := cfg.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	logger = logger.With("worker", cfg.Worker.String(), "events", cfg.Events)
	joined := make(chan struct{}, 1)
	var onJoin func()
	if cfg.Replay != "" {
		onJoin = func() {
			select {
			case joined <- struct{}{}:
			default: // one catch-up covers every join not handled yet
			}
		}
	}
	sub, err := zmqevents.NewSubscriber(zmqevents.SubscriberConfig{
		Endpoint: cfg.Events, Topic: cfg.Topic, Buffer: 4096, MaxMessageBytes: cfg.MaxMessageBytes, Log: logger, OnJoin: onJoin,
	})
	if err != nil {
		return nil, fmt.Errorf("enginesource: %w", err)
	}
	sctx, cancel := context.WithCancel(ctx)
	s := detached(cfg, sink)
	s.log, s.sub, s.client, s.ctx, s.cancel, s.joined = logger, sub, client, sctx, cancel, joined
	go s.run()
	return s, nil
}

// Close stops the source and waits for it. It is idempotent.
func (s *Source) Close() error {
	s.cancel()
	<-s.done
	return nil
}

// Done is closed once the source has stopped.
func (s *Source) Done() <-chan struct{} { return s.done }

// LastSeq is the last sequence number processed (applied, found malformed,
// or skipped over by a rebuild); ok is false before the first. An engine
// restart forgets it: it then follows the new incarnation's numbers.
func (s *Source) LastSeq() (seq uint64, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.last, s.haveLast
}

// Synced reports whether the batch with this sequence number has been
// processed: applied, found malformed, or given up on in a rebuild.
func (s *Source) Synced(seq uint64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.haveLast && s.last >= seq
}

// WaitSeq waits until Synced(seq). It returns ctx's error if ctx ends first
// and ErrClosed if the source stops first.
func (s *Source) WaitSeq(ctx context.Context, seq uint64) error {
	return s.WaitFor(ctx, func(st Stats) bool { return st.HaveSeq && st.LastSeq >= seq })
}

// WaitFor waits until cond holds for the source's Stats. cond is evaluated
// now and again after every message the source handles. It returns ctx's
// error if ctx ends first and ErrClosed if the source stops first (cond is
// checked one last time).
func (s *Source) WaitFor(ctx context.Context, cond func(Stats) bool) error {
	for {
		s.mu.Lock()
		if s.changed == nil {
			s.changed = make(chan struct{})
		}
		ch, stopped := s.changed, s.stopped
		s.mu.Unlock()
		if cond(s.Stats()) {
			return nil
		}
		if stopped {
			return ErrClosed
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// Stats returns the counters.
func (s *Source) Stats() Stats {
	sub := s.sub.Stats()
	c := &s.st
	st := Stats{
		Received: sub.Received, BadFrames: sub.Malformed, Batches: c.batches.Load(), Replayed: c.replayed.Load(),
		Duplicates: c.duplicates.Load(), Events: c.events.Load(), BlocksStored: c.blocksStored.Load(),
		BlocksRemoved: c.blocksRemoved.Load(), Clears: c.clears.Load(), Malformed: c.malformed.Load(),
		Skipped: c.skipped.Load(), OtherGroup: c.otherGroup.Load(), Gaps: c.gaps.Load(), Recovered: c.recovered.Load(),
		Rebuilds: c.rebuilds.Load(), Resets: c.resets.Load(), ReplayErrors: c.replayErrors.Load(), ApplyErrors: c.applyErrors.Load(),
		Dumps: c.dumps.Load(), DumpErrors: c.dumpErrors.Load(), HistoryLost: c.historyLost.Load(),
		Oversized: sub.Oversized + c.replayOversized.Load(), ReplayTruncated: c.replayTruncated.Load(),
		BadHandshakes: sub.BadHandshakes, Probes: c.probes.Load(), Joins: c.joins.Load(), Unsupported: s.unsup.snapshot(),
	}
	// The position is read after the counters: a counter bumped after a
	// position change (see restarted) then never shows beside the position
	// from before it.
	st.LastSeq, st.HaveSeq = s.LastSeq()
	return st
}

func (s *Source) run() {
	defer close(s.done)
	defer func() {
		_ = s.sub.Close()
		s.mu.Lock()
		s.stopped = true
		s.wakeLocked()
		s.mu.Unlock()
	}()
	if s.cfg.Replay != "" || s.cfg.Dump != "" {
		s.catchUp(math.MaxUint64)
		s.wake()
	}
	msgs := s.sub.Messages()
	// A ticker rather than a timer reset per message keeps the live path
	// free of timer work: a tick finding that messages arrived since the
	// previous one only notes it, so a probe follows 1 to 2 periods of
	// silence.
	var tick <-chan time.Time
	if s.cfg.Replay != "" && s.cfg.SilenceProbe > 0 {
		t := time.NewTicker(s.cfg.SilenceProbe)
		defer t.Stop()
		tick = t.C
	}
	live := false
	silentTicks, probeAfter := 0, 1
	for {
		select {
		case <-s.ctx.Done():
			return
		case m, ok := <-msgs:
			if !ok {
				return
			}
			live = true
			// A message of a new connection comes after that connection's
			// catch-up: the snapshot-then-stream order.
			select {
			case <-s.joined:
				s.join()
			default:
			}
			s.handle(m)
			s.wake()
		case <-s.joined:
			s.join()
			s.wake()
		case <-tick:
			if live {
				live, silentTicks, probeAfter = false, 0, 1
				continue
			}
			if silentTicks++; silentTicks < probeAfter {
				continue
			}
			silentTicks, probeAfter = 0, min(2*probeAfter, maxProbeBackoff)
			s.probe()
			s.wake()
		}
	}
}

// probe asks the replay endpoint, after a silence, for what the live stream
// may have lost at its end (see Silence in the package doc).
func (s *Source) probe() {
	s.st.probes.Add(1)
	s.askReplay("kv event stream silent", true)
}

// join asks the replay endpoint, once the subscription has joined the
// stream, for what was published between the last catch-up and that
// moment (see Joining in the package doc).
func (s *Source) join() {
	s.askReplay("kv event subscription joined", false)
	s.st.joins.Add(1) // once done: a reader who sees it counted sees what it applied
}

// askReplay asks the replay endpoint for what followed the last seq
// applied, and applies it; when is what made it ask, for the log. Batches
// found count as a recovered gap when lost says they were lost (a silence
// probe), not when they were expected there (a join).
func (s *Source) askReplay(when string, lost bool) {
	if !s.started {
		s.log.Debug(when + ": catching up")
		s.catchUp(math.MaxUint64)
		return
	}
	// Asking from the last applied seq lets its payload tell the same
	// engine from a restarted one; after a dump there is none to compare.
	from, known := s.next, false
	if s.next > 0 {
		r := s.recent[(s.next-1)%recentSize]
		if known = r.ok && r.seq == s.next-1; known {
			from = s.next - 1
		}
	}
	msgs, err := s.fetchReplay(from, true)
	if s.ctx.Err() != nil || (err != nil && len(msgs) == 0) {
		return // nothing learnt; the next gap or silent period asks again
	}
	if known && (len(msgs) == 0 || (msgs[0].Seq == from && s.differs(msgs[0]))) {
		s.log.Warn(when+" and the engine no longer has its last batch: engine restarted", "last", from)
		s.restarted()
		s.catchUp(math.MaxUint64)
		return
	}
	if len(msgs) == 0 || msgs[len(msgs)-1].Seq < s.next {
		s.log.Debug(when+": nothing missed", "next", s.next)
		return
	}
	until := msgs[len(msgs)-1].Seq + 1
	s.log.Info(when+": batches missed", "expected", s.next, "last", until-1)
	if msgs[0].Seq <= s.next {
		s.applyReplayed(msgs, until)
		if s.next == until {
			if lost {
				s.st.gaps.Add(1)
				s.st.recovered.Add(1)
				s.log.Info("kv event gap recovered", "by", "replay: "+when, "to", until-1)
			}
			return
		}
	}
	if !s.fillGap(until) {
		return
	}
	for _, r := range msgs {
		if r.Seq >= s.next {
			s.apply(r.Seq, r.Payload, true) // after a rebuild: the ring's batches are the history there is
		}
	}
}

// handle processes one live message.
func (s *Source) handle(m zmqevents.Message) {
	if s.started && (m.Reset || (m.Seq < s.next && s.differs(m))) {
		s.reset(m)
		return
	}
	if s.started && m.Seq < s.next {
		s.st.duplicates.Add(1)
		return
	}
	if m.Seq > s.next {
		switch {
		case !s.started && s.cfg.Replay == "" && s.cfg.Dump == "":
			// Nothing known and nothing to ask: start here.
			s.historyLost(fmt.Sprintf("first batch seen is %d", m.Seq))
		case !s.started:
			s.catchUp(m.Seq)
		default:
			if !s.fillGap(m.Seq) {
				return // stopping
			}
		}
		if s.started && m.Seq < s.next {
			s.st.duplicates.Add(1) // a dump newer than m covered it
			return
		}
	}
	s.apply(m.Seq, m.Payload, false)
}

// differs reports whether an already applied seq came back with another
// payload (the engine restarted and the subscriber could not tell).
func (s *Source) differs(m zmqevents.Message) bool {
	r := s.recent[m.Seq%recentSize]
	return r.ok && r.seq == m.Seq && r.sum != xxh3.Hash(m.Payload)
}

// fillGap recovers [s.next, until) by replay, else from the engine's dump,
// else rebuilds. It returns false when the source is stopping (nothing is
// dropped then).
func (s *Source) fillGap(until uint64) bool {
	s.st.gaps.Add(1)
	from := s.next
	s.log.Warn("kv event gap", "expected", from, "got", until, "missed", until-from)
	closed := func(by string) bool {
		if s.next < until {
			return false
		}
		s.st.recovered.Add(1)
		s.log.Info("kv event gap recovered", "by", by, "from", from, "to", until-1)
		return true
	}
	if s.cfg.Replay != "" {
		s.applyReplayed(s.replay(from), until)
		if s.ctx.Err() != nil {
			return false
		}
		if closed("replay") {
			return true
		}
	}
	if s.cfg.Dump != "" && s.loadDump() {
		if s.next < until && s.cfg.Replay != "" {
			s.applyReplayed(s.replay(s.next), until)
		}
		if s.ctx.Err() != nil {
			return false
		}
		if closed("the engine's dump") {
			return true
		}
	}
	if s.ctx.Err() != nil {
		return false
	}
	why := "gap and no replay endpoint"
	if s.cfg.Replay != "" {
		why = fmt.Sprintf("replay could not cover [%d, %d]", s.next, until-1)
	}
	s.rebuild(why)
	s.historyLost(why)
	return true
}

// catchUp brings a source that knows nothing up to until: from the
// engine's dump when it has one (then by replay from where the dump ends),
// which is cheaper than replaying a whole ring; otherwise by replay, the
// ring starting at the first batch or, when it has wrapped, wherever it
// starts now.
func (s *Source) catchUp(until uint64) {
	if s.cfg.Dump != "" && s.loadDump() {
		s.log.Info("kv events caught up from the engine's dump", "next", s.next)
	}
	var msgs []zmqevents.Message
	if s.cfg.Replay != "" {
		msgs = s.replay(s.next)
	}
	if s.ctx.Err() != nil {
		return
	}
	switch {
	case s.started:
	case len(msgs) > 0 && msgs[0].Seq > 0:
		s.historyLost(fmt.Sprintf("the engine's events before %d are gone", msgs[0].Seq))
	case len(msgs) == 0 && until != math.MaxUint64:
		s.historyLost(fmt.Sprintf("no replay of the events before %d", until))
	}
	s.applyReplayed(msgs, until)
	if s.started {
		s.log.Info("kv events caught up", "next", s.next)
	}
}

// replay fetches what the replay endpoint buffers from seq from on.
func (s *Source) replay(from uint64) []zmqevents.Message {
	msgs, _ := s.fetchReplay(from, false)
	return msgs
}

// fetchReplay is replay that also returns the error; a quiet one (a probe,
// repeated while an engine is down) logs its failure at debug level.
func (s *Source) fetchReplay(from uint64, quiet bool) ([]zmqevents.Message, error) {
	ctx, cancel := context.WithTimeout(s.ctx, s.cfg.ReplayTimeout)
	defer cancel()
	msgs, err := zmqevents.Replay(ctx, s.cfg.Replay, from, zmqevents.ReplayConfig{MaxMessageBytes: s.cfg.MaxMessageBytes, Log: s.log})
	if err != nil && s.ctx.Err() == nil {
		s.st.replayErrors.Add(1)
		switch {
		case errors.Is(err, zmqevents.ErrMessageTooLarge):
			s.st.replayOversized.Add(1)
		case errors.Is(err, zmqevents.ErrReplayTooLarge):
			s.st.replayTruncated.Add(1)
		}
		level := slog.LevelWarn
		if quiet {
			level = slog.LevelDebug
		}
		s.log.Log(s.ctx, level, "kv event replay failed", "replay", s.cfg.Replay, "from", from, "got", len(msgs), "err", err)
	}
	return msgs, err
}

// applyReplayed applies the replayed batches below until while they follow
// each other. Once a batch has been applied, the first one applied must be
// s.next; before, any start is accepted.
func (s *Source) applyReplayed(msgs []zmqevents.Message, until uint64) {
	for _, r := range msgs {
		if s.ctx.Err() != nil {
			return
		}
		if r.Seq >= until {
			break
		}
		if s.started && r.Seq < s.next {
			continue
		}
		if s.started && r.Seq != s.next {
			break // the ring no longer holds s.next, or a hole
		}
		s.apply(r.Seq, r.Payload, true)
	}
}

// historyLost records that the rank's blocks are rebuilt from incomplete
// history: events below parents the router never saw are then placed by
// the router from its own traffic (router.Router.Recovering).
func (s *Source) historyLost(why string) {
	s.st.historyLost.Add(1)
	s.log.Warn("kv event history lost: the rank's index is rebuilt from new events", "why", why)
}

// loadDump replaces the rank's blocks with the engine's dump and moves the
// position to the dump's. It reports false, changing nothing, when the
// dump cannot be had.
func (s *Source) loadDump() bool {
	ctx, cancel := context.WithTimeout(s.ctx, s.cfg.DumpTimeout)
	defer cancel()
	next, payload, err := FetchDump(ctx, s.client, s.cfg.Dump)
	var b *vllmevents.Batch
	if err == nil {
		b, err = vllmevents.DecodeBatchWith(payload, s.opts)
	}
	if err != nil {
		if s.ctx.Err() == nil {
			s.st.dumpErrors.Add(1)
			s.log.Warn("kv event dump failed", "dump", s.cfg.Dump, "err", err)
		}
		return false
	}
	rank := s.cfg.Worker.DPRank
	if b.DPRank != nil && *b.DPRank >= 0 && int64(*b.DPRank) <= math.MaxUint32 {
		rank = uint32(*b.DPRank)
	}
	s.ranks[rank] = struct{}{}
	s.clearRanks(next)
	s.st.dumps.Add(1)
	s.applyBatch(next, b)
	s.started, s.next = true, next
	if next > 0 {
		s.processed(next - 1)
	}
	return true
}

// FetchDump asks an engine's dump endpoint (kvrouter's mocker serves GET
// /kv_events/dump) for a rank's cached blocks: a KV event batch of
// single-block Stored events and the sequence number of the first batch it
// does not include.
func FetchDump(ctx context.Context, client *http.Client, url string) (next uint64, payload []byte, err error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, nil, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	payload, err = io.ReadAll(io.LimitReader(resp.Body, maxDumpBytes+1))
	switch {
	case err != nil:
		return 0, nil, err
	case resp.StatusCode != http.StatusOK:
		return 0, nil, fmt.Errorf("enginesource: dump %s: %s", url, resp.Status)
	case len(payload) > maxDumpBytes:
		return 0, nil, fmt.Errorf("enginesource: dump %s larger than %d bytes", url, maxDumpBytes)
	}
	next, err = strconv.ParseUint(resp.Header.Get(vllmevents.DumpNextSeqHeader), 10, 64)
	if err != nil {
		return 0, nil, fmt.Errorf("enginesource: dump %s: header %s: %w", url, vllmevents.DumpNextSeqHeader, err)
	}
	return next, payload, nil
}

// maxDumpBytes bounds a dump: a million blocks of 16 tokens.
const maxDumpBytes = 1 << 30

// rebuild drops the blocks of every rank this source has fed; what comes
// next rebuilds them.
func (s *Source) rebuild(why string) {
	s.log.Warn("kv events lost: dropping the rank's blocks", "why", why, "ranks", len(s.ranks))
	s.clearRanks(s.next)
	s.st.rebuilds.Add(1) // after the clear: a waiter seeing it finds the blocks gone
}

func (s *Source) clearRanks(seq uint64) {
	for rank := range s.ranks {
		s.removedSalts(rank, nil, true)
		ev := kv.ClearedEvent(kv.Worker{ID: s.cfg.Worker.ID, DPRank: rank}, seq)
		if err := s.sink.ApplyEvent(&ev); err != nil {
			s.st.applyErrors.Add(1)
		}
	}
}

// reset handles an engine restart: drop, then start over from m.
func (s *Source) reset(m zmqevents.Message) {
	s.log.Warn("kv event sequence went backwards: engine restarted", "last", s.next-1, "got", m.Seq)
	s.restarted()
	s.handle(m)
}

// restarted drops the rank's blocks and forgets the position: the stream
// is the new incarnation's from now on. The old position is withdrawn
// before anything else and the restart counted last, so a waiter that sees
// the count (Stats reads counters before the position) never pairs it with
// the old incarnation's position.
func (s *Source) restarted() {
	s.mu.Lock()
	s.haveLast = false
	s.mu.Unlock()
	s.rebuild("engine restarted")
	s.started, s.next = false, 0
	s.groups.Reset()
	clear(s.recent)
	s.st.resets.Add(1)
}

// apply processes the batch with this seq.
func (s *Source) apply(seq uint64, payload []byte, replayed bool) {
	s.recent[seq%recentSize] = recent{seq: seq, sum: xxh3.Hash(payload), ok: true}
	s.started, s.next = true, seq+1
	defer s.processed(seq)
	b, err := vllmevents.DecodeBatchWith(payload, s.opts)
	if err == nil && b.DPRank != nil && (*b.DPRank < 0 || int64(*b.DPRank) > math.MaxUint32) {
		err = fmt.Errorf("dp rank %d out of range", *b.DPRank)
	}
	if err != nil {
		s.st.malformed.Add(1)
		s.log.Warn("malformed kv event batch skipped", "seq", seq, "err", err)
		return
	}
	s.applyBatch(seq, b)
	// Counted once applied, so that a reader who sees the batch counted
	// also sees every counter its events moved.
	s.st.batches.Add(1)
	if replayed {
		s.st.replayed.Add(1)
	}
}

// applyBatch passes a decoded batch's events to the sink.
func (s *Source) applyBatch(seq uint64, b *vllmevents.Batch) {
	for _, e := range b.Skipped {
		s.log.Debug("kv event skipped", "seq", seq, "err", e)
	}
	s.st.skipped.Add(uint64(len(b.Skipped)))
	w := s.cfg.Worker
	if b.DPRank != nil {
		w.DPRank = uint32(*b.DPRank)
	}
	s.groups.Learn(b.Events)
	for _, ev := range b.Events {
		var err error
		switch e := ev.(type) {
		case *vllmevents.BlockStored:
			if s.otherGroup(s.groups.Stored(e.GroupIdx, e.KVCacheSpecKind)) {
				continue
			}
			tier, ok := s.tier(e.Medium)
			if !ok || !s.local(e.Locality) {
				continue
			}
			s.st.blocksStored.Add(uint64(len(e.BlockHashes)))
			keys, kerr := vllmevents.ParseExtraKeys(e.ExtraKeys)
			if kerr == nil && keys != nil && len(keys) != len(e.BlockHashes) {
				kerr = errMisalignedExtraKeys
			}
			var mm [][]uint64
			if kerr == nil {
				mm = mmIdentifiers(keys, e.LoRAName)
			}
			err = s.sink.ApplyEngineStored(&router.EngineStored{
				Worker: w, EventID: seq, Tier: tier, Parent: e.ParentBlockHash,
				EngineHashes: e.BlockHashes, Tokens: e.TokenIDs, BlockSize: e.BlockSize, LoRA: e.LoRAName,
				Salt: s.storedSalt(w.DPRank, e, keys),
				MM:   withMarks(mm, s.apartMarks(e, keys, kerr != nil)),
			})
		case *vllmevents.BlockRemoved:
			if s.otherGroup(s.groups.Removed(e.GroupIdx)) {
				continue
			}
			tier, ok := s.tier(e.Medium)
			if !ok {
				continue
			}
			s.st.blocksRemoved.Add(uint64(len(e.BlockHashes)))
			s.removedSalts(w.DPRank, e.BlockHashes, false)
			kev := kv.RemovedEvent(w, seq, e.BlockHashes...)
			kev.Tier = tier
			err = s.sink.ApplyEvent(&kev)
		case *vllmevents.AllBlocksCleared:
			s.st.clears.Add(1)
			s.removedSalts(w.DPRank, nil, true)
			kev := kv.ClearedEvent(w, seq)
			err = s.sink.ApplyEvent(&kev)
		default:
			s.st.skipped.Add(1)
			continue
		}
		s.st.events.Add(1)
		s.ranks[w.DPRank] = struct{}{}
		if err != nil {
			s.st.applyErrors.Add(1)
			s.log.Debug("sink refused a kv event", "seq", seq, "type", ev.Type(), "err", err)
		}
	}
}

// tier places an event's blocks. A medium the router does not know is not
// guessed: the event is skipped and counted under the one label
// "medium=unknown", whatever the engine sent (the value is input, and
// metric labels must stay a bounded set).
func (s *Source) tier(m vllmevents.Medium) (kv.StorageTier, bool) {
	t, ok := m.Tier()
	if !ok {
		s.st.skipped.Add(1)
		s.unsupported("medium=unknown")
	}
	return t, ok
}

// local says whether stored blocks are the engine's own. Blocks stored
// away from it (locality REMOTE: vLLM's shared storage tiers) are not
// credited to it, as Dynamo does not credit them; a locality nobody knows
// is not guessed either. Their removals need no filter: they name blocks
// the index never held.
func (s *Source) local(locality string) bool {
	switch strings.ToUpper(locality) {
	case "", "LOCAL":
		return true
	case "REMOTE":
		s.unsupported("locality=remote")
	default:
		s.unsupported("locality=unknown")
	}
	s.st.skipped.Add(1)
	return false
}

// otherGroup counts an event of a group the router does not index, and
// reports whether it is one.
func (s *Source) otherGroup(v GroupVerdict, field string) bool {
	if v == GroupIndexed {
		return false
	}
	s.st.skipped.Add(1)
	s.st.otherGroup.Add(1)
	if field != "" {
		s.unsupported(field)
	}
	return true
}

// processed publishes the position for LastSeq/Synced/WaitSeq.
func (s *Source) processed(seq uint64) {
	s.mu.Lock()
	s.last, s.haveLast = seq, true
	s.wakeLocked()
	s.mu.Unlock()
}

func (s *Source) wake() {
	s.mu.Lock()
	s.wakeLocked()
	s.mu.Unlock()
}

func (s *Source) wakeLocked() {
	if s.changed != nil {
		close(s.changed)
		s.changed = nil
	}
}

// RankEndpoint returns a rank's endpoint: rank 0's with its port moved up
// by rank, as vLLM numbers the KV-event and replay sockets of dp ranks.
func RankEndpoint(endpoint string, rank int) (string, error) {
	if endpoint == "" || rank == 0 {
		return endpoint, nil
	}
	i := strings.LastIndexByte(endpoint, ':')
	port, err := strconv.Atoi(endpoint[i+1:])
	if i < 0 || err != nil {
		return "", fmt.Errorf("enginesource: endpoint %q has no port to number ranks from", endpoint)
	}
	return endpoint[:i+1] + strconv.Itoa(port+rank), nil
}
