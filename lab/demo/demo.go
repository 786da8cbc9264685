// Package demo is what `kvrouter demo` shows: the router over in-process
// simulated engine caches, a fleet behind a real router (core/router), fed a
// request trace exactly as production would feed it, once in kv mode and
// once, on a fresh fleet, in round-robin mode, so the prefix-cache hit
// rates the engines see can be compared.
//
// Every request is booked with BestWorker under an id; the chosen engine's
// prefix cache (the bench's LRU engine cache) admits the prompt and emits
// Removed and Stored KV events under its own opaque block ids, which go to
// the router through ApplyEvent; MarkPrefillCompleted follows the simulated
// first token and Free the end of the simulated stream.
//
// The replay runs in virtual time, on one goroutine, so it is deterministic
// and fast: a closed loop keeps InFlight requests active (a new one is
// admitted when one ends), each engine prefills its requests one after
// another at PrefillTokensPerSec (only the tokens it did not find cached),
// and decoding takes DecodeTokenTime per output token. Trace timestamps are
// ignored.
package demo

import (
	"container/heap"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"time"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/core/sched"
	"github.com/kvrouter/kvrouter/lab/bench"
	"github.com/kvrouter/kvrouter/lab/trace"
)

// Config sets up a replay. Zero values take DefaultConfig's.
type Config struct {
	Workers        int    // simulated engines
	CapacityBlocks int    // blocks each engine caches
	BlockSize      int    // tokens per KV block
	InFlight       int    // requests active at once
	Seed           uint64 // engine block ids and the router's tie-breaks

	PrefillTokensPerSec float64       // an engine's prefill rate
	DecodeTokenTime     time.Duration // time per output token
}

// DefaultConfig is the fleet of docs/benchmarks.md's trace replay (8
// engines of 131,072 blocks: a conversation's history is still cached when
// it comes back, about 100 s later), loaded by 64 requests at once (8 per
// engine), enough that queueing behind uncached prefills shows in TTFT.
// With caches that evict a conversation before its next turn every mode
// finds only the shared system prompt, and the replay would show no
// difference between routing policies.
func DefaultConfig() Config {
	return Config{
		Workers: 8, CapacityBlocks: 131072, BlockSize: 16, InFlight: 64, Seed: 1,
		PrefillTokensPerSec: 10000, DecodeTokenTime: 20 * time.Millisecond,
	}
}

func (c *Config) defaults() error {
	d := DefaultConfig()
	if c.Workers == 0 {
		c.Workers = d.Workers
	}
	if c.CapacityBlocks == 0 {
		c.CapacityBlocks = d.CapacityBlocks
	}
	if c.BlockSize == 0 {
		c.BlockSize = d.BlockSize
	}
	if c.InFlight == 0 {
		c.InFlight = d.InFlight
	}
	if c.PrefillTokensPerSec == 0 {
		c.PrefillTokensPerSec = d.PrefillTokensPerSec
	}
	if c.DecodeTokenTime == 0 {
		c.DecodeTokenTime = d.DecodeTokenTime
	}
	if c.Workers < 1 || c.CapacityBlocks < 1 || c.BlockSize < 1 || c.InFlight < 1 || c.PrefillTokensPerSec <= 0 || c.DecodeTokenTime < 0 {
		return fmt.Errorf("demo: workers, capacity, block size, in-flight and prefill rate must be positive")
	}
	return nil
}

// Workload is the requests to replay, with their hashes precomputed so
// that both modes replay exactly the same thing.
type Workload struct {
	Name     string
	Requests []Request
}

// Request is one request of a workload.
type Request struct {
	Tokens []uint32
	OSL    int // output tokens
	// The engine-side content of the prompt at the workload's block size:
	// local and sequence hashes of its full blocks.
	local, seq []uint64
}

func newWorkload(name string, blockSize int, prompts [][]uint32, osl []int) Workload {
	h := blockhash.New(blockSize, "")
	w := Workload{Name: name, Requests: make([]Request, len(prompts))}
	for i, p := range prompts {
		local, seq := h.Hashes(p)
		w.Requests[i] = Request{Tokens: p, OSL: osl[i], local: local, seq: seq}
	}
	return w
}

// HitCeiling is the hit rate of one engine with unlimited cache serving the
// whole workload: the share of prompt blocks some earlier prompt already
// had. No routing over finite caches can beat it.
func (w *Workload) HitCeiling() float64 {
	seen := map[uint64]struct{}{}
	var hit, total int
	for i := range w.Requests {
		seq := w.Requests[i].seq
		total += len(seq)
		for _, h := range seq {
			if _, ok := seen[h]; !ok {
				break
			}
			hit++
		}
		for _, h := range seq {
			seen[h] = struct{}{}
		}
	}
	if total == 0 {
		return 0
	}
	return float64(hit) / float64(total)
}

// TraceWorkload is the first n requests of a Mooncake trace (all of them if
// n ≤ 0 or the trace is shorter).
func TraceWorkload(name string, tr *trace.Trace, n, blockSize int) Workload {
	if n <= 0 || n > len(tr.Requests) {
		n = len(tr.Requests)
	}
	prompts := make([][]uint32, n)
	osl := make([]int, n)
	for i := range n {
		prompts[i] = tr.Requests[i].Tokens(0)
		osl[i] = tr.Requests[i].OutputLength
	}
	return newWorkload(name, blockSize, prompts, osl)
}

// Synthetic workload shape: a few system prompts, many multi-turn
// conversations interleaved.
const (
	synthSystems       = 4
	synthSystemTokens  = 1024
	synthConversations = 48 // active at once
	synthMaxTurns      = 10
)

// SyntheticWorkload is n requests of multi-turn chat: synthConversations
// conversations are active at once, each starting with one of a few shared
// system prompts; every request continues a random active conversation (its
// whole history, previous answers included, plus a new user message), and
// a conversation that reaches its last turn is replaced by a new one.
func SyntheticWorkload(n, blockSize int, seed uint64) Workload {
	rng := rand.New(rand.NewPCG(seed, 0x5eed))
	tokens := func(k int) []uint32 {
		out := make([]uint32, k)
		for i := range out {
			out[i] = uint32(rng.IntN(trace.Vocab))
		}
		return out
	}
	systems := make([][]uint32, synthSystems)
	for i := range systems {
		systems[i] = tokens(synthSystemTokens)
	}
	type conv struct {
		history []uint32
		turns   int
	}
	newConv := func() *conv {
		return &conv{history: slices.Clone(systems[rng.IntN(synthSystems)]), turns: 2 + rng.IntN(synthMaxTurns-1)}
	}
	convs := make([]*conv, synthConversations)
	for i := range convs {
		convs[i] = newConv()
	}
	prompts := make([][]uint32, n)
	osl := make([]int, n)
	for i := range n {
		k := rng.IntN(len(convs))
		c := convs[k]
		prompt := append(slices.Clone(c.history), tokens(128+rng.IntN(896))...)
		prompts[i] = prompt
		osl[i] = 128 + rng.IntN(384)
		c.history = append(prompt, tokens(osl[i])...) // the answer joins the history
		if c.turns--; c.turns == 0 {
			convs[k] = newConv()
		}
	}
	return newWorkload(fmt.Sprintf("synthetic: %d system prompts, multi-turn conversations", synthSystems), blockSize, prompts, osl)
}

// Result is one mode's replay.
type Result struct {
	Mode     sched.Mode
	Requests int
	// PromptBlocks are the full blocks of all prompts; CachedBlocks those
	// the engines found in their prefix cache. HitRate = Cached / Prompt.
	PromptBlocks, CachedBlocks uint64
	HitRate                    float64
	// PrefillTokens are the prompt tokens the engines had to compute.
	PrefillTokens uint64
	// PerWorker is how many requests each worker (id 0..Workers-1) took.
	PerWorker []int
	// TTFT is the simulated time to first token: waiting for the engine's
	// earlier prefills plus this prompt's uncached tokens.
	TTFTMean, TTFTP99 time.Duration
	// Events are the KV events the engines emitted, all applied by the
	// router; EventErrors those it refused.
	Events, EventErrors int
	// OverlapMismatches counts requests where the router's overlap for the
	// chosen worker differed from what the engine found cached: 0 when the
	// event-fed index is exact.
	OverlapMismatches int
	// SimDuration is the virtual time the replay took.
	SimDuration time.Duration
}

// Share is the fraction of requests worker i took.
func (r *Result) Share(i int) float64 {
	if r.Requests == 0 {
		return 0
	}
	return float64(r.PerWorker[i]) / float64(r.Requests)
}

// Modes are the modes Compare replays, in order.
var Modes = []sched.Mode{sched.ModeKV, sched.ModeRoundRobin}

// Compare replays wl once per mode in Modes, each on a fresh fleet and
// router. progress, if set, is called before each mode.
func Compare(ctx context.Context, cfg Config, wl Workload, progress func(sched.Mode)) ([]Result, error) {
	var out []Result
	for _, m := range Modes {
		if progress != nil {
			progress(m)
		}
		res, err := Run(ctx, cfg, wl, m)
		if err != nil {
			return out, err
		}
		out = append(out, res)
	}
	return out, nil
}

// event is a simulated moment: a request's first token or its end.
type event struct {
	at    time.Duration
	seq   int // tie-break: order of scheduling
	req   int
	final bool // end of stream (else: first token)
}

type events []event

func (h events) Len() int { return len(h) }
func (h events) Less(i, j int) bool {
	if h[i].at != h[j].at {
		return h[i].at < h[j].at
	}
	return h[i].seq < h[j].seq
}
func (h events) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *events) Push(x any)   { *h = append(*h, x.(event)) }
func (h *events) Pop() any {
	old := *h
	e := old[len(old)-1]
	*h = old[:len(old)-1]
	return e
}

// Run replays wl over a fresh fleet of cfg.Workers engines routed in mode.
// It stops with ctx.Err() if ctx ends.
func Run(ctx context.Context, cfg Config, wl Workload, mode sched.Mode) (Result, error) {
	if err := cfg.defaults(); err != nil {
		return Result{}, err
	}
	if len(wl.Requests) == 0 {
		return Result{}, errors.New("demo: empty workload")
	}
	if got := blockhash.New(cfg.BlockSize, "").Blocks(len(wl.Requests[0].Tokens)); got != len(wl.Requests[0].seq) {
		return Result{}, fmt.Errorf("demo: workload hashed at another block size than %d", cfg.BlockSize)
	}
	// Virtual time: the router's clock (request expiry, queueing) is the
	// simulation's.
	epoch := time.Unix(1_700_000_000, 0)
	var now time.Duration
	rcfg := router.DefaultConfig()
	rcfg.Mode = mode
	rcfg.BlockSize = cfg.BlockSize
	rcfg.Now = func() time.Time { return epoch.Add(now) }
	rcfg.Rand = rand.New(rand.NewPCG(cfg.Seed, 7))
	// One goroutine drives the whole fleet, so a request must never wait
	// in the router's admission queue for a Free that only this goroutine
	// could make; the closed loop bounds the load instead.
	rcfg.QueueThreshold = nil
	// Each request's events are applied the moment it is served, so there
	// is nothing to predict, and OverlapMismatches measures the event-fed
	// index alone.
	rcfg.PredictedTTL = 0
	r, err := router.New(rcfg)
	if err != nil {
		return Result{}, err
	}
	engines := make([]*bench.Engine, cfg.Workers)
	prefillFree := make([]time.Duration, cfg.Workers) // when each engine's prefill line is free
	for i := range engines {
		w := kv.Worker{ID: uint64(i)}
		engines[i] = bench.NewEngine(w, cfg.CapacityBlocks, cfg.Seed)
		r.AddWorker(router.WorkerInfo{ID: w.ID, TotalKVBlocks: cfg.CapacityBlocks, MaxNumBatchedTokens: 8192})
	}

	res := Result{Mode: mode, PerWorker: make([]int, cfg.Workers)}
	arrival := make([]time.Duration, len(wl.Requests))
	ttft := make([]time.Duration, 0, len(wl.Requests))
	var pending events
	scheduled := 0
	push := func(at time.Duration, req int, final bool) {
		heap.Push(&pending, event{at: at, seq: scheduled, req: req, final: final})
		scheduled++
	}

	admit := func(i int) error {
		q := &wl.Requests[i]
		id := strconv.Itoa(i)
		d, err := r.BestWorker(ctx, &router.Request{ID: id, Tokens: q.Tokens, OSL: q.OSL})
		if err != nil {
			return fmt.Errorf("demo: request %d: %w", i, err)
		}
		wid := int(d.Worker.ID)
		hit, evs := engines[wid].Serve(q.seq, q.local)
		for k := range evs {
			res.Events++
			if err := r.ApplyEvent(&evs[k]); err != nil {
				res.EventErrors++
			}
		}
		if d.OverlapBlocks != hit {
			res.OverlapMismatches++
		}
		res.Requests++
		res.PerWorker[wid]++
		res.PromptBlocks += uint64(len(q.seq))
		res.CachedBlocks += uint64(hit)
		uncached := max(1, len(q.Tokens)-hit*cfg.BlockSize) // the last token is always computed
		res.PrefillTokens += uint64(uncached)

		arrival[i] = now
		start := max(now, prefillFree[wid])
		first := start + time.Duration(float64(uncached)/cfg.PrefillTokensPerSec*float64(time.Second))
		prefillFree[wid] = first
		push(first, i, false)
		push(first+time.Duration(q.OSL)*cfg.DecodeTokenTime, i, true)
		return nil
	}

	next := 0
	for ; next < min(cfg.InFlight, len(wl.Requests)); next++ {
		if err := admit(next); err != nil {
			return res, err
		}
	}
	for pending.Len() > 0 {
		if err := ctx.Err(); err != nil {
			return res, err
		}
		ev := heap.Pop(&pending).(event)
		now = ev.at
		id := strconv.Itoa(ev.req)
		if !ev.final {
			ttft = append(ttft, now-arrival[ev.req])
			r.MarkPrefillCompleted(id)
			continue
		}
		r.Free(id)
		if next < len(wl.Requests) {
			if err := admit(next); err != nil {
				return res, err
			}
			next++
		}
	}
	res.SimDuration = now
	if res.PromptBlocks > 0 {
		res.HitRate = float64(res.CachedBlocks) / float64(res.PromptBlocks)
	}
	var sum time.Duration
	for _, t := range ttft {
		sum += t
	}
	res.TTFTMean = sum / time.Duration(len(ttft))
	slices.Sort(ttft)
	res.TTFTP99 = ttft[min(len(ttft)-1, (len(ttft)*99+99)/100-1)]
	return res, nil
}
