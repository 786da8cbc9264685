package sched

import (
	"math"
	"math/rand/v2"

	"github.com/kvrouter/kvrouter/core/kv"
)

// Candidate is everything the scheduler knows about one worker rank for one
// request. The index supplies the block counts and the load tracker the
// loads; the Potential* fields are the loads as they would be if this
// request went to this worker.
type Candidate struct {
	Worker        kv.Worker
	OverlapBlocks int // leading prompt blocks cached on the worker
	// HostBlocks and DiskBlocks are the cumulative overlaps on the host
	// tier and on disk: the longest prompt prefix held on that tier or a
	// faster one (OverlapBlocks ≤ HostBlocks ≤ DiskBlocks). SharedBlocks is
	// the overlap held in an external (shared) cache beyond OverlapBlocks.
	HostBlocks, DiskBlocks, SharedBlocks int
	ActiveDecodeBlocks                   float64
	ActivePrefillTokens                  int
	PotentialDecodeBlocks                float64
	PotentialPrefillTokens               int
	TotalKVBlocks                        int // capacity; 0 when the worker has not said
	MaxNumBatchedTokens                  int // per-step token budget; 0 when unknown
	ActiveRequests                       int
	// CPU says the worker computes on CPU rather than an accelerator, for
	// device-aware-weighted routing.
	CPU bool
	// Prefill is the worker's learned prefill time
	// (--router-prefill-load-model learned); with it kv mode's cost is in
	// time, not blocks.
	Prefill PrefillTime
	// Engine is the load the engine last reported about itself, for the
	// policies that score by it (llm-d, the Gateway API Inference
	// Extension); kvrouter's own kv mode predicts load instead of reading it.
	Engine EngineLoad
}

// PrefillTime is one worker's learned prefill for one request, in
// seconds. Known is false without a learned model; a decision's
// candidates are all known or all not.
type PrefillTime struct {
	Known bool
	// SecondsPerToken is what one more uncached prompt token costs there.
	SecondsPerToken float64
	// Fixed is the request's prefill time before its uncached tokens (the
	// step's fixed cost, its cached tokens and the batch it joins).
	Fixed float64
	// Backlog is the prefill still ahead of it there.
	Backlog float64
}

// EngineLoad is one engine rank's own report of its load (vLLM's /metrics:
// vllm:num_requests_waiting, vllm:num_requests_running,
// vllm:kv_cache_usage_perc). It lags the router's decisions by a scrape
// interval, which is why kv mode does not rely on it.
type EngineLoad struct {
	Known            bool // false until the engine has been scraped once
	Waiting, Running int
	KVUsage          float64 // fraction of KV blocks in use, 0..1
}

// load is the current (not potential) load in blocks, the measure of the
// load-only modes. Prefill tokens count in blocks so both terms share a unit.
func (c *Candidate) load(blockSize int) float64 {
	return c.ActiveDecodeBlocks + float64(c.ActivePrefillTokens)/float64(blockSize)
}

// Rand is the randomness the scheduler consumes. *rand.Rand satisfies it;
// it is an interface so production code can share one goroutine-safe
// source (SharedRand) while tests inject a seeded one.
type Rand interface {
	IntN(n int) int
	Float64() float64
}

// SharedRand draws from math/rand/v2's global source, which is safe for
// concurrent use and randomly seeded.
var SharedRand Rand = sharedRand{}

type sharedRand struct{}

func (sharedRand) IntN(n int) int   { return rand.IntN(n) }
func (sharedRand) Float64() float64 { return rand.Float64() }

// pickMin returns the index of the candidate with the lowest score. Ties are
// broken uniformly at random rather than by position (or by indexed
// blocks): a fixed order would send every request of an idle fleet, where
// all scores are equal, to the same worker. score is evaluated twice for
// tied candidates instead of being buffered, which keeps this
// allocation-free; it must be deterministic.
func pickMin(n int, score func(i int) float64, rng Rand) int {
	best, ties := 0, 0
	minScore := math.Inf(1)
	for i := range n {
		switch s := score(i); {
		case s < minScore:
			best, ties, minScore = i, 1, s
		case s == minScore:
			ties++
		}
	}
	if ties <= 1 {
		return best
	}
	k := rng.IntN(ties)
	for i := best; i < n; i++ {
		if score(i) == minScore {
			if k == 0 {
				return i
			}
			k--
		}
	}
	return best // unreachable while score is deterministic
}

// stackCosts is how many costs sampleSoftmax keeps on the stack before it
// allocates; typical fleets fit.
const stackCosts = 128

// sampleSoftmax draws index i with probability ∝ exp(−(cost_i/(max−min))/T).
// Costs are normalised by their range so that T means the same thing
// whatever the fleet's absolute load; subtracting min first keeps every
// exponent in [−1/T, 0], so nothing overflows and the cheapest worker always
// has weight 1.
func sampleSoftmax(costs []float64, temperature float64, rng Rand) int {
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, c := range costs {
		lo, hi = min(lo, c), max(hi, c)
	}
	if hi == lo {
		return rng.IntN(len(costs))
	}
	// Divide step by step: (c−lo)/(hi−lo) is in [0, 1] whatever the
	// magnitudes, whereas a precomputed 1/((hi−lo)·T) can overflow and turn
	// the minimum's 0 exponent into NaN.
	span := hi - lo
	var sum float64
	for i, c := range costs {
		w := math.Exp(-((c - lo) / span) / temperature)
		costs[i] = w
		sum += w
	}
	u := rng.Float64() * sum
	for i, w := range costs {
		if u < w {
			return i
		}
		u -= w
	}
	// Rounding can leave u ≥ the last weight; the last positive weight is
	// the honest answer then.
	for i := len(costs) - 1; ; i-- {
		if costs[i] > 0 {
			return i
		}
	}
}
