// Package router ties kvrouter's core together into the routing engine the
// adapters drive: workers come and go, their KV events feed the index, and
// every request is hashed once, matched, scored and booked (once more per
// other block size when engines do not all use the router's; see
// blocksize.go).
//
// It is the Go counterpart of Dynamo's KvPushRouter: BestWorker (query
// only, or booking the request under an id), PotentialLoads,
// MarkPrefillCompleted, Free, DumpEvents, ApplyEvent, AddWorker and
// RemoveWorker. Like the rest of core it does no I/O; time and randomness
// are injected through Config.
package router

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/index"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/load"
	"github.com/kvrouter/kvrouter/core/sched"
)

// Config is the router's configuration; the comments name the flag each
// field stands for. Start from DefaultConfig.
type Config struct {
	BlockSize int        // --kv-cache-block-size
	Mode      sched.Mode // --router-mode
	// LoadAware is the --load-aware preset: kv mode with no overlap credit,
	// no KV events and no reuse assumption.
	LoadAware bool
	// Routing holds the config-level knobs requests may override:
	// --router-kv-overlap-score-credit, --router-prefill-load-scale, the
	// legacy --kv-overlap-score-weight, --router-temperature,
	// --no-router-assume-kv-reuse, --no-router-track-prefill-tokens.
	Routing sched.Overrides
	// PrefillLoadModel is --router-prefill-load-model: "none" (or "")
	// counts a prompt's tokens until its first token; "learned" learns
	// each worker's prefill time from the requests it serves
	// (load.PrefillModel) and prices kv mode's load in time.
	PrefillLoadModel string

	KVEvents        bool   // false: --no-router-kv-events (approximate mode)
	EventThreads    int    // --router-event-threads
	MaxIndexedPairs uint64 // memory cap of the event-fed index, least recently matched evicted first; 0 = none
	// IndexBudgetPairs, used when MaxIndexedPairs is 0, caps the index
	// too, evicting leaves in no particular order (index.Config.BudgetPairs):
	// the default cap, sized from the machine's memory; 0 = none.
	IndexBudgetPairs uint64
	IndexPruneRatio  float64 // the cap's low-water mark, fraction of MaxIndexedPairs
	// OneGoroutine says the caller applies events and routes from one
	// goroutine, over at most index.MaxSingleRanks ranks, with device-tier
	// events only and never near IndexBudgetPairs (the simulator): the
	// event-fed index is then index.Single, which answers as index.Index
	// for less work per block, and keeps no dumps. MaxIndexedPairs needs
	// index.Index and takes precedence.
	OneGoroutine bool

	ApproxTTL        time.Duration // --router-ttl-secs
	MaxTreeSize      int           // --router-max-tree-size
	PruneTargetRatio float64       // --router-prune-target-ratio
	// PredictedTTL (--router-predicted-ttl-secs; 0 = off) also indexes
	// each decision until the engine's events confirm it; it matters only
	// with KV events, since without them every decision is a prediction.
	PredictedTTL time.Duration
	// RecoveryWindow is how long a rank counts as recovering after an event
	// below an unknown parent (see Recovering); 0 = DefaultRecoveryWindow.
	RecoveryWindow time.Duration
	// KVEventsGrace is how long a rank that computes prompts may go
	// without a KV event before it is routed by predicted blocks, in the
	// modes that score cached prefixes (--router-kv-events-grace-secs; see
	// kvevents.go); 0 = never.
	KVEventsGrace time.Duration
	// Remote is --use-remote-indexer: the primary index another process
	// keeps, asked instead of keeping one here. The router then keeps an
	// approximate index of its own decisions, read while the remote does
	// not answer; the predict-on-route side index stays local.
	Remote RemoteIndex

	TrackActiveBlocks bool          // false: --no-router-track-active-blocks
	TrackOutputBlocks bool          // --router-track-output-blocks
	RequestTTL        time.Duration // active requests older than this expire

	Sessions            sched.SessionLimits   // --router-max-sessions, --router-max-session-timeout
	SessionAffinity     sched.SessionAffinity // --router-session-affinity-mode; "" = hard
	MaxThresholdModels  int                   // models /busy_threshold holds; 0 = sched.DefaultMaxThresholdModels
	Busy                sched.BusyThreshold   // --active-decode-blocks-threshold, --active-prefill-tokens-threshold
	QueueThreshold      *float64              // --router-queue-threshold; nil = no queue
	QueuePolicy         sched.QueuePolicy     // --router-queue-policy
	OverlapRefreshAfter time.Duration         // re-match queued requests older than this; 0 = never
	// NonCPUToCPURatio is device-aware-weighted's throughput of one
	// accelerator engine in CPU engines (DYN_ENCODER_CUDA_TO_CPU_RATIO);
	// 0 = sched.DefaultNonCPUToCPURatio.
	NonCPUToCPURatio int

	// Now is the clock of expiry, sessions and queueing; nil = time.Now.
	Now func() time.Time
	// Rand drives tie-breaks and sampling; nil = sched.SharedRand.
	Rand sched.Rand
}

// DefaultConfig returns Dynamo's defaults.
func DefaultConfig() Config {
	q := sched.DefaultQueueThreshold
	return Config{
		BlockSize:           16,
		Mode:                sched.ModeKV,
		KVEvents:            true,
		EventThreads:        index.DefaultShards,
		IndexPruneRatio:     0.9,
		ApproxTTL:           index.DefaultApproxTTL,
		MaxTreeSize:         index.DefaultApproxMaxBlocks,
		PruneTargetRatio:    index.DefaultApproxPruneRatio,
		TrackActiveBlocks:   true,
		RequestTTL:          300 * time.Second,
		QueueThreshold:      &q,
		QueuePolicy:         sched.FCFS,
		OverlapRefreshAfter: sched.DefaultRefreshAfter,
		KVEventsGrace:       DefaultKVEventsGrace,
		PredictedTTL:        DefaultPredictedTTL,
	}
}

// WorkerInfo describes one engine. Its ranks 0..DPSize-1 are routed to
// separately.
type WorkerInfo struct {
	ID     uint64
	Model  string // "" serves every model
	DPSize int    // data-parallel ranks; 0 means 1
	// TotalKVBlocks and MaxNumBatchedTokens feed busy detection and the
	// queue; 0 means unknown, which never counts as busy or saturated.
	TotalKVBlocks       int
	MaxNumBatchedTokens int
	// BlockSize is the engine's KV block size in tokens as announced (NATS
	// discovery); 0 = unknown, taken to be the router's. The block size
	// the engine's own events carry overrides it.
	BlockSize int
	Role      Role
	// CPU says the engine computes on CPU, for --router-mode
	// device-aware-weighted; an engine that does not say is taken to run on
	// an accelerator, as Dynamo takes it.
	CPU bool
}

// Request is one request to route.
type Request struct {
	// ID books the request under this id; "" only asks where it would go.
	ID     string
	Tokens []uint32
	LoRA   string // adapter name; "" = base model
	// CacheSalt is the request's cache_salt (vLLM, SGLang): its blocks
	// match only blocks cached under the same salt. "" = none.
	CacheSalt string
	// MM places the request's multimodal items on its tokens; blocks that
	// hold part of an item are matched by its identifier too.
	MM    []MMItem
	Model string
	// Priority, StrictPriority and OSL are nvext.agent_hints.
	Priority       float64
	StrictPriority uint32
	OSL            int
	Overrides      sched.Overrides
	// Target pins the request to a worker rank (nvext backend_instance_id,
	// dp_rank); required in direct mode.
	Target *kv.Worker
	// OverrideBusy sends a Target even to a busy worker (an operator's
	// pin); other pins to a busy worker fail with sched.ErrAllBusy.
	OverrideBusy bool
	Session      *sched.SessionControl
	// Exclude names engines this request must not go to: they already
	// failed it, and the registry may not have caught up yet.
	Exclude []uint64
	// Only, when not nil, names the only engines the request may go to:
	// those holding its LoRA adapter.
	Only []uint64
	// Prefill routes the prefill half of a disaggregated request among the
	// model's prefill workers, booked without active blocks: a prefill
	// engine does no decode and hands its KV over. Otherwise the request
	// goes to a decode-capable worker (RoleBoth or RoleDecode).
	Prefill bool
	// LocalHashes, when it has one hash per full block of Tokens at the
	// router's block size, are the blocks' local hashes under the
	// request's LoRA and CacheSalt (blockhash.NewKeyed), which the router
	// takes instead of hashing Tokens; the caller vouches for them. A
	// caller that hashed the prompt already (the simulator, which hands the
	// same hashes to the router's stored events: EngineStored.LocalHashes)
	// spares hashing it twice. Any other length is ignored.
	LocalHashes []uint64
	// SeqHashes, with LocalHashes and as long, are their sequence hashes
	// (blockhash.AppendSequenceHashes), which the router then takes too.
	SeqHashes []uint64
	// LentHashes lets the router keep LocalHashes and SeqHashes (both
	// taken, no MM) as they are instead of copying them, until it is done
	// with the request: the call that routed it has returned or, for a
	// request Submit left queued, its dispatch has been called. The
	// caller changes neither meanwhile. A caller that keeps every
	// prompt's hashes anyway (the simulator) spares a copy per request,
	// which for each request the admission queue holds was fresh memory.
	LentHashes bool
}

// MMItem is one multimodal item (image, audio clip) of a prompt: its
// placeholder tokens are Tokens[Offset : Offset+Length].
type MMItem struct {
	Offset, Length int
	// Hash is the item's identifier (blockhash.HashMMIdentifier); Known
	// false means the router could not compute the identifier the engine
	// will use, and the request is matched only up to the first block that
	// holds part of the item.
	Hash  uint64
	Known bool
}

// Decision is where a request goes and what the router knew when it chose.
type Decision struct {
	Worker        kv.Worker
	OverlapBlocks int // leading prompt blocks cached on Worker
	PromptBlocks  int // full blocks of the prompt
	Via           sched.Via
	Queued        time.Duration // time spent in the admission queue
	Timings       Timings
	Warning       string // e.g. a deprecated knob was used
}

// Timings split the router's own overhead for one decision.
type Timings struct {
	Hash, FindMatches, Schedule, Total time.Duration
	// Book is the part of Schedule spent booking the chosen worker's load;
	// the rest is scoring. Schedule keeps both, as the routing metrics
	// always reported them together.
	Book time.Duration
}

// Errors of the router; the scheduler's (sched.ErrAllBusy, ...) pass through.
var (
	ErrUnknownWorker  = errors.New("router: event for an unknown worker")
	ErrDPRankRange    = errors.New("router: event for a dp rank the worker does not have")
	ErrDuplicateID    = errors.New("router: a request with this id is already active")
	ErrNoWorkers      = errors.New("router: no workers serve this model")
	ErrEventsDisabled = errors.New("router: kv events are disabled")
)

// Router is safe for concurrent use.
type Router struct {
	cfg     Config
	params  sched.Params // config-level resolved knobs
	warning string
	now     func() time.Time
	rng     sched.Rand

	exact  exactIndex    // event-fed index; nil without events or overlap credit
	approx *index.Approx // approximate mode's index: no events, decisions are the cache
	// predicted is predict-on-route beside the event-fed index; nil when off.
	predicted *index.Predicted
	// remote is the primary kept elsewhere (Config.Remote); nil when the
	// router keeps its own.
	remote *remoteState
	// predictEveryDepth makes predicted lookups list every predicted
	// overlap, even those heldByEvery shows cannot change the decision:
	// the reference its skip is tested against.
	predictEveryDepth bool
	// matches numbers matches (prepared.match).
	matches atomic.Uint64

	tracker    *load.Tracker
	prefill    *load.PrefillModel // nil unless --router-prefill-load-model learned
	scheduler  *sched.Scheduler
	sessions   *sched.Sessions
	thresholds *sched.Thresholds

	// fleet is the current worker snapshot, replaced whole on every change
	// so the hot path reads it without a lock.
	fleet   atomic.Pointer[fleet]
	fleetMu sync.Mutex // serialises fleet writers

	// mu serialises decisions that book load, and owns the queues: each
	// booking sees the loads of the ones before it, which is what keeps a
	// burst sharing one hot prefix from piling onto a single worker.
	mu      sync.Mutex
	queues  *queues
	waiters map[string]waiter
	// onQueued, if set, is called with r.mu held once a request waits in
	// the queue; tests synchronise on it.
	onQueued func(id string)

	// engineLoads is what each rank last reported about its own load, for
	// the modes that read it; replaced whole on every update so decisions
	// read it without a lock.
	engineLoads  atomic.Pointer[map[kv.Worker]sched.EngineLoad]
	engineLoadMu sync.Mutex // serialises engineLoads writers

	// recovery places the events of ranks whose history was lost.
	recovery *recovery
	// watch routes ranks whose KV events never come by prediction; nil
	// without an event-fed index or with detection off.
	watch *eventWatch

	scratch sync.Pool
	stats   counters
	offload offloadBooks // see offloaded.go
	// remotePrefill settles other replicas' prefills from KV events.
	remotePrefill remotePrefills
	observer      atomic.Pointer[func(LoadUpdate)] // see SetLoadObserver
	// sizeObserver: see SetBlockSizeObserver.
	sizeObserver atomic.Pointer[func(BlockSizeChange)]
	tap          atomic.Pointer[tapHolder] // see SetDecisionTap
}

type fleet struct {
	// id names this snapshot to the load tracker (load.Query.WorkersID):
	// ranks never changes once the snapshot is published.
	id    uint64
	infos map[uint64]WorkerInfo
	ranks []kv.Worker // every routable rank, in a stable order
	// first is the index in ranks of each engine's rank 0, with its rank
	// count; its other ranks follow it.
	first idTable
	rinfo []WorkerInfo // info of ranks[i]
	// mixed is set when a rank serves one model only or prefills only: a
	// decision must then check every rank against the request.
	mixed bool
	// learned are the block sizes the engines' events carry.
	learned map[uint64]int
	// odd maps the engines whose block size is not the router's to theirs,
	// and sizes lists those block sizes once each; both are empty while
	// every engine agrees with the router, which keeps that path as it was.
	odd   map[uint64]int
	sizes []int
	// events counts each engine's KV events accepted, for a rate on the
	// dashboard; an engine keeps its counter across fleet rebuilds.
	events map[uint64]*atomic.Uint64
}

// position is rank w's index in ranks.
func (f *fleet) position(w kv.Worker) (int, bool) {
	i, ranks, ok := f.first.get(w.ID)
	if !ok || int64(w.DPRank) >= int64(ranks) {
		return 0, false
	}
	return int(i) + int(w.DPRank), true
}

// blockSize is the block size engine id's blocks are hashed with.
func (f *fleet) blockSize(id uint64, routerSize int) int {
	if size, ok := f.odd[id]; ok {
		return size
	}
	return routerSize
}

type queuedResult struct {
	d   Decision
	err error
}

// waiter is how a queued request learns its decision: on ch, for
// BestWorker, or by fn, for Submit (which then releases p).
type waiter struct {
	ch chan queuedResult
	fn func(Decision, error)
	p  *prepared
}

// notify runs with r.mu held, from the drain that dispatched the request;
// drain reads nothing of p after it.
func (w waiter) notify(res queuedResult) {
	if w.fn == nil {
		w.ch <- res
		return
	}
	w.fn(res.d, res.err)
	release(w.p)
}

// New builds a router. It fails on contradictory or out-of-range settings.
func New(cfg Config) (*Router, error) {
	if cfg.BlockSize <= 0 {
		return nil, fmt.Errorf("router: block size must be positive, got %d", cfg.BlockSize)
	}
	if cfg.Mode == "" {
		cfg.Mode = sched.ModeKV
	}
	if cfg.LoadAware {
		cfg.Mode = sched.ModeKV
		cfg.Routing = sched.LoadAware(cfg.Routing)
		cfg.KVEvents = false
	}
	params, warning, err := sched.Resolve(cfg.Routing, sched.Overrides{})
	if err != nil {
		return nil, err
	}
	learned, err := ParsePrefillLoadModel(cfg.PrefillLoadModel)
	if err != nil {
		return nil, err
	}
	if learned && !params.TrackPrefillTokens {
		return nil, errors.New("router: --router-prefill-load-model learned needs prompt tokens tracked (drop --no-router-track-prefill-tokens)")
	}
	if cfg.KVEventsGrace < 0 {
		return nil, fmt.Errorf("router: the kv events grace period must not be negative, got %v", cfg.KVEventsGrace)
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Rand == nil {
		cfg.Rand = sched.SharedRand
	}
	thresholds, err := sched.NewThresholds(cfg.Busy, cfg.MaxThresholdModels)
	if err != nil {
		return nil, err
	}
	sessions := sched.NewSessions(cfg.Sessions)
	scheduler, err := sched.New(cfg.Mode, sessions)
	if err != nil {
		return nil, err
	}
	if cfg.SessionAffinity != "" {
		a, err := sched.ParseSessionAffinity(string(cfg.SessionAffinity))
		if err != nil {
			return nil, err
		}
		scheduler.SetSessionAffinity(a)
	}
	if cfg.NonCPUToCPURatio != 0 {
		if err := scheduler.SetNonCPUToCPURatio(cfg.NonCPUToCPURatio); err != nil {
			return nil, err
		}
	}
	policy := cfg.QueuePolicy
	if policy == "" {
		policy = sched.FCFS
	}
	if _, err := sched.NewQueue(policy); err != nil {
		return nil, err
	}
	r := &Router{
		cfg: cfg, params: params, warning: warning, now: cfg.Now, rng: cfg.Rand,
		tracker: load.New(load.Config{
			BlockSize:          cfg.BlockSize,
			TrackActiveBlocks:  cfg.TrackActiveBlocks,
			TrackPrefillTokens: params.TrackPrefillTokens,
			TrackOutputBlocks:  cfg.TrackOutputBlocks,
			AssumeKVReuse:      params.AssumeKVReuse,
			RequestTTL:         cfg.RequestTTL,
			Now:                cfg.Now,
		}),
		scheduler: scheduler, sessions: sessions, thresholds: thresholds,
		queues: newQueues(policy), waiters: map[string]waiter{},
		recovery: newRecovery(cfg.RecoveryWindow, cfg.Now),
	}
	if learned {
		r.prefill = load.NewPrefillModel()
	}
	approxCfg := index.ApproxConfig{TTL: cfg.ApproxTTL, MaxBlocks: cfg.MaxTreeSize, PruneRatio: cfg.PruneTargetRatio, Now: cfg.Now}
	// With no overlap credit the cost ignores caches: no index at all.
	if cfg.Remote != nil && (!cfg.KVEvents || !params.UsesOverlap()) {
		return nil, errRemoteWithoutEvents
	}
	if params.UsesOverlap() {
		switch {
		case cfg.Remote != nil:
			r.remote = &remoteState{idx: cfg.Remote}
			r.approx = index.NewApprox(approxCfg)
			if cfg.PredictedTTL > 0 {
				r.predicted = index.NewPredicted(index.ApproxConfig{TTL: cfg.PredictedTTL, MaxBlocks: cfg.MaxTreeSize, PruneRatio: cfg.PruneTargetRatio, Now: cfg.Now})
			}
		case cfg.KVEvents:
			if cfg.OneGoroutine && cfg.MaxIndexedPairs == 0 {
				r.exact = index.NewSingle()
			} else {
				r.exact = index.New(index.Config{Shards: cfg.EventThreads, MaxPairs: cfg.MaxIndexedPairs, BudgetPairs: cfg.IndexBudgetPairs, PruneRatio: cfg.IndexPruneRatio, Locate: r.recovery.locate})
			}
			// Only a policy that scores cached prefixes suffers from, or
			// is helped around, an engine's missing events.
			if cfg.KVEventsGrace > 0 && cfg.Mode.ScoresOverlap() {
				r.watch = newEventWatch(cfg.KVEventsGrace, cfg.Now, approxCfg)
			}
			if cfg.PredictedTTL > 0 {
				r.predicted = index.NewPredicted(index.ApproxConfig{TTL: cfg.PredictedTTL, MaxBlocks: cfg.MaxTreeSize, PruneRatio: cfg.PruneTargetRatio, Now: cfg.Now})
			}
		default:
			r.approx = index.NewApprox(approxCfg)
		}
	}
	r.fleet.Store(r.buildFleet(map[uint64]WorkerInfo{}, map[uint64]int{}))
	r.scratch.New = func() any { return new(scratch) }
	return r, nil
}

// Warning is the deprecation warning of the configuration, if any.
func (r *Router) Warning() string { return r.warning }

// Thresholds is the live busy-threshold registry (GET/POST /busy_threshold).
func (r *Router) Thresholds() *sched.Thresholds { return r.thresholds }

// BlockSize is the router's KV block size in tokens.
func (r *Router) BlockSize() int { return r.cfg.BlockSize }

// AddWorker registers (or re-registers, updating its info) an engine.
func (r *Router) AddWorker(info WorkerInfo) {
	if info.DPSize <= 0 {
		info.DPSize = 1
	}
	r.fleetMu.Lock()
	defer r.fleetMu.Unlock()
	old := r.fleet.Load()
	infos := make(map[uint64]WorkerInfo, len(old.infos)+1)
	for id, in := range old.infos {
		infos[id] = in
	}
	if prev, ok := infos[info.ID]; ok && prev.DPSize > info.DPSize {
		// Ranks that disappear take their state with them.
		for rank := info.DPSize; rank < prev.DPSize; rank++ {
			r.dropRank(kv.Worker{ID: info.ID, DPRank: uint32(rank)})
		}
	}
	infos[info.ID] = info
	for rank := range info.DPSize {
		r.watch.register(kv.Worker{ID: info.ID, DPRank: uint32(rank)})
	}
	r.fleet.Store(r.buildFleet(infos, old.learned))
	if r.exact != nil {
		for rank := range info.DPSize {
			r.exact.Reserve(kv.Worker{ID: info.ID, DPRank: uint32(rank)}, info.TotalKVBlocks)
		}
	}
	r.drain()
}

// RemoveWorker forgets an engine: its ranks leave routing and their blocks,
// bookings and session pins go with them.
func (r *Router) RemoveWorker(id uint64) {
	r.fleetMu.Lock()
	defer r.fleetMu.Unlock()
	old := r.fleet.Load()
	info, ok := old.infos[id]
	if !ok {
		return
	}
	infos := make(map[uint64]WorkerInfo, len(old.infos))
	for k, in := range old.infos {
		if k != id {
			infos[k] = in
		}
	}
	learned := maps.Clone(old.learned)
	delete(learned, id)
	r.fleet.Store(r.buildFleet(infos, learned))
	if r.exact != nil {
		r.exact.RemoveWorker(id)
	}
	r.recovery.forget(id)
	r.watch.forget(func(w kv.Worker) bool { return w.ID == id })
	if r.approx != nil {
		r.approx.RemoveWorker(id)
	}
	if r.predicted != nil {
		r.predicted.RemoveWorker(id)
	}
	r.remotePrefill.removeWorker(id)
	for rank := 0; rank < info.DPSize; rank++ {
		r.tracker.RemoveWorker(kv.Worker{ID: id, DPRank: uint32(rank)})
		if r.prefill != nil {
			r.prefill.RemoveWorker(kv.Worker{ID: id, DPRank: uint32(rank)})
		}
	}
	r.forgetEngineLoad(id)
}

// forgetEngineLoad drops a departed engine's reports: should it come back,
// a stale usage must not mark it busy before it reports again.
func (r *Router) forgetEngineLoad(id uint64) {
	r.engineLoadMu.Lock()
	defer r.engineLoadMu.Unlock()
	old := r.engineLoads.Load()
	if old == nil {
		return
	}
	next := maps.Clone(*old)
	maps.DeleteFunc(next, func(w kv.Worker, _ sched.EngineLoad) bool { return w.ID == id })
	r.engineLoads.Store(&next)
}

func (r *Router) dropRank(w kv.Worker) {
	if r.exact != nil {
		r.exact.RemoveRank(w)
	}
	r.watch.forget(func(o kv.Worker) bool { return o == w })
	r.tracker.RemoveWorker(w)
}

func (r *Router) buildFleet(infos map[uint64]WorkerInfo, learned map[uint64]int) *fleet {
	f := &fleet{id: fleetIDs.Add(1), infos: infos, first: newIDTable(len(infos)), learned: learned, odd: map[uint64]int{}, events: make(map[uint64]*atomic.Uint64, len(infos))}
	old := r.fleet.Load()
	ids := make([]uint64, 0, len(infos))
	for id := range infos {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	for _, id := range ids {
		if old != nil && old.events[id] != nil {
			f.events[id] = old.events[id]
		} else {
			f.events[id] = new(atomic.Uint64)
		}
		in := infos[id]
		size := in.BlockSize
		if l, ok := learned[id]; ok {
			size = l
		}
		if size > 0 && size <= maxBlockSize && size != r.cfg.BlockSize {
			f.odd[id] = size
			if !slices.Contains(f.sizes, size) {
				f.sizes = append(f.sizes, size)
			}
			// Loads are booked in router blocks: so is the capacity the
			// busy threshold compares them with.
			in.TotalKVBlocks = in.TotalKVBlocks * size / r.cfg.BlockSize
		}
		if in.DPSize > 0 {
			f.first.put(id, int32(len(f.ranks)), int32(in.DPSize))
			f.mixed = f.mixed || in.Model != "" || in.Role == RolePrefill
		}
		for rank := 0; rank < in.DPSize; rank++ {
			w := kv.Worker{ID: id, DPRank: uint32(rank)}
			f.ranks = append(f.ranks, w)
			f.rinfo = append(f.rinfo, in)
		}
	}
	return f
}

// fleetIDs numbers fleet snapshots, across routers: one tracker never sees
// two fleets under one id.
var fleetIDs atomic.Uint64

// Workers lists the registered engines.
func (r *Router) Workers() []WorkerInfo {
	f := r.fleet.Load()
	out := make([]WorkerInfo, 0, len(f.infos))
	for _, in := range f.infos {
		out = append(out, in)
	}
	slices.SortFunc(out, func(a, b WorkerInfo) int { return cmpU64(a.ID, b.ID) })
	return out
}

func cmpU64(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// ApplyEvent feeds one KV event to the index. Events of unknown workers or
// ranks are counted and refused; the index counts its own rejections.
func (r *Router) ApplyEvent(ev *kv.Event) error {
	f := r.fleet.Load()
	info, ok := f.infos[ev.Worker.ID]
	switch {
	case !ok:
		r.stats.unknownWorker.Add(1)
		return ErrUnknownWorker
	case int(ev.Worker.DPRank) >= info.DPSize:
		r.stats.badRank.Add(1)
		return fmt.Errorf("%w: rank %d of %d", ErrDPRankRange, ev.Worker.DPRank, info.DPSize)
	}
	f.events[ev.Worker.ID].Add(1)
	if ev.Kind != kv.KindCleared {
		// Routers and their event sources synthesise clears when they
		// rebuild a rank (a dump, a lost history): no proof of the
		// engine's events.
		r.watch.heardFrom(ev.Worker)
	}
	switch {
	case !r.cfg.KVEvents:
		r.stats.ignoredEvents.Add(1)
		return ErrEventsDisabled
	case r.exact == nil:
		// Overlap credit 0: nothing reads the index, so none is kept.
		r.stats.ignoredEvents.Add(1)
		return nil
	}
	if b := r.offload.of(ev.Worker); b != nil && ev.Kind != kv.KindStored {
		b.removed(ev.Tier, ev.Removed.EngineHashes, ev.Kind == kv.KindCleared)
	}
	if err := r.exact.Apply(ev); err != nil {
		return err
	}
	if ev.Kind == kv.KindStored && (ev.Tier == "" || ev.Tier == kv.TierDevice) {
		r.remoteStored(ev.Worker)
	}
	return nil
}

// EngineStored is a block-stored event as engines emit it (vLLM's and
// SGLang's BlockStored): token ids and the engine's block size instead of
// the router's hashes.
type EngineStored struct {
	Worker       kv.Worker
	EventID      uint64
	Tier         kv.StorageTier
	Parent       *uint64  // engine id of the parent block; nil = root
	EngineHashes []uint64 // one per block
	Tokens       []uint32 // all tokens of all blocks, in order
	BlockSize    int      // the engine's block size
	LoRA         string   // adapter name; "" = base model
	// Salt is the cache salt the blocks' request was salted with, for every
	// block of its chain: engines mix it into the request's first block
	// only, so the event source carries it over to the blocks that
	// continue a salted parent. "" = none.
	Salt string
	// MM holds, per block, the identifiers (blockhash.HashMMIdentifier) of
	// the multimodal items the block holds part of; nil, or a nil entry,
	// for blocks without any.
	MM [][]uint64
	// LocalHashes are the local hashes of the first len(LocalHashes)
	// blocks as HashEngineStored computes them, which it takes instead of
	// hashing those blocks' tokens again; the caller vouches for them (see
	// Request.LocalHashes).
	LocalHashes []uint64
}

// ErrMisSizedBlocks reports blocks dropped because the event's tokens do
// not fill them.
var ErrMisSizedBlocks = errors.New("router: stored blocks with fewer tokens than their block size")

// ApplyEngineStored hashes an engine's stored blocks with the engine's own
// block size and applies them (see HashEngineStored). A block size other
// than the one the router assumed for that engine is learnt first: from
// then on the engine's overlap with a request is matched with hashes of
// its block size (see BlockSizeChange).
func (r *Router) ApplyEngineStored(es *EngineStored) error {
	// Blocks of any size show that the engine's events arrive.
	r.watch.heardFrom(es.Worker)
	if es.BlockSizeConsistent() {
		f := r.fleet.Load()
		if _, known := f.infos[es.Worker.ID]; known && f.learned[es.Worker.ID] != es.BlockSize {
			r.learnBlockSize(es.Worker.ID, es.BlockSize)
		}
	}
	if tokenless(es) {
		return r.applyOffloaded(es)
	}
	sc := storedScratches.Get().(*storedScratch)
	defer sc.put()
	var dropped int
	var err error
	ev := &sc.ev
	*ev, dropped, err = hashEngineStored(es, r.cfg.BlockSize, &sc.blocks)
	r.stats.misSized.Add(uint64(dropped))
	if err != nil && len(ev.Stored.Blocks) == 0 {
		return err
	}
	if e := r.ApplyEvent(ev); e != nil {
		return e
	}
	if b := r.offload.of(es.Worker); b != nil && (ev.Tier == "" || ev.Tier == kv.TierDevice) {
		b.recordDevice(ev)
	}
	return err
}

// applyOffloaded places lower-tier blocks published by id alone (see
// offloaded.go).
func (r *Router) applyOffloaded(es *EngineStored) error {
	evs, unplaced := r.offload.open(es.Worker).place(es)
	r.stats.unplaced.Add(uint64(unplaced))
	var first error
	for i := range evs {
		if err := r.ApplyEvent(&evs[i]); err != nil && first == nil {
			first = err
		}
	}
	if first == nil && unplaced > 0 {
		first = fmt.Errorf("%w: %d of %d offloaded blocks never seen on the device", ErrUnplacedBlocks, unplaced, len(es.EngineHashes))
	}
	return first
}

// ErrUnplacedBlocks reports lower-tier blocks published without tokens
// that the router cannot place (see offloaded.go).
var ErrUnplacedBlocks = errors.New("router: offloaded blocks without tokens or a known device copy")

// HashEngineStored turns an engine's stored blocks into the event the
// index applies, hashing their tokens with the engine's block size, or
// with defaultBlockSize for an event that does not say; agents use it too,
// so what they publish is what a router would have computed. Blocks whose
// tokens are missing are dropped, together with every later block of the
// event, since they hang below them; dropped counts them. Blocks are
// keyed as requests are (see Request): by the adapter and the salt of the
// whole chain (every block of a salted request carries it, not only the
// first one the engine mixes it into) and by their multimodal items.
func HashEngineStored(es *EngineStored, defaultBlockSize int) (ev kv.Event, dropped int, err error) {
	return hashEngineStored(es, defaultBlockSize, nil)
}

// storedScratch holds an event ApplyEngineStored builds and its block
// list, which the index copies: a fresh list and event per Stored event
// were most of the simulator's allocations on the event path.
type storedScratch struct {
	ev     kv.Event
	blocks []kv.Block
}

var storedScratches = sync.Pool{New: func() any { return new(storedScratch) }}

// maxPooledStored is the longest block list a pooled storedScratch keeps.
const maxPooledStored = 1 << 14

func (sc *storedScratch) put() {
	sc.ev = kv.Event{}
	if cap(sc.blocks) <= maxPooledStored {
		storedScratches.Put(sc)
	}
}

// hashEngineStored is HashEngineStored building the event's blocks in
// *buf, grown when short, when buf is not nil.
func hashEngineStored(es *EngineStored, defaultBlockSize int, buf *[]kv.Block) (ev kv.Event, dropped int, err error) {
	size := es.BlockSize
	if size <= 0 {
		size = defaultBlockSize
	}
	n := len(es.EngineHashes)
	whole := min(n, len(es.Tokens)/size)
	if whole < n {
		dropped = n - whole
		err = fmt.Errorf("%w: %d tokens for %d blocks of %d", ErrMisSizedBlocks, len(es.Tokens), n, size)
	}
	h := blockhash.NewKeyed(size, es.LoRA, es.Salt)
	var blocks []kv.Block
	if buf != nil && cap(*buf) >= whole {
		blocks = (*buf)[:whole]
	} else {
		blocks = make([]kv.Block, whole)
		if buf != nil {
			*buf = blocks
		}
	}
	for i := range blocks {
		var local uint64
		if i < len(es.LocalHashes) {
			local = es.LocalHashes[i]
		} else {
			local = engineLocalHash(h, es, i)
		}
		blocks[i] = kv.Block{EngineHash: es.EngineHashes[i], LocalHash: local}
	}
	ev = kv.StoredEvent(es.Worker, es.EventID, es.Parent, blocks...)
	if es.Tier != "" {
		ev.Tier = es.Tier
	}
	return ev, dropped, err
}

// scratch is the per-decision working memory, pooled.
type scratch struct {
	m        index.Matcher
	overlaps []int
	// lower are the candidates' host and disk overlaps and where the
	// shared cache's run after their device overlap ends, by fleet
	// position; filled only when the index holds lower tiers.
	lower [][3]int
	pots  []load.Potential
	cands []sched.Candidate
	// busy are the request's thresholds, read once by candidates for
	// decide.
	busy sched.BusyThreshold
	// overlaps holds, by position in fleet, the largest of the first
	// mapped overlaps of the match numbered match (see heldByEvery), for
	// candidates to go on from.
	mapped      int
	mappedMatch uint64
	mappedFleet *fleet
	// sreq is decide's request to the scheduler.
	sreq sched.Request
	// lightest is sched.LightestOf(cands), summarised by candidates as it
	// fills them, when lightestOK.
	lightest   sched.Lightest
	lightestOK bool
}

// prepared is a request after hashing and matching.
type prepared struct {
	req        *Request
	params     sched.Params
	warning    string
	local, seq []uint64
	// own are the pooled buffers local and seq are built in, unless the
	// request lent its hashes (Request.LentHashes).
	own [2][]uint64
	// matchable is how many leading blocks of seq may be credited as
	// cached (see appendMMHashes); seq beyond it is booked, never matched.
	matchable int
	// alt are the request's hashes in the other block sizes of the fleet.
	alt      []altHashes
	hashTime time.Duration
	findTime time.Duration
	// start and lap are readings of tick: when the decision began and when
	// its last stage ended, which is when the next one begins.
	start, lap   time.Duration
	arrival      time.Time
	matchedAt    time.Time
	cachedBlocks int // best overlap over all workers, for queue ordering
	// match numbers the match that found overlaps, among the router's.
	match uint64
	// overlaps are the matches found, kept so a queued request can be
	// dispatched without matching again unless it waited long.
	overlaps []index.Overlap
	// tiers are the event-fed index's overlaps on every tier, when it
	// holds lower tiers; sharedRoot the shared cache's run from the first
	// block (see index.Matcher.Tiers).
	tiers      []index.TierOverlap
	sharedRoot int
}

// BestWorker routes req. With req.ID set the request is booked: its load
// counts until Free (and its prefill until MarkPrefillCompleted), and it may
// wait in the admission queue until ctx ends. Without an ID nothing changes
// but session pins: the answer is where the request would go now.
func (r *Router) BestWorker(ctx context.Context, req *Request) (Decision, error) {
	p, err := r.prepare(req)
	if err != nil {
		return Decision{}, err
	}
	// Both the hashes and the scratch are reused by later requests: neither
	// escapes a decision, and a queued request's are released only once the
	// drain that dispatched it has let go.
	defer release(p)
	sc := r.scratch.Get().(*scratch)
	defer r.scratch.Put(sc)
	r.match(p, sc, p.arrival)

	if req.ID == "" {
		if req.Session != nil {
			// A query follows a session's pin but must not create one.
			s := *req.Session
			s.Action = sched.SessionUse
			q := *req
			q.Session = &s
			p.req = &q
		}
		return r.decide(p, sc, r.candidates(p, sc), false, p.arrival)
	}

	d, queued, ch, err := r.book(p, sc, nil)
	if !queued {
		return d, err
	}
	select {
	case res := <-ch:
		res.d.Timings.Total = tick() - p.start
		return res.d, res.err
	case <-ctx.Done():
		r.mu.Lock()
		removed := r.queues.remove(req.ID)
		delete(r.waiters, req.ID)
		r.mu.Unlock()
		if !removed {
			// Dispatched while we gave up: the booking must not leak.
			if res := <-ch; res.err == nil {
				r.Free(req.ID)
			}
		}
		return Decision{}, ctx.Err()
	}
}

// Submit books req (req.ID must be set) as BestWorker does, but never
// blocks. It is for a caller that owns the clock and runs on one
// goroutine, a discrete-event simulator: a request waiting in the
// admission queue is dispatched only by a later Free or
// MarkPrefillCompleted, which such a caller cannot make while BestWorker
// blocks it. queued reports a request that waits; dispatched is then
// called once, from inside the Free, MarkPrefillCompleted or AddWorker
// call that dispatches it, with the router's lock held: it must record
// the decision and return without calling the router. A queued request
// stays queued until dispatched: there is no context to give up with.
func (r *Router) Submit(req *Request, dispatched func(Decision, error)) (d Decision, queued bool, err error) {
	if req.ID == "" {
		return Decision{}, false, errors.New("router: Submit needs a request id")
	}
	p, err := r.prepare(req)
	if err != nil {
		return Decision{}, false, err
	}
	sc := r.scratch.Get().(*scratch)
	defer r.scratch.Put(sc)
	r.match(p, sc, p.arrival)
	d, queued, _, err = r.book(p, sc, dispatched)
	if !queued {
		release(p)
	}
	return d, queued, err
}

// book decides p now or, when the queue holds it, leaves it to drain,
// which hands the decision to fn or, without fn, on ch.
func (r *Router) book(p *prepared, sc *scratch, fn func(Decision, error)) (d Decision, queued bool, ch chan queuedResult, err error) {
	req := p.req
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, dup := r.waiters[req.ID]; dup {
		return Decision{}, false, nil, ErrDuplicateID
	}
	key := queueKey{model: req.Model, prefill: req.Prefill}
	if cands := r.candidates(p, sc); r.queues.len(key) == 0 && !sched.ShouldQueue(cands, r.cfg.QueueThreshold) {
		d, err := r.decide(p, sc, cands, true, p.arrival)
		return d, false, nil, err
	}
	uncached := max(1, len(req.Tokens)-p.cachedBlocks*r.cfg.BlockSize)
	if err := r.queues.push(key, sched.QueueItem{ID: req.ID, Arrival: p.arrival, Priority: req.Priority, Tier: req.StrictPriority, UncachedTokens: uncached, Payload: p}); err != nil {
		return Decision{}, false, nil, err
	}
	if fn == nil {
		ch = make(chan queuedResult, 1)
	}
	r.waiters[req.ID] = waiter{ch: ch, fn: fn, p: p}
	r.stats.queued.Add(1)
	if r.onQueued != nil {
		r.onQueued(req.ID)
	}
	return Decision{}, true, ch, nil
}

func (r *Router) prepare(req *Request) (*prepared, error) {
	// A request that overrides nothing gets the configuration's knobs,
	// resolved once by New: resolving them again cost an allocation and a
	// pass over every knob per decision.
	params, warning := r.params, r.warning
	if req.Overrides != (sched.Overrides{}) {
		var err error
		if params, warning, err = sched.Resolve(r.cfg.Routing, req.Overrides); err != nil {
			return nil, err
		}
		if warning == "" {
			warning = r.warning
		}
	}
	if err := checkMM(req.MM, len(req.Tokens)); err != nil {
		return nil, err
	}
	start := tick()
	p := preparedPool.Get().(*prepared)
	h := blockhash.NewKeyed(r.cfg.BlockSize, req.LoRA, req.CacheSalt)
	var local, seq []uint64
	own := p.own
	if n := len(req.LocalHashes); n > 0 && n == len(req.Tokens)/r.cfg.BlockSize {
		switch {
		case req.LentHashes && len(req.SeqHashes) == n && len(req.MM) == 0:
			// Capped: nothing appended to them may reach the caller's room.
			local, seq = req.LocalHashes[:n:n], req.SeqHashes[:n:n]
		case len(req.SeqHashes) == n:
			local, seq = append(own[0][:0], req.LocalHashes...), append(own[1][:0], req.SeqHashes...)
			own = [2][]uint64{local, seq}
		default:
			local = append(own[0][:0], req.LocalHashes...)
			seq = blockhash.AppendSequenceHashes(own[1][:0], local)
			own = [2][]uint64{local, seq}
		}
	} else {
		local, seq = h.AppendHashes(own[0][:0], own[1][:0], req.Tokens)
		own = [2][]uint64{local, seq}
	}
	matchable := appendMMHashes(h, req.Tokens, req.MM, local, seq)
	lap := tick()
	*p = prepared{req: req, params: params, warning: warning, local: local, seq: seq, own: own, matchable: matchable, alt: p.alt[:0], overlaps: p.overlaps[:0], tiers: p.tiers[:0], hashTime: lap - start, start: start, lap: lap, arrival: r.now()}
	return p, nil
}

// clockBase anchors tick.
var clockBase = time.Now()

// tick reads the monotonic clock for a decision's timings. time.Since reads
// only that clock where time.Now reads the wall clock too, and a read costs
// 50–75 ns on a virtual machine's clock; a decision reads it once per stage
// boundary, where its stages used to read it twenty times.
func tick() time.Duration { return time.Since(clockBase) }

var preparedPool = sync.Pool{New: func() any { return new(prepared) }}

// maxPooledBlocks is the longest hash buffer a pooled prepared keeps: a
// 128 K-token prompt's at 16 tokens a block, the context of the models
// served (a conversation trace sends 2 % of its prompts, 15 % of its
// tokens, above 64 K, and each was two fresh buffers). A longer one is a
// rare prompt's; pooled, it would be handed from request to request and
// never collected.
const maxPooledBlocks = 8192

func release(p *prepared) {
	p.req = nil
	// Lent hashes must not be kept, nor overwritten by a later request.
	p.local, p.seq = nil, nil
	for k := range p.own {
		if cap(p.own[k]) > maxPooledBlocks {
			p.own[k] = nil
		}
	}
	preparedPool.Put(p)
}

// match finds every rank's overlap with the request: the larger of the
// event-fed index and the approximate one, per rank; for ranks whose
// events never came, their predicted blocks. now is the router's clock,
// read by the caller; the match's timing starts at p.lap.
func (r *Router) match(p *prepared, sc *scratch, now time.Time) {
	t0 := p.lap
	p.overlaps = p.overlaps[:0]
	p.match = r.matches.Add(1)
	seq := p.seq[:p.matchable]
	if r.exact != nil {
		p.overlaps = append(p.overlaps, r.exact.FindMatches(&sc.m, seq)...)
		p.tiers = append(p.tiers[:0], sc.m.Tiers()...)
		p.sharedRoot = int(sc.m.SharedRoot())
		if f := r.fleet.Load(); len(f.sizes) > 0 {
			r.matchOtherSizes(p, sc, f)
		}
	}
	remoteOK := false
	if r.remote != nil {
		remoteOK = r.matchRemote(p)
	}
	if r.approx != nil && !remoteOK {
		p.overlaps = append(p.overlaps, r.approx.FindMatches(&sc.m, seq)...)
	}
	if r.predicted != nil {
		p.overlaps = append(p.overlaps, r.predicted.FindMatchesBeyond(&sc.m, seq, now, r.heldByEvery(p, sc))...)
	}
	if missing := r.watch.missingAt(now); len(missing) > 0 {
		for _, o := range r.watch.predicted.FindMatches(&sc.m, seq) {
			if _, ok := missing[o.Worker]; ok {
				p.overlaps = append(p.overlaps, o)
			}
		}
	}
	p.cachedBlocks = 0
	for _, o := range p.overlaps {
		p.cachedBlocks = max(p.cachedBlocks, int(o.Blocks))
	}
	p.matchedAt = now
	p.lap = tick()
	p.findTime = p.lap - t0
}

// heldByEvery is how many leading blocks of the request every rank of the
// fleet holds by overlaps (the event-fed index's). A predicted overlap no
// longer than that raises no rank's (candidates takes each rank's
// largest), so it cannot change the decision and the predicted lookup
// skips it: when every rank holds a shared system prompt, that is the part
// of the lookup that lists every rank predicted to hold the prompt, and
// candidates' listing of them again. A rank outside this fleet has no
// prediction left (RemoveWorker drops them), so a later fleet read by
// candidates misses no skipped overlap either.
func (r *Router) heldByEvery(p *prepared, sc *scratch) int {
	f := r.fleet.Load()
	if r.predictEveryDepth || len(p.overlaps) < len(f.ranks) || len(f.ranks) == 0 {
		return 0 // some rank holds nothing
	}
	sc.overlaps = slices.Grow(sc.overlaps[:0], len(f.ranks))[:len(f.ranks)]
	clear(sc.overlaps)
	for _, o := range p.overlaps {
		if i, ok := f.position(o.Worker); ok && int(o.Blocks) > sc.overlaps[i] {
			sc.overlaps[i] = int(o.Blocks)
		}
	}
	// Mapping a thousand overlaps to their ranks costs what the skip
	// saves: candidates goes on from here rather than again from the start.
	sc.mapped, sc.mappedMatch, sc.mappedFleet = len(p.overlaps), p.match, f
	return slices.Min(sc.overlaps)
}

// candidates builds the scheduler's view of every rank serving the model
// from the current fleet, the request's overlaps and the tracked loads.
// The fleet is read in place: a snapshot is never changed once published.
func (r *Router) candidates(p *prepared, sc *scratch) []sched.Candidate {
	f := r.fleet.Load()
	from := 0
	if sc.mappedMatch == p.match && sc.mappedFleet == f && len(sc.overlaps) == len(f.ranks) {
		from = sc.mapped // heldByEvery mapped those, for this match and fleet
	} else {
		sc.overlaps = slices.Grow(sc.overlaps[:0], len(f.ranks))[:len(f.ranks)]
		clear(sc.overlaps)
	}
	for _, o := range p.overlaps[from:] {
		if i, ok := f.position(o.Worker); ok && int(o.Blocks) > sc.overlaps[i] {
			sc.overlaps[i] = int(o.Blocks)
		}
	}
	// The mapping now is this match's: a scratch back in its pool may be
	// handed to this request again after serving others, and must not
	// claim another request's mapping for it.
	sc.mapped, sc.mappedMatch, sc.mappedFleet = len(p.overlaps), p.match, f
	tiered := len(p.tiers) > 0 || p.sharedRoot > 0
	if tiered {
		sc.lower = slices.Grow(sc.lower[:0], len(f.ranks))[:len(f.ranks)]
		for i := range sc.lower {
			sc.lower[i] = [3]int{0, 0, p.sharedRoot}
		}
		for _, o := range p.tiers {
			if i, ok := f.position(o.Worker); ok {
				sc.lower[i] = [3]int{int(o.Host), int(o.Disk), int(o.Device + o.Shared)}
			}
		}
	}
	q := load.Query{Now: p.matchedAt, WorkersID: f.id, Blocks: p.seq, ISL: len(p.req.Tokens), TrackPrefill: &p.params.TrackPrefillTokens, AssumeReuse: &p.params.AssumeKVReuse, TrackBlocks: p.trackBlocks()}
	sc.pots = r.tracker.PotentialLoads(q, f.ranks, sc.overlaps, sc.pots[:0])
	// Engine reports feed the peer modes' scorers and the decode busy
	// threshold; other decisions skip the lookups.
	sc.busy = r.thresholds.Get(p.req.Model)
	var engine map[kv.Worker]sched.EngineLoad
	if r.cfg.Mode.UsesEngineLoad() || sc.busy.ActiveDecodeBlocks != nil {
		if m := r.engineLoads.Load(); m != nil {
			engine = *m
		}
	}
	// Filled in place, field by field: a candidate is over a hundred bytes,
	// and a composite literal or an appended local is built on the stack
	// and copied, which cost a thousand-worker decision about 10 µs.
	sc.cands = slices.Grow(sc.cands[:0], len(sc.pots))[:len(sc.pots)]
	filter := f.mixed || p.req.Prefill || len(p.req.Exclude) > 0 || p.req.Only != nil
	k := 0
	// sched.LightestOf's minima, taken while each candidate is at hand;
	// in locals, which the stores to the candidates cannot alias.
	var fewestPrefill, fewestRequests int
	var fewestDecode float64
	for i := range sc.pots {
		info := &f.rinfo[i]
		if filter {
			if p.req.Model != "" && info.Model != "" && info.Model != p.req.Model {
				continue
			}
			if len(p.req.Exclude) > 0 && slices.Contains(p.req.Exclude, info.ID) {
				continue
			}
			if p.req.Only != nil && !slices.Contains(p.req.Only, info.ID) {
				continue
			}
			if (info.Role == RolePrefill) != p.req.Prefill {
				continue
			}
		}
		pot := &sc.pots[i]
		c := &sc.cands[k]
		k++
		*c = sched.Candidate{}
		c.Worker = pot.Worker
		c.OverlapBlocks = sc.overlaps[i]
		c.HostBlocks, c.DiskBlocks = c.OverlapBlocks, c.OverlapBlocks
		if tiered {
			// The device overlap may have come from another source (the
			// approximate index): the lower tiers only ever add to it.
			lw := &sc.lower[i]
			c.HostBlocks = max(c.OverlapBlocks, lw[0])
			c.DiskBlocks = max(c.HostBlocks, lw[1])
			c.SharedBlocks = max(0, lw[2]-c.OverlapBlocks)
		}
		c.ActiveDecodeBlocks = pot.ActiveDecodeBlocks
		c.ActivePrefillTokens = pot.ActivePrefillTokens
		c.PotentialDecodeBlocks = pot.PotentialDecodeBlocks
		c.PotentialPrefillTokens = pot.PotentialPrefillTokens
		c.TotalKVBlocks = info.TotalKVBlocks
		c.MaxNumBatchedTokens = info.MaxNumBatchedTokens
		c.ActiveRequests = pot.ActiveRequests
		c.CPU = info.CPU
		if engine != nil {
			c.Engine = engine[pot.Worker]
		}
		if k == 1 {
			fewestPrefill, fewestDecode, fewestRequests = c.ActivePrefillTokens, c.ActiveDecodeBlocks, c.ActiveRequests
		} else {
			fewestPrefill = min(fewestPrefill, c.ActivePrefillTokens)
			fewestDecode = min(fewestDecode, c.ActiveDecodeBlocks)
			fewestRequests = min(fewestRequests, c.ActiveRequests)
		}
	}
	sc.cands = sc.cands[:k]
	sc.lightest = sched.Lightest{PrefillTokens: fewestPrefill, DecodeBlocks: fewestDecode, Requests: fewestRequests}
	// A learned prefill time enters the summary; LightestOf takes it then.
	sc.lightestOK = k > 0
	if r.prefill != nil && p.params.TrackPrefillTokens && r.cfg.Mode == sched.ModeKV {
		r.learnedPrefill(sc.cands, p.matchedAt)
		sc.lightestOK = k > 0 && !sc.cands[0].Prefill.Known
	}
	return sc.cands
}

// learnedPrefill gives every candidate its learned prefill time, or none
// of them one while no worker is fitted: a decision's costs share a unit.
func (r *Router) learnedPrefill(cands []sched.Candidate, now time.Time) {
	for i := range cands {
		c := &cands[i]
		e := r.prefill.Estimate(c.Worker, now, c.OverlapBlocks*r.cfg.BlockSize, c.ActiveRequests)
		if !e.Known {
			for j := range cands[:i] {
				cands[j].Prefill = sched.PrefillTime{}
			}
			return
		}
		c.Prefill = sched.PrefillTime{Known: true, SecondsPerToken: e.SecondsPerToken, Fixed: e.Fixed, Backlog: e.Backlog}
	}
}

// PrefillFits are the learned prefill fits (nil unless
// --router-prefill-load-model learned), for /health and the dashboard.
func (r *Router) PrefillFits() []load.WorkerFit {
	if r.prefill == nil {
		return nil
	}
	return r.prefill.Fits()
}

// ParsePrefillLoadModel reads --router-prefill-load-model: whether it asks
// for the learned model.
func ParsePrefillLoadModel(s string) (learned bool, err error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "", "none":
		return false, nil
	case "learned":
		return true, nil
	case "aic":
		return false, errors.New("--router-prefill-load-model aic needs NVIDIA's AI Configurator database, which kvrouter does not ship: use learned, which fits each engine's prefill time from the requests it serves")
	}
	return false, fmt.Errorf("--router-prefill-load-model %q: want none or learned", s)
}

// decide scores the candidates and, with book, records the request's load,
// at now on the router's clock. Booking calls hold r.mu.
func (r *Router) decide(p *prepared, sc *scratch, cands []sched.Candidate, book bool, now time.Time) (Decision, error) {
	t0 := tick()
	if len(cands) == 0 {
		r.stats.errors.Add(1)
		return Decision{}, ErrNoWorkers
	}
	// The scheduler's policies are called through an interface, so a
	// request built here would escape: it lives in the scratch instead.
	sreq := &sc.sreq
	*sreq = sched.Request{
		ISL: len(p.req.Tokens), BlockSize: r.cfg.BlockSize, Params: p.params,
		Target: p.req.Target, OverrideBusy: p.req.OverrideBusy, Session: p.req.Session,
		Busy: sc.busy, Now: now,
		Tokens: p.req.Tokens, Commit: book, OSL: p.req.OSL,
	}
	if p.req.Prefill {
		sreq.Pool = sched.PoolPrefill
	}
	if sc.lightestOK && len(cands) == len(sc.cands) && &cands[0] == &sc.cands[0] {
		sreq.Lightest = &sc.lightest
	}
	choice, err := r.scheduler.Select(sreq, cands, r.rng)
	// The pooled scratch must not keep the prompt alive.
	*sreq = sched.Request{}
	if err != nil {
		if errors.Is(err, sched.ErrAllBusy) {
			r.stats.allBusy.Add(1)
		} else {
			r.stats.errors.Add(1)
		}
		return Decision{}, err
	}
	c := cands[choice.Index]
	d := Decision{
		Worker: choice.Worker, OverlapBlocks: c.OverlapBlocks, PromptBlocks: len(p.seq),
		Via: choice.Via, Warning: p.warning,
		Timings: Timings{Hash: p.hashTime, FindMatches: p.findTime},
	}
	if book {
		tb := tick()
		lr := load.Request{
			Now: now, ID: p.req.ID, Worker: choice.Worker, Blocks: p.seq, ISL: len(p.req.Tokens),
			OverlapBlocks: c.OverlapBlocks, OSL: p.req.OSL,
			TrackPrefill: &p.params.TrackPrefillTokens, AssumeReuse: &p.params.AssumeKVReuse, TrackBlocks: p.trackBlocks(),
		}
		if err := r.tracker.AddRequest(lr); err != nil {
			r.stats.errors.Add(1)
			return Decision{}, fmt.Errorf("%w: %v", ErrDuplicateID, err)
		}
		r.observeAdd(lr, p.matchable)
		if r.prefill != nil && p.params.TrackPrefillTokens {
			cached := min(c.OverlapBlocks*r.cfg.BlockSize, lr.ISL)
			r.prefill.Start(p.req.ID, choice.Worker, now, load.PrefillSample{
				Uncached: lr.ISL - cached, Cached: cached, Waiting: c.ActivePrefillTokens, Running: c.ActiveRequests,
			})
		}
		if r.recovery.active.Load() > 0 {
			r.recovery.booked(choice.Worker, p.localFor(r.fleet.Load(), choice.Worker.ID))
		}
		// What the worker is predicted to cache is what may be matched:
		// blocks past an unknown multimodal item must never be credited.
		local, seq := p.local[:p.matchable], p.seq[:p.matchable]
		r.watch.booked(p.req.ID, choice.Worker, local, seq)
		if r.approx != nil {
			r.approx.Insert(choice.Worker, local, seq)
		}
		if r.predicted != nil {
			r.predicted.Add(p.req.ID, choice.Worker, seq, now)
		}
		r.stats.booked.Add(1)
		d.Timings.Book = tick() - tb
	}
	r.stats.decisions.Add(1)
	r.stats.overlapBlocks.Add(uint64(c.OverlapBlocks))
	r.stats.promptBlocks.Add(uint64(len(p.seq)))
	end := tick()
	d.Timings.Schedule = end - t0
	d.Timings.Total = end - p.start
	r.tapDecision(p, sc, cands, &d)
	return d, nil
}

// drain dispatches queued requests while capacity allows, in the queue's
// policy order. Called after anything that frees capacity.
func (r *Router) drain() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.queues.total() == 0 {
		return
	}
	sc := r.scratch.Get().(*scratch)
	defer r.scratch.Put(sc)
	for _, k := range r.queues.keys() {
		r.drainOne(k, sc)
	}
	r.queues.prune()
}

// drainOne dispatches one queue's requests until its head must wait. The
// queues are apart because their heads wait for different workers: a
// decode must not wait behind a prefill whose engines are full of the KV
// that decode would release, nor one model behind another's engines.
func (r *Router) drainOne(k queueKey, sc *scratch) {
	for {
		it, ok := r.queues.peek(k)
		if !ok {
			return
		}
		p := it.Payload.(*prepared)
		now := r.now()
		// The remote primary is not asked with r.mu held: its answer
		// from arrival stands.
		if r.remote == nil && sched.NeedsRefresh(p.matchedAt, now, r.cfg.OverlapRefreshAfter) {
			p.lap = tick()
			r.match(p, sc, now) // caches moved on while it waited
		}
		cands := r.candidates(p, sc)
		if sched.ShouldQueue(cands, r.cfg.QueueThreshold) {
			return
		}
		r.queues.pop(k)
		w := r.waiters[it.ID]
		delete(r.waiters, it.ID)
		d, err := r.decide(p, sc, cands, true, now)
		d.Queued = now.Sub(p.arrival)
		w.notify(queuedResult{d, err})
	}
}

// MarkPrefillCompleted records the first token of a booked request: its
// prompt stops counting as prefill work.
func (r *Router) MarkPrefillCompleted(id string) bool {
	ok := r.tracker.MarkPrefillCompleted(id)
	if r.prefill != nil {
		r.prefill.Done(id, r.now())
	}
	if ok {
		r.watch.prefillDone(id)
		r.settlePrediction(id)
		r.observe(LoadUpdate{Kind: LoadPrefillDone, ID: id})
		r.drain()
	}
	return ok
}

// AddOutputTokens records n more generated tokens (output-block tracking).
func (r *Router) AddOutputTokens(id string, n int) bool { return r.tracker.AddOutputTokens(id, n) }

// Free ends a booked request; safe to call more than once.
func (r *Router) Free(id string) bool {
	ok := r.tracker.Free(id)
	if r.prefill != nil {
		r.prefill.Drop(id, r.now())
	}
	if ok {
		r.watch.freed(id)
		r.settlePrediction(id)
		r.observe(LoadUpdate{Kind: LoadFree, ID: id})
		r.drain()
	}
	return ok
}

// WorkerLoad is one rank's load as the router predicts it.
type WorkerLoad struct {
	Worker kv.Worker
	load.WorkerLoad
	PotentialDecodeBlocks  float64
	PotentialPrefillTokens int
	OverlapBlocks          int
	// HostBlocks is the overlap continued on the rank's host tier
	// (sched.Candidate.HostBlocks).
	HostBlocks int
}

// PotentialLoads returns, for every rank, its load now and as it would be
// if a request with these tokens went there.
func (r *Router) PotentialLoads(tokens []uint32, lora string) []WorkerLoad {
	return r.PotentialLoadsFor(&Request{Tokens: tokens, LoRA: lora})
}

// PotentialLoadsFor is PotentialLoads for a request's tokens and the keys
// of its blocks' identity (adapter, cache salt, multimodal items); nothing
// is booked.
func (r *Router) PotentialLoadsFor(req *Request) []WorkerLoad {
	return r.potentialLoads(&Request{Tokens: req.Tokens, LoRA: req.LoRA, CacheSalt: req.CacheSalt, MM: req.MM})
}

// potentialLoads is PotentialLoadsFor over the ranks req itself may go to
// (its pool, model and exclusions).
func (r *Router) potentialLoads(req *Request) []WorkerLoad {
	p, err := r.prepare(req)
	if err != nil {
		return nil
	}
	defer release(p)
	sc := r.scratch.Get().(*scratch)
	defer r.scratch.Put(sc)
	r.match(p, sc, p.arrival)
	cands := r.candidates(p, sc)
	out := make([]WorkerLoad, len(cands))
	for i, c := range cands {
		out[i] = WorkerLoad{
			Worker:                 c.Worker,
			WorkerLoad:             load.WorkerLoad{ActiveDecodeBlocks: c.ActiveDecodeBlocks, ActivePrefillTokens: c.ActivePrefillTokens, ActiveRequests: c.ActiveRequests},
			PotentialDecodeBlocks:  c.PotentialDecodeBlocks,
			PotentialPrefillTokens: c.PotentialPrefillTokens,
			OverlapBlocks:          c.OverlapBlocks,
			HostBlocks:             c.HostBlocks,
		}
	}
	return out
}

// SetEngineLoad records what an engine rank reported about its own load
// (its /metrics), which the modes scoring by engine-reported load read.
func (r *Router) SetEngineLoad(w kv.Worker, l sched.EngineLoad) {
	r.SetEngineLoads([]EngineReport{{Worker: w, Load: l}})
}

// EngineReport is one rank's report of its own load.
type EngineReport struct {
	Worker kv.Worker
	Load   sched.EngineLoad
}

// SetEngineLoads records several ranks' reports as SetEngineLoad would,
// one after another. Decisions read the reports without a lock, so every
// change copies the table: a fleet's reports taken together cost one copy
// instead of one per rank, and reports that change nothing cost none.
func (r *Router) SetEngineLoads(reports []EngineReport) {
	r.engineLoadMu.Lock()
	defer r.engineLoadMu.Unlock()
	var old map[kv.Worker]sched.EngineLoad
	if p := r.engineLoads.Load(); p != nil {
		old = *p
	}
	var next map[kv.Worker]sched.EngineLoad
	for _, rep := range reports {
		l := rep.Load
		l.Known = true
		if next == nil {
			if prev, ok := old[rep.Worker]; ok && prev == l {
				continue
			}
			if next = maps.Clone(old); next == nil {
				next = make(map[kv.Worker]sched.EngineLoad, len(reports))
			}
		}
		next[rep.Worker] = l
	}
	if next != nil {
		p := new(map[kv.Worker]sched.EngineLoad)
		*p = next
		r.engineLoads.Store(p)
	}
}

// Loads returns every rank's current load.
func (r *Router) Loads() []WorkerLoad {
	f := r.fleet.Load()
	out := make([]WorkerLoad, len(f.ranks))
	for i, w := range f.ranks {
		out[i] = WorkerLoad{Worker: w, WorkerLoad: r.tracker.Load(w)}
	}
	return out
}

// DumpEvents returns events that rebuild the event-fed index (see
// index.Index.Dump); nil in approximate mode and with OneGoroutine.
func (r *Router) DumpEvents() []kv.Event {
	ix, ok := r.exact.(*index.Index)
	if !ok {
		return nil
	}
	return ix.Dump()
}

// EngineCapacity takes the KV capacity an engine rank reports (vLLM's
// num_gpu_blocks) for a worker registered without one: it sizes and
// bounds the rank's index (index.RankBound). A capacity given at
// registration wins.
func (r *Router) EngineCapacity(w kv.Worker, blocks int) {
	if r.exact == nil {
		return
	}
	if info, ok := r.fleet.Load().infos[w.ID]; !ok || info.TotalKVBlocks > 0 || int(w.DPRank) >= info.DPSize {
		return
	}
	r.exact.Reserve(w, blocks)
}

// OverBound lists the worker ranks whose KV events claimed more blocks
// than their announced capacity allows (index.RankBound); nil in
// approximate mode.
func (r *Router) OverBound() []index.OverBound {
	if r.exact == nil {
		return nil
	}
	return r.exact.OverBound()
}

// DumpEventsTo streams what DumpEvents returns through d in bounded
// batches (see index.Index.DumpTo); nothing in approximate mode, and
// ErrNoDump with OneGoroutine.
func (r *Router) DumpEventsTo(d *index.Dumper, visit func([]kv.Event) error) error {
	if r.exact == nil {
		return nil
	}
	ix, ok := r.exact.(*index.Index)
	if !ok {
		return ErrNoDump
	}
	return ix.DumpTo(d, visit)
}

// HeldBlocks returns the sequence hashes of the blocks the event-fed index
// says worker rank w holds, in no particular order; nil in approximate
// mode.
func (r *Router) HeldBlocks(w kv.Worker) []uint64 {
	if r.exact == nil {
		return nil
	}
	return r.exact.Held(w)
}

// HeldBlocksOn is HeldBlocks on one storage tier; nil in approximate mode
// and for a tier the index does not know.
func (r *Router) HeldBlocksOn(w kv.Worker, tier kv.StorageTier) []uint64 {
	if r.exact == nil {
		return nil
	}
	out, _ := r.exact.HeldOn(w, tier)
	return out
}

// Stats is a snapshot of the router's counters.
type Stats struct {
	Decisions, Booked, Queued, AllBusy, Errors uint64
	// OverlapBlocks / PromptBlocks is the KV hit rate of routed requests.
	OverlapBlocks, PromptBlocks uint64
	QueuePending                int
	QueuePendingTokens          int
	// Events refused before reaching the index, and stored blocks dropped
	// for lack of their tokens.
	UnknownWorkerEvents, DPRankEvents, IgnoredEvents, MisSizedBlocks uint64
	// UnplacedOffloadedBlocks are lower-tier blocks published by id alone
	// that the router never saw on the engine's device (see offloaded.go).
	UnplacedOffloadedBlocks uint64
	Index                   index.Stats
	IndexedPairs            uint64
	Approx                  index.ApproxStats
	Load                    load.Stats
}

type counters struct {
	decisions, booked, queued, allBusy, errors atomic.Uint64
	overlapBlocks, promptBlocks                atomic.Uint64
	unknownWorker, badRank, ignoredEvents      atomic.Uint64
	misSized, unplaced                         atomic.Uint64
}

// Stats returns the current counters.
func (r *Router) Stats() Stats {
	st := Stats{
		Decisions: r.stats.decisions.Load(), Booked: r.stats.booked.Load(), Queued: r.stats.queued.Load(),
		AllBusy: r.stats.allBusy.Load(), Errors: r.stats.errors.Load(),
		OverlapBlocks: r.stats.overlapBlocks.Load(), PromptBlocks: r.stats.promptBlocks.Load(),
		UnknownWorkerEvents: r.stats.unknownWorker.Load(), DPRankEvents: r.stats.badRank.Load(), IgnoredEvents: r.stats.ignoredEvents.Load(),
		MisSizedBlocks: r.stats.misSized.Load(), UnplacedOffloadedBlocks: r.stats.unplaced.Load(),
		Load: r.tracker.Stats(),
	}
	r.mu.Lock()
	st.QueuePending, st.QueuePendingTokens = r.queues.total(), r.queues.pendingTokens()
	r.mu.Unlock()
	if r.exact != nil {
		st.Index = r.exact.Stats()
		st.IndexedPairs = r.exact.Pairs()
	}
	// Approximate mode and predict-on-route never run together: the
	// figures are those of whichever index predicts.
	if r.approx != nil {
		st.Approx = r.approx.Stats()
	} else if r.predicted != nil {
		st.Approx = r.predicted.Stats()
	}
	return st
}
