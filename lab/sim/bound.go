package sim

import (
	"math"
	"time"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/lab/replay"
	"github.com/kvrouter/kvrouter/lab/workload"
	"github.com/kvrouter/kvrouter/mocker/engine"
)

// EngineBoundRPS bounds the arrival rate any routing policy can sustain on
// w more tightly than PrefillBoundRPS, by charging the engines for the
// decode steps every request needs as well as for the prompt tokens one
// infinite cache would miss.
//
// A request of OSL output tokens decodes in OSL−1 steps (its first token
// comes from the step that prefills its prompt's end). A step decodes at
// most MaxNumSeqs sequences, and costs DecodeTime(u), u the fraction of
// the engine's blocks held by running requests. DecodeTime is concave, so
// it lies above its chord: DecodeTime(u) ≥ D(0) + (D(1) − D(0))·u. Summed
// over a fleet's decode steps that is at least D(0) for every MaxNumSeqs
// decoded tokens, plus (D(1) − D(0)) / NumGPUBlocks for every block a
// decoding request holds in every step it decodes. The blocks counted are
// the request's private prompt blocks: full blocks no request of another
// owner has, where the turns of one closed-loop session share an owner
// (they never run at once) and every other request is its own. Whatever the
// routing, those blocks are held, once each, while their request decodes.
//
// Prefill is charged as in PrefillBoundRPS. The sum is a lower bound on the
// stepping time any fleet spends on w, so w's requests over it, per engine,
// bound the rate. It leaves out the memory idle sessions need to keep
// their hits, generated tokens' blocks, queueing and imbalance: real
// goodputs lie below it. 0 when there is nothing to bound.
func EngineBoundRPS(c *replay.Ceiling, w Workload, eng engine.Config, workers int) float64 {
	return unequalEngineBound(c, w, eng, float64(workers))
}

// unequalEngineBound is EngineBoundRPS on a fleet of unequal engines: speed is
// the engines counted by their speed (the fleet does speed configured
// engines' work per second), and eng.NumGPUBlocks the most blocks of any
// engine, whose decode steps read a held block most cheaply. Charging
// every step at the fastest rate and every block at the cheapest keeps
// it a bound whichever engines the work goes to.
func unequalEngineBound(c *replay.Ceiling, w Workload, eng engine.Config, speed float64) float64 {
	n := w.Len()
	if n == 0 || !(speed > 0) || eng.MaxNumSeqs <= 0 || eng.NumGPUBlocks <= 0 {
		return 0
	}
	owners := requestOwners(w)
	// Each prompt is hashed under its cache salt: salted copies of one
	// prefix are different blocks.
	hasher := func(r *workload.Request) blockhash.Hasher { return blockhash.NewKeyed(eng.BlockSize, "", r.CacheSalt) }
	// Two passes hash every prompt twice: keeping the first pass's hashes
	// instead would take 8 bytes per block of the workload (half a GB for
	// the agentic one), for a bound computed once per sweep.
	// ownerOf is each full block's owner, or sharedBlock once two owners
	// have it.
	const sharedBlock = -1
	ownerOf := map[uint64]int32{}
	var local, seq []uint64
	for i := range n {
		r := w.Request(i)
		local, seq = hasher(&r).AppendHashes(local[:0], seq[:0], r.Tokens)
		for _, b := range seq {
			if o, ok := ownerOf[b]; !ok {
				ownerOf[b] = owners[i]
			} else if o != owners[i] {
				ownerOf[b] = sharedBlock
			}
		}
	}
	d0 := float64(engine.DecodeTime(0))
	slope := float64(engine.DecodeTime(1)) - d0
	var decode float64 // ns
	for i := range n {
		r := w.Request(i)
		steps := float64(max(r.OSL-1, 0))
		if steps == 0 {
			continue
		}
		local, seq = hasher(&r).AppendHashes(local[:0], seq[:0], r.Tokens)
		private := 0
		for _, b := range seq {
			if ownerOf[b] == owners[i] {
				private++
			}
		}
		decode += steps * (d0/float64(eng.MaxNumSeqs) + slope*float64(private)/float64(eng.NumGPUBlocks))
	}
	hits, total := c.Tokens()
	prefill := float64(total-hits) * cheapestPrefillPerToken(eng.MaxNumBatchedTokens)
	busy := (prefill + decode) / speed / float64(time.Second) // each engine's share
	if busy <= 0 {
		return 0
	}
	return float64(n) / busy
}

// requestOwners gives the requests that can never run at once the same
// owner: the turns of a closed-loop session (each waits for the one
// before, see predecessors). Every other request owns itself.
func requestOwners(w Workload) []int32 {
	owners := make([]int32, w.Len())
	prev := predecessors(w)
	for i := range owners {
		owners[i] = int32(i)
		if prev != nil && prev[i] >= 0 {
			owners[i] = owners[prev[i]]
		}
	}
	return owners
}

// cheapestPrefillPerToken is the least step time per prompt token, in ns,
// over the step sizes the batch budget allows.
func cheapestPrefillPerToken(maxBatched int) float64 {
	best := math.Inf(1)
	for t := 1; t <= max(maxBatched, 1); t++ {
		best = min(best, float64(engine.PrefillTime(t))/float64(t))
	}
	return best
}
