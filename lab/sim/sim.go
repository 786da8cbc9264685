// Package sim replays a workload through kvrouter's real router
// (core/router) and the mocker's real engine core (mocker/engine) in
// virtual time: one discrete-event loop on one goroutine, no sockets, no
// goroutine per request, no clock. It is what `kvrouter sim` runs, and it
// answers in seconds what `kvrouter bench replay` answers in an hour of
// wall time, with the same engines and the same router configuration per
// mode (replay.ModeConfig).
//
// What reaches the router, and when, follows the live system (kvrouter
// serve in front of mocker engines, as bench replay runs them):
//   - a request is routed when it arrives (its workload time divided by
//     the arrival speedup) and reaches its engine at once, or, when the
//     router's admission queue holds it, when a later first token or
//     stream end dispatches it (router.Submit);
//   - an engine steps back to back while it has work, as the mocker's
//     runner does: a step's outputs and KV events exist at the end of the
//     step's model duration;
//   - the first token is the prefill's completion (MarkPrefillCompleted),
//     the last token the stream's end (Free), both at once: over loopback
//     HTTP they take microseconds;
//   - KV events reach the router KVEventDelay after their step ends (the
//     ZMQ hop, the subscriber's decoding and batching);
//   - the modes that score by engine-reported load read every engine's
//     metrics every EngineMetricsInterval, as serve's poller does.
//
// The loop is deterministic: the same workload, Config and mode give the
// same Point, whatever the machine.
package sim

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/adapters/enginesource"
	"github.com/kvrouter/kvrouter/core/index"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/core/sched"
	"github.com/kvrouter/kvrouter/lab/replay"
	"github.com/kvrouter/kvrouter/lab/trace"
	"github.com/kvrouter/kvrouter/lab/workload"
	"github.com/kvrouter/kvrouter/mocker/engine"
	"github.com/kvrouter/kvrouter/mocker/fleet"
)

// DefaultKVEventDelay is how long after an engine's step its KV events
// reach the router by default. Measured on one host, a vLLM batch crosses
// ZMQ and the router's decoding in well under a millisecond; across hosts
// and under load, vLLM publishes from a background thread and the router
// applies events in batches, which puts the usual lag at a few
// milliseconds. 5 ms is that lag, about a quarter of a decode step: a
// request arriving right after its prefix was stored may miss it, as it
// would live.
const DefaultKVEventDelay = 5 * time.Millisecond

// Config is one simulated fleet behind one router.
type Config struct {
	Workers int
	// DPSize is each engine's data-parallel ranks (the mocker's
	// --data-parallel-size): the router routes to ranks, each rank is an
	// engine core of its own; 0 means 1.
	DPSize int
	// Engine is every engine's configuration; each rank's seed is derived
	// from Engine.Seed as the mocker's fleet derives it.
	Engine engine.Config
	// Router is the configuration every mode starts from
	// (replay.ModeConfig sets the mode's part).
	Router router.Config
	// NoOSLHints routes without the requests' output lengths (the engines
	// still generate them), as a router that is not told them.
	NoOSLHints bool
	Seed       uint64 // the router's tie-breaks and sampling
	// KVEventDelay is the model time from a step's end to its KV events'
	// arrival at the router.
	KVEventDelay time.Duration
	// EngineMetricsInterval is the model-time period at which the modes
	// scoring by engine-reported load read the engines' metrics.
	EngineMetricsInterval time.Duration
	// Disagg splits the fleet into prefill and decode engines; with both
	// of its pools empty the fleet is Workers aggregated engines.
	Disagg Disagg
	// IgnoreCacheSalt hides requests' cache salts from the router, and
	// the salts in the engines' KV events: a router that keys blocks by
	// their tokens alone. The engines still cache each salt apart.
	IgnoreCacheSalt bool
	// IgnoreLowerTiers drops the engines' host-tier events before they
	// reach the router: a router that indexes device blocks only, as
	// kvrouter did before storage tiers. The engines still load their host
	// hits.
	IgnoreLowerTiers bool
	// Specs sizes engine i (every rank of it) by Specs[i]: its speed and
	// KV blocks relative to Engine (--fleet). Engines past its end are
	// Engine.
	Specs []fleet.EngineSpec
	// Replicas routes with several router replicas and measures their
	// decisions against a single router's (--router-replicas).
	Replicas Replicas
	// SpeculativePrefill models agents that set
	// agent_hints.speculative_prefill: when a session's turn ends, the
	// router prefills the next turn's prefix (the turn's prompt and its
	// answer) on the same engine with one output token, booked as any
	// request, while the tool runs (aggregated fleets).
	SpeculativePrefill bool
	// listsBlocks keeps the engines' copies of their blocks' tokens, for
	// a test that lists the engines' cached blocks (Engine.CachedBlocks);
	// the loop itself never does.
	listsBlocks bool
	// prompts is how the loop disposes of a finished trace prompt, for
	// tests (reused by default).
	prompts promptDisposal
	// skipped is what the blocks of a trace prompt that nothing reads
	// hold (see promptPool.lazy), for tests.
	skipped skippedTokens
	// noBlockIDs has the engines and the routers hash every prompt block
	// themselves, for tests (see blockHashes).
	noBlockIDs bool
	// ownBlockIDs has the engines name their blocks by ids of their own
	// rather than by sequence hashes, for tests that check that the
	// results do not depend on the names.
	ownBlockIDs bool
	// copyHashes has every turn copy its previous turn's block hashes,
	// for benchmarks (see blockHashes.movable).
	copyHashes bool
}

// engineConfig is engine i's configuration.
func (c *Config) engineConfig(i int) engine.Config {
	if i < len(c.Specs) {
		return c.Specs[i].Apply(c.Engine)
	}
	return c.Engine
}

// oneGoroutineIndex reports whether the routers of a run on workers
// engines may keep the one-goroutine index (router.Config.OneGoroutine):
// the run's loop applies every event and routes every request, and the
// index holds few enough ranks, device blocks only (or only those are
// indexed), and never comes near budget pairs, so that it answers as the
// sharded index would (the same results, for less work per block).
func (c *Config) oneGoroutineIndex(workers int, budget uint64) bool {
	dp := max(c.DPSize, 1)
	if workers*dp > index.MaxSingleRanks {
		return false
	}
	var most uint64
	for i := range workers {
		e := c.engineConfig(i)
		if e.NumCPUBlocks > 0 && !c.IgnoreLowerTiers {
			return false
		}
		most += uint64(index.RankBound(e.NumGPUBlocks)) * uint64(dp)
	}
	return budget == 0 || most <= budget
}

// fleetSize is what the bounds need of a fleet of workers engines: its
// speed in configured engines (an engine at half speed counts half), the
// most GPU blocks of any rank, and the blocks of every rank together.
func (c *Config) fleetSize(workers int) (speed float64, maxBlocks, totalBlocks int) {
	dp := max(c.DPSize, 1)
	for i := range workers {
		e := c.engineConfig(i)
		if e.Speed == 0 {
			e.Speed = 1
		}
		speed += e.Speed * float64(dp)
		maxBlocks = max(maxBlocks, e.NumGPUBlocks)
		totalBlocks += e.NumGPUBlocks * dp
	}
	return speed, maxBlocks, totalBlocks
}

// DefaultConfig is bench replay's fleet: 8 engines with replay's KV
// capacity, Dynamo's router defaults.
func DefaultConfig() Config {
	rc := replay.DefaultConfig()
	return Config{
		Workers: rc.Workers, Engine: rc.Fleet.Engine, Router: rc.Router, Seed: rc.Seed,
		KVEventDelay: DefaultKVEventDelay, EngineMetricsInterval: rc.EngineMetricsInterval,
		Disagg: Disagg{KVBytesPerToken: DefaultKVBytesPerToken, KVTransferBandwidth: DefaultKVTransferBandwidth},
	}
}

// Workload is the requests of a run, indexed in arrival order (At never
// decreases). Request may build the prompt on every call: the loop asks
// for it once, when the request arrives, and keeps it only while the
// request waits in the router's queue.
type Workload interface {
	Len() int
	At(i int) time.Duration
	Request(i int) workload.Request
}

// Requests is a materialised workload; FromRequests orders it.
type Requests []workload.Request

func (r Requests) Len() int                       { return len(r) }
func (r Requests) At(i int) time.Duration         { return r[i].At }
func (r Requests) Request(i int) workload.Request { return r[i] }

// FromRequests orders reqs by arrival (stably, as bench replay sends them).
func FromRequests(reqs []workload.Request) Requests {
	out := slices.Clone(reqs)
	slices.SortStableFunc(out, func(a, b workload.Request) int { return cmp.Compare(a.At, b.At) })
	return out
}

// Trace is a Mooncake trace whose prompts are built when they are sent:
// the conversation trace's 12,031 prompts would take 580 MB at once.
type Trace struct {
	reqs []trace.Request
	// dense[i] are request i's hash ids numbered densely from 0, and
	// numIDs how many distinct ids the trace holds.
	dense  [][]uint32
	numIDs int
	// at, when set, replaces the trace's own arrival times (SpreadBatches).
	at []time.Duration
	// ext holds the trace's extensions, found once for all the runs of a
	// sweep: finding them takes a table as long as the trace's ids, whose
	// fresh pages cost each run more than the search.
	ext struct {
		once        sync.Once
		prev, share []int32
	}
}

// FromTrace keeps the first max requests of tr (all with max <= 0). It
// fails on a trace whose timestamps go back.
func FromTrace(tr *trace.Trace, max int) (*Trace, error) {
	reqs := tr.Requests
	if max > 0 && max < len(reqs) {
		reqs = reqs[:max]
	}
	for i := 1; i < len(reqs); i++ {
		if reqs[i].Timestamp < reqs[i-1].Timestamp {
			return nil, fmt.Errorf("sim: trace line %d goes back in time (%d ms after %d ms)", i+1, reqs[i].Timestamp, reqs[i-1].Timestamp)
		}
	}
	t := &Trace{reqs: reqs, dense: make([][]uint32, len(reqs)), numIDs: len(tr.IDs)}
	parsed := true
	for i := range reqs {
		t.dense[i] = reqs[i].DenseIDs()
		parsed = parsed && len(t.dense[i]) == len(reqs[i].HashIDs)
	}
	if !parsed {
		// A trace built in memory: number its ids here.
		byID := map[uint64]uint32{}
		for i := range reqs {
			d := make([]uint32, len(reqs[i].HashIDs))
			for k, id := range reqs[i].HashIDs {
				n, ok := byID[id]
				if !ok {
					n = uint32(len(byID))
					byID[id] = n
				}
				d[k] = n
			}
			t.dense[i] = d
		}
		t.numIDs = len(byID)
	}
	return t, nil
}

func (t *Trace) Len() int { return len(t.reqs) }
func (t *Trace) At(i int) time.Duration {
	if t.at != nil {
		return t.at[i]
	}
	return time.Duration(t.reqs[i].Timestamp) * time.Millisecond
}

// SpreadBatches spaces the requests that share one timestamp evenly over
// the time until the next timestamp, in trace order. Traces that log
// arrivals in batches (the conversation trace stamps 2 to 28 requests
// with one millisecond, every 3 s) otherwise replay each batch at one
// instant, a burst no client sent. The last batch keeps the mean gap
// between the trace's timestamps.
func (t *Trace) SpreadBatches() {
	n := len(t.reqs)
	if n == 0 {
		return
	}
	ms := func(i int) time.Duration { return time.Duration(t.reqs[i].Timestamp) * time.Millisecond }
	distinct := 1
	for i := 1; i < n; i++ {
		if t.reqs[i].Timestamp != t.reqs[i-1].Timestamp {
			distinct++
		}
	}
	meanGap := time.Duration(0)
	if distinct > 1 {
		meanGap = (ms(n-1) - ms(0)) / time.Duration(distinct-1)
	}
	t.at = make([]time.Duration, n)
	for start := 0; start < n; {
		end := start + 1
		for end < n && t.reqs[end].Timestamp == t.reqs[start].Timestamp {
			end++
		}
		gap := meanGap
		if end < n {
			gap = ms(end) - ms(start)
		}
		k := time.Duration(end - start)
		for i := start; i < end; i++ {
			t.at[i] = ms(start) + gap*time.Duration(i-start)/k
		}
		start = end
	}
}

func (t *Trace) Request(i int) workload.Request { return workload.FromTraceRequest(&t.reqs[i]) }

// Span is the workload's arrival span, first to last, in its own time.
func Span(w Workload) time.Duration {
	if w.Len() == 0 {
		return 0
	}
	return w.At(w.Len()-1) - w.At(0)
}

// Ceiling is the workload's infinite-cache hit rate (replay.CeilingHitRate).
func Ceiling(w Workload, blockSize int) float64 {
	return ceilingOf(w, blockSize).Rate()
}

func ceilingOf(w Workload, blockSize int) *replay.Ceiling {
	return measure(w, blockSize, 0, false).infinite
}

// workloadBounds is what a sweep's bounds and ceilings need of a workload.
type workloadBounds struct {
	// infinite is the infinite-cache ceiling; pooled, for a fleet of
	// fleetBlocks > 0 blocks, the hit rate of one LRU cache that large
	// (replay.NewPooledCeiling).
	infinite, pooled *replay.Ceiling
	decode           decodeStats
	// kv is every request's part of the KV bound (kvbound.go), nil
	// unless asked for.
	kv *kvRequests
}

// measure takes every prompt once, in arrival order, hashed once under its
// cache salt, for the ceilings and the engine bound's decode steps, and
// with perRequest the KV bound's requests.
func measure(w Workload, blockSize, fleetBlocks int, perRequest bool) workloadBounds {
	b := workloadBounds{infinite: replay.NewCeiling(blockSize)}
	hint := blocksHint(w, blockSize)
	if fleetBlocks > 0 {
		b.pooled = replay.NewPooledCeiling(blockSize, fleetBlocks)
		b.pooled.Reserve(hint)
	}
	own := newOwnership(w, blockSize, hint)
	var priv *privacy
	if perRequest {
		priv = newPrivacy(w.Len(), blockSize, hint)
	}
	// Each block is looked up once, by hash, for its number; the four
	// consumers keep their records in slices indexed by it.
	eachPromptBlocks(w, blockSize, hint, func(i int, r *workload.Request, seq []uint64, ids []int32) {
		b.infinite.AddBlocks(ids, len(r.Tokens))
		if b.pooled != nil {
			b.pooled.AddBlocks(ids, len(r.Tokens))
		}
		own.add(i, r, seq, ids)
		if priv != nil {
			priv.add(i, r, seq, ids)
		}
	})
	b.decode = own.result()
	if priv != nil {
		hits, total := b.infinite.Tokens()
		kv := priv.result(blockSize, int64(total-hits))
		b.kv = &kv
	}
	return b
}

// PrefillBoundRPS bounds the arrival rate any routing policy can sustain
// on w: with every prompt token that one infinite cache would miss
// prefilled once, at the engines' cheapest cost per token (the step size
// that amortises the step's fixed cost best, within the batch budget),
// spread perfectly over the fleet and nothing else to do, the engines
// are saturated at this rate. Real fleets decode too, have finite caches
// and imperfect balance, so every policy's goodput lies below it. 0 when
// there is nothing to bound (no prompt token to compute).
//
// speed is the fleet's engines counted by their speed (an engine at half
// speed counts half): the fleet does speed engines' work per second.
func PrefillBoundRPS(c *replay.Ceiling, requests int, speed float64, maxBatched int) float64 {
	hits, total := c.Tokens()
	miss := float64(total - hits)
	if miss <= 0 || !(speed > 0) {
		return 0
	}
	busy := time.Duration(miss * cheapestPrefillPerToken(maxBatched) / speed) // each engine's share
	return float64(requests) / busy.Seconds()
}

// Point is what one run at one arrival speedup measured; latencies are in
// model milliseconds.
type Point struct {
	ArrivalSpeedup float64 `json:"arrival_speedup"`
	// ArrivalRPS is the offered load: requests per second of model time.
	ArrivalRPS float64     `json:"arrival_rps"`
	Requests   int         `json:"requests"`
	Errors     int         `json:"errors"`
	TTFT       replay.Dist `json:"ttft_ms"`
	// NextTurnTTFT is the TTFT of the session turns that follow another
	// (closed-loop sessions only): the turns a speculative prefill serves.
	NextTurnTTFT *replay.Dist `json:"next_turn_ttft_ms,omitempty"`
	// SpeculativePrefills counts the prefills Config.SpeculativePrefill
	// sent.
	SpeculativePrefills int         `json:"speculative_prefills,omitempty"`
	ITL                 replay.Dist `json:"itl_ms"`
	E2E                 replay.Dist `json:"e2e_ms"`
	// HitRate is cached prompt tokens / prompt tokens, as the engines
	// counted them (replay's prefix_hit_rate).
	HitRate float64 `json:"hit_rate"`
	// CreditedBlocks sums the router's overlap with the engine it chose,
	// at the decision; PhantomBlocks the part of it the engine did not
	// reuse when it scheduled the request: blocks credited that were not
	// there for this request (another tenant's salt, an eviction in
	// between). Aggregated fleets only.
	CreditedBlocks int64  `json:"credited_blocks"`
	PhantomBlocks  int64  `json:"phantom_blocks"`
	FirstError     string `json:"first_error,omitempty"`
	Queued         uint64 `json:"queued"` // requests the router's admission queue held
	Preemptions    uint64 `json:"preemptions"`
	// Steady is the window a run of closed-loop sessions is measured in;
	// nil for open-loop arrivals and for sessions that all start at once,
	// measured whole. ArrivalRPS, the
	// latencies and HitRate then count the requests that arrived in it.
	Steady *SteadyWindow `json:"steady_window,omitempty"`
	// ModelS is the model time from the first arrival to the last token.
	ModelS   float64 `json:"model_s"`
	MeetsSLO bool    `json:"meets_slo"`
	// Disagg is where prompts were prefilled and what crossed the network,
	// on a disaggregated fleet only. There, HitRate counts the prefill
	// engine's cache for a request prefilled remotely: the work its cache
	// saved; the decode engine counts pulled blocks as cached.
	Disagg *DisaggStats `json:"disagg,omitempty"`
	// Engines says what the engines spent their time on: where a fleet's
	// capacity went when a mode saturates it.
	Engines EngineStats `json:"engines"`
	// Replicas compares the router replicas' decisions with a single
	// router's, when several routed (Config.Replicas).
	Replicas *ReplicaStats `json:"replicas,omitempty"`
}

// SteadyWindow is the part of a closed-loop run measured: from a quarter
// of the way through the sessions' starts to the last start.
//
// Closed-loop sessions start at the workload's pace but each keeps a
// request open, so the load builds up while sessions accumulate and drains
// after the last one started. A run measured whole mixes the quiet build
// up and drain with a peak that lasts only as long as the starts do, and
// when the sessions start over a shorter time than one lasts, the peak is a
// burst no fleet sustains: its rate and percentiles then describe the
// burst, not what the fleet can carry. Between the build-up and the last
// start, sessions start and end at the same pace, and the window measures
// that steady state (SteadyWarmup is its build-up).
type SteadyWindow struct {
	FromS    float64 `json:"from_s"` // model seconds after the first arrival
	ToS      float64 `json:"to_s"`
	Requests int     `json:"requests"` // requests that arrived in it and finished
}

// SteadyWarmup is the part of the sessions' starts a closed-loop run is
// not measured in: a quarter, a session's life or more at the loads where
// the agentic workload's knees lie when it has 100,000 requests (about 90
// s of a 400 s start span at 240 req/s).
const SteadyWarmup = 0.25

// EngineStats sums every engine's scheduler steps over a run.
type EngineStats struct {
	Steps int64 `json:"steps"`
	// Busy is the engines' stepping time over the run's model time, per
	// engine: 1 is a fleet that never idled.
	Busy float64 `json:"busy"`
	// KVUsageMean weighs each step's KV usage (blocks held by requests
	// over the engine's blocks) by its duration; KVUsageMax is the highest.
	KVUsageMean float64 `json:"kv_usage_mean"`
	KVUsageMax  float64 `json:"kv_usage_max"`
	// DecodeSeqsPerStep and PrefillTokensPerStep are per step that ran.
	DecodeSeqsPerStep    float64 `json:"decode_seqs_per_step"`
	PrefillTokensPerStep float64 `json:"prefill_tokens_per_step"`
	// PrefillShare is the part of the stepping time the step-time model
	// charges to prefill (the rest is decode).
	PrefillShare float64 `json:"prefill_share"`
}

// engineTally accumulates EngineStats as steps run.
type engineTally struct {
	steps, decodeSeqs, prefillTokens int64
	busy, prefill                    time.Duration
	kvWeighted, kvMax                float64
}

func (t *engineTally) add(r *engine.StepResult) {
	if r.Duration <= 0 || r.LoadWait {
		return // a wait for host loads is not a step the GPU ran
	}
	t.steps++
	t.busy += r.Duration
	t.prefill += engine.PrefillTime(r.PrefillTokens)
	t.decodeSeqs += int64(r.DecodeSeqs)
	t.prefillTokens += int64(r.PrefillTokens)
	t.kvWeighted += r.KVUsage * float64(r.Duration)
	t.kvMax = max(t.kvMax, r.KVUsage)
}

func (t *engineTally) stats(engines int, span time.Duration) EngineStats {
	if t.steps == 0 {
		return EngineStats{}
	}
	st := EngineStats{
		Steps: t.steps, KVUsageMax: t.kvMax,
		KVUsageMean:          t.kvWeighted / float64(t.busy),
		DecodeSeqsPerStep:    float64(t.decodeSeqs) / float64(t.steps),
		PrefillTokensPerStep: float64(t.prefillTokens) / float64(t.steps),
		PrefillShare:         float64(t.prefill) / float64(t.busy),
	}
	if span > 0 && engines > 0 {
		st.Busy = float64(t.busy) / float64(span) / float64(engines)
	}
	return st
}

// Run simulates w in mode at arrivalSpeedup.
func Run(cfg Config, mode string, w Workload, arrivalSpeedup float64) (Point, error) {
	s, err := newSim(cfg, mode, w, arrivalSpeedup)
	if err != nil {
		return Point{}, err
	}
	if err := s.run(); err != nil {
		return Point{}, err
	}
	p := s.point()
	// The next run's engines, of a sweep's, take their tables.
	for i := range s.engines {
		s.engines[i].eng.Free()
	}
	return p, nil
}

// Event kinds. Events due at the same instant run in the order they were
// scheduled.
const (
	evArrival uint8 = iota
	evStepStart
	evStepDone
	evKV
	evPoll
	evTransfer       // a disaggregated request's KV has reached its decode engine
	evPrefillTimeout // a disaggregated request's prefill is due
	evSync           // a replica-sync message reaches the other replicas
)

type event struct {
	at   int64  // model ns
	seq  uint64 // FIFO among events due at the same instant
	kind uint8
	n    int32 // request (arrival) or engine
}

// eventQueue holds the events due. Up to nearMax of the earliest pushed
// lately are in near[lo:hi], sorted earliest first, the rest in a heap:
// on a trace's fleet of 8 engines it holds 5 to 9 events in nine steps of
// ten (a step end per busy engine, the next arrival, KV deliveries), and
// an engine's next step end, mostly the latest, goes in at the end of
// near for a compare or two, where a heap's sifts mispredicted a branch
// at every level. Closed-loop sessions' arrivals, waiting out think
// times, can be thousands.
type eventQueue struct {
	near   [2 * nearMax]event
	lo, hi int
	far    eventHeap
}

const nearMax = 16

func (a *event) before(b *event) bool {
	return a.at < b.at || a.at == b.at && a.seq < b.seq
}

func (q *eventQueue) push(e event) {
	if q.hi-q.lo == nearMax {
		if q.near[q.hi-1].before(&e) {
			q.far.push(e)
			return
		}
		q.hi--
		q.far.push(q.near[q.hi])
	}
	if q.hi == len(q.near) {
		q.hi = copy(q.near[:], q.near[q.lo:q.hi])
		q.lo = 0
	}
	i := q.hi
	q.hi++
	for i > q.lo && e.before(&q.near[i-1]) {
		q.near[i] = q.near[i-1]
		i--
	}
	q.near[i] = e
}

// next takes the earliest event out, and false when none is left.
func (q *eventQueue) next() (event, bool) {
	if len(q.far) > 0 && (q.lo == q.hi || q.far[0].before(&q.near[q.lo])) {
		return q.far.pop(), true
	}
	if q.lo == q.hi {
		return event{}, false
	}
	e := q.near[q.lo]
	q.lo++
	if q.lo == q.hi {
		q.lo, q.hi = 0, 0
	}
	return e, true
}

// eventHeap is a binary min-heap by (at, seq), by hand: container/heap's
// interface calls box every event.
type eventHeap []event

func (q *eventHeap) push(e event) {
	*q = append(*q, e)
	h := *q
	i := len(h) - 1
	for i > 0 {
		p := (i - 1) / 2
		if !e.before(&h[p]) {
			break
		}
		h[i] = h[p]
		i = p
	}
	h[i] = e
}

func (q *eventHeap) pop() event {
	h := *q
	top := h[0]
	last := len(h) - 1
	e := h[last]
	h = h[:last]
	i := 0
	for {
		c := 2*i + 1
		if c >= len(h) {
			break
		}
		if r := c + 1; r < len(h) && h[r].before(&h[c]) {
			c = r
		}
		if !h[c].before(&e) {
			break
		}
		h[i] = h[c]
		i = c
	}
	if last > 0 {
		h[i] = e
	}
	*q = h
	return top
}

type simEngine struct {
	eng     *engine.Engine
	w       kv.Worker
	prefill bool                  // a prefill engine of a disaggregated fleet
	stepped bool                  // a step is scheduled or under way
	res     engine.StepResult     // the step under way, delivered at its end
	batches [][]engine.BlockEvent // KV events on their way to the router, oldest first
	// retired[k] are the requests that ended in the step of batches[k]:
	// its events and older ones may point into their prompts and block
	// hashes.
	retired [][]int32
	zero    int // consecutive steps that took no time
	groups  enginesource.GroupFilter
	salts   *router.SaltChains // the engine's salted blocks, as an event source keeps them
	seed    uint64             // the engine's Config.Seed
}

// reqState is one request's life, in model ns.
type reqState struct {
	arrival, first, last, done int64
	prompt, cached             int32
	// credited is the router's overlap, in blocks, when it chose the
	// engine (aggregated fleets).
	credited         int32
	finished, failed bool
	worker           kv.Worker // the rank that served it
}

// gapRun is n inter-token gaps of the same length.
type gapRun struct {
	ns int64
	n  int
}

// gapQuantum is the resolution of inter-token gaps: counting them by the
// microsecond keeps one counter per distinct gap (tens of thousands over a
// trace) instead of one sample per token (millions), and reports in ms
// never show the difference.
const gapQuantum = int64(time.Microsecond)

// gapCounts counts gaps by their length in gapQuantum: an array for the
// lengths up to gapDense, where nearly every step's gap falls, and a map for
// longer ones. A map update per step cost as much as the step's timing.
type gapCounts struct {
	dense []int
	long  map[int64]int
}

const gapDense = 1 << 17 // 131 ms

func (g *gapCounts) add(q int64, n int) {
	if q >= 0 && q < gapDense {
		if g.dense == nil {
			g.dense = make([]int, gapDense)
		}
		g.dense[q] += n
		return
	}
	if g.long == nil {
		g.long = map[int64]int{}
	}
	g.long[q] += n
}

// runs returns the counts as runs, in no particular order.
func (g *gapCounts) runs() []gapRun {
	runs := make([]gapRun, 0, len(g.long))
	for q, n := range g.dense {
		if n > 0 {
			runs = append(runs, gapRun{ns: int64(q) * gapQuantum, n: n})
		}
	}
	for q, n := range g.long {
		runs = append(runs, gapRun{ns: q * gapQuantum, n: n})
	}
	return runs
}

type sim struct {
	cfg   Config
	w     Workload
	scale float64
	base  time.Time
	now   int64
	seq   uint64
	q     eventQueue

	r *router.Router
	// routers are the router replicas, r first; rep their sync and the
	// shadow they are compared with, nil for one router alone.
	routers []*router.Router
	rep     *replicaState
	dp      int
	engines []simEngine // rank r of engine id is engines[(id-1)*dp + r]
	reqs    []reqState
	// held are the requests the loop keeps: those in the router's queue
	// (without their prompt in a lazy run: promptPool.park) and
	// disaggregated requests until their decode engine has them.
	held map[int]workload.Request
	// pd is each request's disaggregated life; nil on an aggregated fleet.
	pd []pdState
	// decodeOverrides route a decode after a remote prefill.
	decodeOverrides sched.Overrides
	// dispatched collects the queue's decisions while the router's lock
	// is held; the loop acts on them after the call that made them.
	dispatched []dispatch
	queuedBy   [3]int // bookings the router's queue held, by dispatch kind
	pollLoad   bool
	loads      []router.EngineReport // poll's batch, reused
	// ownsPrompts: the workload builds each prompt for its request alone
	// (a Trace) and the loop drops it once sent, so the engine may keep it.
	ownsPrompts bool
	prompts     promptPool
	ids         blockHashes
	remaining   int // requests not finished or failed
	// recycleEvents hands each batch of KV events back to its engine once
	// applied (engine.Recycle): nothing else reads them, but replicas and
	// disaggregated fleets are left as they were.
	recycleEvents bool
	// after[i] is the request that waits for i to end (closed-loop
	// sessions), -1 for none; waits[i] says i waits for another. Both nil
	// when no request waits.
	after []int32
	waits []bool

	// measureFrom and measureTo bound the arrivals a run is measured by
	// (SteadyWindow) when windowed; every arrival otherwise: open-loop
	// workloads, and sessions that all start at once.
	measureFrom, measureTo int64
	windowed               bool

	// kev is the Removed or Cleared event applyKV hands the routers, one
	// for every call: the routers apply it before they return, and a
	// fresh one escaped to the heap each time.
	kev kv.Event
	// spare is a router request for submit to fill: the router keeps a
	// request only while its queue holds it, and a fresh one per
	// request was an allocation of a few hundred bytes.
	spare *router.Request

	gaps gapCounts // inter-token gaps, in gapQuantum
	// pendingN gaps of pendingQ are not yet in gaps: a step's decodes
	// mostly share one gap, and a map update per token cost more than the
	// rest of the loop's bookkeeping.
	pendingQ int64
	pendingN int
	errors   int
	firstErr error
	tally    engineTally
	// specHeld are the speculative prefills the router's queue holds, by
	// the request whose end sent them; specSent counts those started.
	specHeld map[int][]uint32
	specSent int
	// specPrompt and specMissed count the speculative prefills' prompt
	// tokens, and those the engines did not find cached.
	specPrompt map[string]int
	specMissed int64
}

type dispatch struct {
	id   int
	kind uint8 // which booking: dispAggregated, dispPrefill or dispDecode
	d    router.Decision
	err  error
}

// What a dispatched booking was for.
const (
	dispAggregated  uint8 = iota // prefill and decode on one engine
	dispPrefill                  // a disaggregated request's prefill
	dispDecode                   // its decode, after the prefill
	dispSpeculative              // a speculative prefill after request id ended
)

// specPrefix starts the ids of speculative prefills: they are not
// requests of the workload, and the figures do not count them.
const specPrefix = "spec-"

// maxZeroSteps bounds an engine's steps in a row that take no time (every
// running request preempted): beyond, the engine cannot progress and the
// run would never end.
const maxZeroSteps = 1000

func newSim(cfg Config, mode string, w Workload, scale float64) (*sim, error) {
	workers := cfg.Workers
	if cfg.Disagg.Enabled() {
		if err := cfg.Disagg.validate(); err != nil {
			return nil, err
		}
		workers = cfg.Disagg.PrefillWorkers + cfg.Disagg.DecodeWorkers
	}
	switch {
	case workers < 1:
		return nil, fmt.Errorf("sim: need at least one worker, got %d", workers)
	case len(cfg.Specs) > 0 && len(cfg.Specs) != workers:
		return nil, fmt.Errorf("sim: %d engine specs for %d engines", len(cfg.Specs), workers)
	case scale <= 0:
		return nil, fmt.Errorf("sim: arrival speedup must be positive, got %g", scale)
	case cfg.KVEventDelay < 0:
		return nil, fmt.Errorf("sim: negative kv event delay %v", cfg.KVEventDelay)
	case cfg.EngineMetricsInterval <= 0:
		return nil, fmt.Errorf("sim: the engine metrics interval must be positive, got %v", cfg.EngineMetricsInterval)
	case w.Len() == 0:
		return nil, errors.New("sim: the workload has no requests")
	}
	rcfg, err := replay.ModeConfig(cfg.Router, mode, cfg.Engine.BlockSize)
	if err != nil {
		return nil, err
	}
	rcfg.OneGoroutine = cfg.oneGoroutineIndex(workers, rcfg.IndexBudgetPairs)
	s := &sim{cfg: cfg, w: w, scale: scale, base: time.Unix(1_700_000_000, 0).UTC(), held: map[int]workload.Request{}}
	rcfg.Now = func() time.Time { return s.base.Add(time.Duration(s.now)) }
	rcfg.Rand = rand.New(rand.NewPCG(cfg.Seed, cfg.Seed^0x9e3779b97f4a7c15))
	if s.r, err = router.New(rcfg); err != nil {
		return nil, err
	}
	if err := s.newReplicas(rcfg); err != nil {
		return nil, err
	}
	s.pollLoad = rcfg.Mode.UsesEngineLoad() || rcfg.Busy.ActiveDecodeBlocks != nil
	_, s.ownsPrompts = w.(*Trace)
	s.dp = max(cfg.DPSize, 1)
	s.engines = make([]simEngine, workers*s.dp)
	prev, share := extensions(w)
	expected := engineBlocksHint(w, prev, share, cfg.Engine.BlockSize, len(s.engines))
	for i := range s.engines {
		ecfg := cfg.engineConfig(i / s.dp)
		ecfg.Seed = fleet.RankSeed(cfg.Engine.Seed, i)
		ecfg.ExpectedBlocks = expected
		ecfg.NoBlockTokens = !cfg.listsBlocks
		ecfg.SequenceHashIDs = cfg.sequenceHashIDs()
		eng, err := engine.New(ecfg)
		if err != nil {
			return nil, err
		}
		// Ids from 1, as serve.FleetWorkers numbers a fleet's engines.
		s.engines[i] = simEngine{eng: eng, w: kv.Worker{ID: uint64(i/s.dp + 1), DPRank: uint32(i % s.dp)}, prefill: cfg.Disagg.role(i/s.dp) == router.RolePrefill,
			salts: router.NewSaltChains(2 * cfg.Engine.NumGPUBlocks), seed: ecfg.Seed}
	}
	for id := range workers {
		info := router.WorkerInfo{ID: uint64(id + 1), DPSize: s.dp, TotalKVBlocks: cfg.engineConfig(id).NumGPUBlocks, MaxNumBatchedTokens: cfg.Engine.MaxNumBatchedTokens, Role: cfg.Disagg.role(id)}
		info.CPU = id < len(cfg.Specs) && cfg.Specs[id].CPU
		s.everyRouter(func(r *router.Router) { r.AddWorker(info) })
	}
	if cfg.Disagg.Enabled() {
		s.pd = make([]pdState, w.Len())
		s.decodeOverrides = router.RemoteDecodeOverrides(sched.Overrides{}, cfg.Disagg.NoAssumeKVReuse)
	}
	s.reqs = make([]reqState, w.Len())
	s.remaining = w.Len()
	s.prompts.init(s)
	s.initBlockHashes(prev, share)
	s.prompts.initLazy(s)
	s.recycleEvents = s.rep == nil && s.pd == nil
	return s, nil
}

func (s *sim) schedule(at int64, kind uint8, n int) {
	s.seq++
	s.q.push(event{at: at, seq: s.seq, kind: kind, n: int32(n)})
}

func (s *sim) arrivalAt(i int) int64 {
	return int64(float64(s.w.At(i)-s.w.At(0)) / s.scale)
}

// linkSessions gives every request that waits for its session's previous
// turn (see predecessors) that turn's after entry.
func (s *sim) linkSessions() {
	prev := predecessors(s.w)
	if prev == nil {
		return
	}
	s.after = make([]int32, len(prev))
	for j := range s.after {
		s.after[j] = -1
	}
	s.waits = make([]bool, len(prev))
	for i, p := range prev {
		if p >= 0 {
			s.after[p] = int32(i)
			s.waits[i] = true
		}
	}
}

// predecessors finds, in a materialised workload, the requests that wait
// for their session's previous turn (workload.Request.Think): each gets
// that turn's index, every other request -1. nil when no request waits; a
// trace's requests never do.
func predecessors(w Workload) []int32 {
	reqs, ok := w.(Requests)
	if !ok {
		return nil
	}
	var prev []int32
	last := map[string]int{}
	for i := range reqs {
		r := &reqs[i]
		if r.Session == "" {
			continue
		}
		if p, seen := last[r.Session]; seen && r.Think > 0 {
			if prev == nil {
				prev = make([]int32, len(reqs))
				for j := range prev {
					prev[j] = -1
				}
			}
			prev[i] = int32(p)
		}
		last[r.Session] = i
	}
	return prev
}

// nextOpen is the first request after i that does not wait for another,
// or -1.
func (s *sim) nextOpen(i int) int {
	for j := i + 1; j < s.w.Len(); j++ {
		if s.waits == nil || !s.waits[j] {
			return j
		}
	}
	return -1
}

// release sends the request waiting for i, if any, its think time after
// i ended (finished or failed): think times are the agent's and its
// tools', not the workload's pace, so no arrival speedup shortens them.
func (s *sim) release(i int) {
	if s.after == nil || s.after[i] < 0 {
		return
	}
	n := int(s.after[i])
	s.schedule(s.now+int64(s.w.Request(n).Think), evArrival, n)
}

func (s *sim) run() error {
	s.linkSessions()
	s.measureFrom, s.measureTo = math.MinInt64, math.MaxInt64
	if s.after != nil {
		first, last := int64(-1), int64(0)
		for i := range s.waits {
			if !s.waits[i] {
				if first < 0 {
					first = s.arrivalAt(i)
				}
				last = s.arrivalAt(i)
			}
		}
		if last > first {
			s.measureFrom, s.measureTo = first+int64(float64(last-first)*SteadyWarmup), last
			s.windowed = true
		}
	}
	s.schedule(s.arrivalAt(0), evArrival, 0)
	if s.pollLoad {
		s.schedule(0, evPoll, 0)
	}
	for {
		ev, ok := s.q.next()
		if !ok {
			break
		}
		s.now = ev.at
		var err error
		switch ev.kind {
		case evArrival:
			err = s.arrive(int(ev.n))
		case evStepStart:
			s.step(int(ev.n))
		case evStepDone:
			err = s.stepDone(int(ev.n))
		case evKV:
			s.deliverKV(int(ev.n))
		case evPoll:
			s.poll()
		case evTransfer:
			err = s.transferred(int(ev.n))
		case evPrefillTimeout:
			err = s.prefillTimedOut(int(ev.n))
		case evSync:
			err = s.syncArrived()
		}
		if err == nil {
			err = s.flushSync()
		}
		if err != nil {
			return err
		}
	}
	if s.remaining != 0 {
		return fmt.Errorf("sim: %d requests never finished", s.remaining)
	}
	return nil
}

func (s *sim) arrive(i int) error {
	if s.waits == nil || !s.waits[i] {
		if next := s.nextOpen(i); next >= 0 {
			s.schedule(s.arrivalAt(next), evArrival, next)
		}
	}
	req := s.prompts.request(s, i)
	rs := &s.reqs[i]
	rs.arrival = s.now
	rs.prompt = int32(len(req.Tokens))
	if s.rep != nil {
		s.rep.assign(i, s.now, &req)
	}
	if s.pd != nil {
		s.arriveDisagg(i, &req)
	} else {
		s.submit(i, &req)
	}
	return s.flushDispatched()
}

// submit routes a request to be prefilled and decoded on one engine.
func (s *sim) submit(i int, req *workload.Request) {
	osl := req.OSL
	if s.cfg.NoOSLHints {
		osl = 0
	}
	salt := s.salt(req)
	local, seq := s.routerHashes(i, req, salt)
	rq := s.spare
	if rq == nil {
		rq = new(router.Request)
	}
	s.spare = nil
	// The loop keeps the hashes until the engine is done with them.
	*rq = router.Request{ID: strconv.Itoa(i), Tokens: s.prompts.routerTokens(req.Tokens), OSL: osl, CacheSalt: salt, LocalHashes: local, SeqHashes: seq, LentHashes: true}
	d, queued, err := s.routerOf(i).Submit(rq, s.onDispatch(i, dispAggregated))
	if !queued {
		*rq = router.Request{}
		s.spare = rq
	}
	switch {
	case err != nil:
		s.fail(i, err)
	case queued:
		s.prompts.park(req)
		s.held[i] = *req
		s.queuedBy[dispAggregated]++
	default:
		s.prompts.engineTokens(i, req)
		s.reqs[i].credited = int32(d.OverlapBlocks)
		s.decided(i, d.Worker, req)
		s.start(i, d.Worker, req)
	}
}

// onDispatch records the decision on a booking the router's queue holds;
// the loop acts on it after the router call that made it.
func (s *sim) onDispatch(i int, kind uint8) func(router.Decision, error) {
	return func(d router.Decision, err error) {
		s.dispatched = append(s.dispatched, dispatch{id: i, kind: kind, d: d, err: err})
	}
}

// engineOf is the index in engines of a routed rank.
func (s *sim) engineOf(w kv.Worker) int { return (int(w.ID)-1)*s.dp + int(w.DPRank) }

// start hands a routed request to its engine.
func (s *sim) start(i int, w kv.Worker, req *workload.Request) {
	s.reqs[i].worker = w
	e := s.engineOf(w)
	id := strconv.Itoa(i)
	seq, local := s.startHashes(i, req)
	if err := s.engines[e].eng.Add(engine.Request{ID: id, Tokens: req.Tokens, MaxTokens: req.OSL, CacheSalt: req.CacheSalt, Owned: s.ownsPrompts || s.prompts.owns(i), Tag: int32(i + 1),
		BlockIDs: seq, LocalHashes: local}); err != nil {
		s.free(i, id)
		s.fail(i, err)
		return
	}
	s.wake(e)
}

// wake has an idle engine step.
func (s *sim) wake(e int) {
	if !s.engines[e].stepped {
		s.engines[e].stepped = true
		// Not now: requests arriving at this same instant join the step.
		s.schedule(s.now, evStepStart, e)
	}
}

func (s *sim) fail(i int, err error) {
	rs := &s.reqs[i]
	if rs.failed || rs.finished {
		return
	}
	rs.failed = true
	s.remaining--
	s.release(i)
	s.errors++
	if s.firstErr == nil {
		s.firstErr = fmt.Errorf("request %d: %w", i, err)
	}
}

// flushDispatched starts the requests the router's queue let go during the
// last router call.
func (s *sim) flushDispatched() error {
	for len(s.dispatched) > 0 {
		batch := s.dispatched
		s.dispatched = nil
		for _, d := range batch {
			switch d.kind {
			case dispPrefill:
				s.prefillRouted(d.id, d.d, d.err)
				continue
			case dispDecode:
				s.decodeRouted(d.id, d.d, d.err)
				continue
			case dispSpeculative:
				tokens := s.specHeld[d.id]
				delete(s.specHeld, d.id)
				if d.err == nil {
					s.startSpeculative(d.id, d.d.Worker, tokens)
				}
				continue
			}
			req := s.held[d.id]
			delete(s.held, d.id)
			if d.err != nil {
				s.fail(d.id, d.err)
				continue
			}
			s.prompts.engineTokens(d.id, &req)
			s.reqs[d.id].credited = int32(d.d.OverlapBlocks)
			s.decided(d.id, d.d.Worker, &req)
			s.start(d.id, d.d.Worker, &req)
		}
	}
	return nil
}

func (s *sim) step(e int) {
	se := &s.engines[e]
	se.eng.StepTo(&se.res)
	s.tally.add(&se.res)
	s.schedule(s.now+int64(se.res.Duration), evStepDone, e)
}

func (s *sim) stepDone(e int) error {
	se := &s.engines[e]
	// The step's result stays where it is until the next step overwrites
	// it: nothing in between steps this engine.
	res := &se.res
	if events := res.Events; len(events) > 0 {
		res.Events = nil
		if s.cfg.KVEventDelay == 0 {
			s.applyKV(se, events)
			s.recycle(se, events)
		} else {
			se.batches = append(se.batches, events)
			// retired's room past its length holds emptied lists
			// (deliverKV): reused, not grown again every step.
			if n := len(se.retired); n < cap(se.retired) {
				se.retired = se.retired[:n+1]
			} else {
				se.retired = append(se.retired, nil)
			}
			s.schedule(s.now+int64(s.cfg.KVEventDelay), evKV, e)
		}
	}
	outs := res.Outputs
	for k := range outs {
		o := &outs[k]
		// start's requests carry their index (Tag): no parse per token.
		i := int(o.Tag) - 1
		if o.Tag == 0 {
			if strings.HasPrefix(o.ID, specPrefix) {
				if o.Index == 0 {
					s.r.MarkPrefillCompleted(o.ID)
					s.specMissed += int64(s.specPrompt[o.ID] - o.CachedTokens)
					delete(s.specPrompt, o.ID)
				}
				if o.Finished {
					s.r.Free(o.ID)
				}
				continue
			}
			var err error
			if i, err = strconv.Atoi(o.ID); err != nil {
				return fmt.Errorf("sim: engine output for unknown request %q", o.ID)
			}
		}
		if se.prefill {
			if err := s.prefilled(i, o.CachedTokens); err != nil {
				return err
			}
			continue
		}
		rs := &s.reqs[i]
		if rs.finished {
			return fmt.Errorf("sim: request %d produced a token after its last", i)
		}
		if o.Index == 0 {
			rs.first = s.now
			rs.cached = int32(o.CachedTokens)
			s.prefillDone(i, o.ID)
		} else if s.measured(rs) {
			s.countGap((s.now - rs.last + gapQuantum/2) / gapQuantum)
		}
		rs.last = s.now
		if o.Finished {
			rs.finished, rs.done = true, s.now
			s.remaining--
			s.prompts.retire(se, i)
			s.release(i)
			s.free(i, o.ID)
			s.speculate(i)
		}
	}
	if len(s.dispatched) > 0 {
		if err := s.flushDispatched(); err != nil {
			return err
		}
	}
	if se.eng.Idle() {
		se.stepped = false
		return nil
	}
	if res.Duration == 0 {
		if se.prefill && res.Preempted == 0 && se.eng.Metrics().HeldBlocks > 0 {
			// Nothing fits beside the blocks held for decode engines: the
			// engine waits for a pull to release some (releaseHold wakes
			// it), as the mocker's runner spins until one does.
			se.stepped, se.zero = false, 0
			return nil
		}
		if se.zero++; se.zero > maxZeroSteps {
			return fmt.Errorf("sim: engine %v makes no progress", se.w)
		}
	} else {
		se.zero = 0
	}
	s.step(e)
	return nil
}

// speculate sends, when request i of a session ended and a turn follows
// it, the next turn's predicted prefix (i's prompt and its answer, which
// the workload's next prompt starts with) to i's engine with one output
// token, booked with the router (SimConfig.SpeculativePrefill).
func (s *sim) speculate(i int) {
	if !s.cfg.SpeculativePrefill || s.pd != nil || s.after == nil || s.after[i] < 0 {
		return
	}
	cur, next := s.w.Request(i), s.w.Request(int(s.after[i]))
	n := min(len(cur.Tokens)+cur.OSL, len(next.Tokens))
	tokens := next.Tokens[:n:n]
	w := s.reqs[i].worker
	id := specPrefix + strconv.Itoa(i)
	d, queued, err := s.r.Submit(&router.Request{ID: id, Tokens: tokens, OSL: 1, CacheSalt: s.salt(&next), Target: &w}, s.onDispatch(i, dispSpeculative))
	switch {
	case err != nil: // the engine is busy or gone: no prefill
	case queued:
		if s.specHeld == nil {
			s.specHeld = map[int][]uint32{}
		}
		s.specHeld[i] = tokens
	default:
		s.startSpeculative(i, d.Worker, tokens)
	}
}

func (s *sim) startSpeculative(i int, w kv.Worker, tokens []uint32) {
	e := s.engineOf(w)
	id := specPrefix + strconv.Itoa(i)
	if err := s.engines[e].eng.Add(engine.Request{ID: id, Tokens: tokens, MaxTokens: 1}); err != nil {
		s.r.Free(id)
		return
	}
	s.specSent++
	if s.specPrompt == nil {
		s.specPrompt = map[string]int{}
	}
	s.specPrompt[id] = len(tokens)
	s.wake(e)
}

// measured reports whether the run's figures count rs.
func (s *sim) measured(rs *reqState) bool {
	return rs.arrival >= s.measureFrom && rs.arrival <= s.measureTo
}

func (s *sim) countGap(q int64) {
	if s.pendingN > 0 && q == s.pendingQ {
		s.pendingN++
		return
	}
	s.flushGaps()
	s.pendingQ, s.pendingN = q, 1
}

func (s *sim) flushGaps() {
	if s.pendingN > 0 {
		s.gaps.add(s.pendingQ, s.pendingN)
		s.pendingN = 0
	}
}

// deliverKV applies an engine's oldest batch in flight: every batch waits
// the same delay, so they arrive in the order they left.
func (s *sim) deliverKV(e int) {
	se := &s.engines[e]
	// Popped by shifting (a few batches are in flight at most), so the
	// queues keep their room instead of growing anew every few steps.
	batch := se.batches[0]
	n := len(se.batches)
	copy(se.batches, se.batches[1:])
	se.batches[n-1] = nil
	se.batches = se.batches[:n-1]
	s.applyKV(se, batch)
	s.recycle(se, batch)
	done := se.retired[0]
	for _, i := range done {
		s.prompts.release(int(i))
	}
	copy(se.retired, se.retired[1:])
	se.retired[n-1] = done[:0]
	se.retired = se.retired[:n-1]
}

func (s *sim) recycle(se *simEngine, events []engine.BlockEvent) {
	if s.recycleEvents {
		se.eng.Recycle(events)
	}
}

func (s *sim) applyKV(se *simEngine, events []engine.BlockEvent) {
	bs := s.cfg.Engine.BlockSize
	hybrid := len(s.cfg.Engine.KVCacheGroups) > 0
	for _, ev := range events {
		if hybrid && !se.indexed(ev, s.cfg.Engine) {
			continue
		}
		tier := kv.TierDevice
		if ev.Host {
			if s.cfg.IgnoreLowerTiers {
				continue
			}
			tier = kv.TierHostPinned
		}
		switch ev.Kind {
		case engine.Stored:
			es := router.EngineStored{Worker: se.w, Tier: tier, Parent: ev.Parent, EngineHashes: ev.BlockHashes, Tokens: ev.TokenIDs, BlockSize: bs,
				Salt: s.eventSalt(se, &ev)}
			es.LocalHashes = s.storedLocal(&ev)
			s.everyRouter(func(r *router.Router) { _ = r.ApplyEngineStored(&es) })
		case engine.Removed:
			if !ev.Host {
				se.salts.Removed(ev.BlockHashes)
			}
			kev := &s.kev
			*kev = kv.RemovedEvent(se.w, 0, ev.BlockHashes...)
			kev.Tier = tier
			s.everyRouter(func(r *router.Router) { _ = r.ApplyEvent(kev) })
		case engine.Cleared:
			se.salts.Clear()
			kev := &s.kev
			*kev = kv.Event{Worker: se.w, Kind: kv.KindCleared}
			s.everyRouter(func(r *router.Router) { _ = r.ApplyEvent(kev) })
		}
	}
}

// poll reads every engine's metrics into the router, and keeps polling
// while requests remain.
func (s *sim) poll() {
	s.loads = s.loads[:0]
	for i := range s.engines {
		m := s.engines[i].eng.Metrics()
		s.loads = append(s.loads, router.EngineReport{Worker: s.engines[i].w,
			Load: sched.EngineLoad{Waiting: m.Waiting, Running: m.Running, KVUsage: m.KVUsage}})
	}
	s.everyRouter(func(r *router.Router) { r.SetEngineLoads(s.loads) })
	if s.remaining > 0 {
		s.schedule(s.now+int64(s.cfg.EngineMetricsInterval), evPoll, 0)
	}
}

func (s *sim) point() Point {
	p := Point{ArrivalSpeedup: s.scale, Requests: len(s.reqs), Errors: s.errors}
	if s.firstErr != nil {
		p.FirstError = s.firstErr.Error()
	}
	if span := Span(s.w).Seconds() / s.scale; span > 0 {
		p.ArrivalRPS = float64(len(s.reqs)) / span
	}
	ttft := make([]float64, 0, len(s.reqs))
	e2e := make([]float64, 0, len(s.reqs))
	var nextTTFT []float64
	var prompt, cached, end int64
	for i := range s.reqs {
		rs := &s.reqs[i]
		if !rs.finished {
			continue
		}
		end = max(end, rs.done)
		if !s.measured(rs) {
			continue
		}
		ttft = append(ttft, float64(rs.first-rs.arrival)/1e6)
		if s.waits != nil && s.waits[i] {
			nextTTFT = append(nextTTFT, float64(rs.first-rs.arrival)/1e6)
		}
		e2e = append(e2e, float64(rs.done-rs.arrival)/1e6)
		prompt += int64(rs.prompt)
		if s.pd == nil {
			p.CreditedBlocks += int64(rs.credited)
			p.PhantomBlocks += int64(max(0, int(rs.credited)-int(rs.cached)/s.cfg.Engine.BlockSize))
		}
		if s.pd != nil && s.pd[i].how == howRemote {
			cached += int64(s.pd[i].pcached)
		} else {
			cached += int64(rs.cached)
		}
	}
	if s.windowed {
		// Closed-loop sessions arrive as fast as they are served: the
		// offered load is what arrived in the window.
		arrived := 0
		for i := range s.reqs {
			if rs := &s.reqs[i]; (rs.finished || rs.failed) && s.measured(rs) {
				arrived++
			}
		}
		p.Steady = &SteadyWindow{
			FromS: float64(s.measureFrom) / 1e9, ToS: float64(s.measureTo) / 1e9, Requests: len(ttft),
		}
		p.ArrivalRPS = 0
		if s.measureTo > s.measureFrom {
			p.ArrivalRPS = float64(arrived) / (float64(s.measureTo-s.measureFrom) / 1e9)
		}
	}
	p.TTFT, p.E2E = replay.DistOf(ttft), replay.DistOf(e2e)
	if len(nextTTFT) > 0 {
		d := replay.DistOf(nextTTFT)
		p.NextTurnTTFT = &d
	}
	p.SpeculativePrefills = s.specSent
	s.flushGaps()
	p.ITL = gapDist(s.gaps.runs())
	if prompt > 0 {
		p.HitRate = float64(cached) / float64(prompt)
	}
	p.ModelS = float64(end-s.arrivalAt(0)) / 1e9
	p.Engines = s.tally.stats(len(s.engines), time.Duration(end-s.arrivalAt(0)))
	for _, r := range s.routers {
		p.Queued += r.Stats().Queued
	}
	p.Replicas = s.replicaStats()
	for i := range s.engines {
		p.Preemptions += s.engines[i].eng.Metrics().Preemptions
	}
	if s.pd != nil {
		p.Disagg = s.disaggStats()
	}
	return p
}

// gapDist is replay.DistOf over the gaps each run stands for, with its
// nearest-rank percentiles; runs may come in any order.
func gapDist(runs []gapRun) replay.Dist {
	sorted := slices.Clone(runs)
	// The sum below adds in sorted order, whatever order runs came in:
	// floating-point sums depend on it.
	slices.SortFunc(sorted, func(a, b gapRun) int { return cmp.Compare(a.ns, b.ns) })
	var n int
	var sum float64
	for _, r := range sorted {
		n += r.n
		sum += float64(r.ns) * float64(r.n)
	}
	if n == 0 {
		return replay.Dist{}
	}
	at := func(p float64) float64 {
		i := min(max(int(float64(n)*p/100+0.5)-1, 0), n-1)
		for _, r := range sorted {
			if i < r.n {
				return float64(r.ns) / 1e6
			}
			i -= r.n
		}
		return 0
	}
	return replay.Dist{Mean: sum / float64(n) / 1e6, P50: at(50), P90: at(90), P99: at(99)}
}
