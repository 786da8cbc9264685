package sim

import (
	"math"
	"slices"
	"time"

	"github.com/kvrouter/kvrouter/lab/replay"
	"github.com/kvrouter/kvrouter/lab/workload"
	"github.com/kvrouter/kvrouter/mocker/engine"
)

// The KV bound: EngineBoundRPS with each request's work kept on one
// engine and each engine's blocks charged at its own KV size. The sim
// computes it for every fleet of one or two classes (engines of one speed
// and size), and the engine bound it reports is the lower of the two.
//
// EngineBoundRPS charges every held block at the largest engine's size and
// lets all the work spread freely, so on a fleet with smaller caches it
// is the bound of the largest engines. Here each engine is charged at its
// own size. A decode step of engine e at usage u costs at least
// D(0) + (D(1) − D(0))·u (the chord, see EngineBoundRPS), u = used/N_e, so
// a block held through a decode step costs (D(1) − D(0))/N_e there: twice
// as much on an engine of half the blocks. Two more facts tie the work to
// the engines:
//
//   - A request's decode runs on the engine that prefilled it (no
//     disaggregation), and so do the prompt tokens no other request's
//     prompt holds (its private tokens: its blocks held by no other
//     request, its partial last block, at least its last token): no
//     cache anywhere holds them before it computes them. Only the rest of
//     the infinite cache's misses (blocks several prompts share) can be
//     computed wherever any one of those prompts runs; the bound lets that
//     pool go anywhere.
//   - Memory (Little's law, step by step): a step's usage is at most 1.
//     Every prompt block is designated to one request whose prompt holds
//     it, the one with the most decode steps (privacy): that request
//     holds it, on its engine, in each of its decode steps, and no two
//     requests are designated one block, so the blocks designated to the
//     requests that decode in one step, with their answers' own blocks
//     (decodeTails), are distinct slots of that engine. Summed over e's
//     decode steps they are B_e, each request's designated blocks times
//     its decode steps plus its answer's blocks. So e's decode steps
//     number at least B_e/N_e, as well as K_e/MaxNumSeqs (K_e the tokens
//     decoded), and each costs at least D(0).
//
// For engine e of speed s_e, over a run of T seconds,
//
//	s_e·T ≥ c*·P_e + D(0)·max(K_e/M, B_e/N_e) + (D(1) − D(0))·B_e/N_e
//
// with P_e the prompt tokens e computes (its requests' private tokens and
// its part of the pool) at c*, the cheapest cost per token. Summed over
// the engines of one class (same speed and size), max(K/M, B/N) ≥
// λ·K/M + (1 − λ)·B/N for any λ in [0, 1] makes every request's charge on
// a class linear: a_ic = c*·p_i + D(0)·(λ_c·k_i/M + (1 − λ_c)·b_i/N_c) +
// (D(1) − D(0))·b_i/N_c, in time at speed 1 (b_i the request's share of
// B). Whatever the routing, some fractional assignment x_ic of the
// requests to the classes (Σ_c x_ic = 1) and of the pool has
// Σ_i x_ic·a_ic + pool_c ≤ n_c·s_c·T for every class. The least T for
// which such an assignment exists (a linear program) is therefore at most
// the run's length, and n/T bounds its rate; every λ gives a bound, and
// the lowest over λ_c ∈ {0, 1} is kept (a finer grid of λ moved no figure
// of docs/benchmarks.md).
//
// With two classes the program is solved exactly: for a T, putting on the
// first class the requests (and pool) whose cost there is smallest against
// their cost on the second, until its capacity is full, leaves the least
// work to the second (an exchange argument), so T is feasible if and only
// if that greedy fill fits; T is found by bisection. One class is the sum.
// More classes fall back to EngineBoundRPS's charge (kvBound returns 0),
// and so do disaggregated fleets of two classes, where a request's prefill
// and decode run on different engines.
//
// What it leaves out is what EngineBoundRPS leaves out (queueing,
// imbalance, the blocks idle sessions keep for their hits, the time a
// decoding request holds its blocks while others' prompts fill the step,
// and the hit rate a finite cache loses against the infinite one). As
// EngineBoundRPS it assumes each token after the first comes from a
// decode step: a preempted request that resumes with its whole context
// still cached may take one token from a step that prefills only its last
// tokens (PrefillTime(1), 16.5 ms, where the chord would charge its
// blocks' share of up to D(1) − D(0), 28.3 ms). Preemption otherwise only
// adds work.

// fleetBounds is what a sweep reports of a fleet's bounds.
type fleetBounds struct {
	ceiling, pooled *replay.Ceiling
	// engineRPS is the lower of EngineBoundRPS's charge and the KV bound
	// (wherever it applies); kvRPS is the KV bound on a fleet of unequal
	// caches, else 0.
	engineRPS, kvRPS float64
}

// boundsOf measures w for a fleet of workers engines of cfg.
func boundsOf(cfg *Config, w Workload, workers int) fleetBounds {
	speed, maxBlocks, totalBlocks := cfg.fleetSize(workers)
	classes := cfg.kvClasses(workers)
	m := measure(w, cfg.Engine.BlockSize, totalBlocks, len(classes) <= 2)
	eng := cfg.Engine
	eng.NumGPUBlocks = maxBlocks
	b := fleetBounds{ceiling: m.infinite, pooled: m.pooled, engineRPS: engineBound(m.infinite, m.decode, eng, speed)}
	// A disaggregated request prefills on one engine and decodes on
	// another: its work splits between classes, which kvBound's
	// assignment does not allow (one class is a sum, and holds).
	var kv float64
	if m.kv != nil && (len(classes) == 1 || !cfg.Disagg.Enabled()) {
		kv = kvBound(m.kv, classes, cfg.Engine)
	}
	if kv > 0 && kv < b.engineRPS {
		b.engineRPS = kv
	}
	// Reported apart only where the caches differ; elsewhere it is part
	// of the engine bound.
	if unequalKV(classes) {
		b.kvRPS = kv
	}
	return b
}

// kvClass is the engines of one speed and one KV size.
type kvClass struct {
	speed  float64 // each engine's
	blocks int     // each engine's GPU blocks
	count  int
}

// kvRequests is what the KV bound needs of each request.
type kvRequests struct {
	private []int32 // the request's tokens no other request holds (≥ 1)
	steps   []int32 // its decode steps, OSL − 1
	// blockSteps is the blocks charged to the request, summed over its
	// decode steps: its designated prompt blocks (see privacy) and its
	// answer's own blocks (decodeTails) in each.
	blockSteps []int64
	misses     int64 // the infinite cache's misses, every request's
}

// privacy finds, in one pass, each request's full blocks that no other
// request holds (a prompt's chained hashes make the blocks it shares a
// prefix of it, so its private blocks are the rest), and designates
// every block to one of the requests whose prompts hold it: the one with
// the most decode steps, the first of them on a tie. A request holds
// every block of its prompt, on its engine, in every step it decodes in,
// and no block is designated twice, so the blocks designated to the
// requests that decode in one step are distinct slots of their engine.
type privacy struct {
	holders []blockHolder // by block number (replay.BlockIDs)
	tails   decodeTails
	steps   []int32
	full    []int32 // each request's full blocks
	toks    []int32 // each request's prompt tokens
}

// blockHolder is a block's designated request so far.
type blockHolder struct {
	req    int32 // -1 before any
	steps  int32 // its decode steps
	shared bool  // another request's prompt holds it too
}

// newPrivacy has room for n requests and about blocks distinct blocks
// (blocksHint).
func newPrivacy(n, blockSize, blocks int) *privacy {
	return &privacy{tails: newDecodeTails(n, blockSize), holders: make([]blockHolder, 0, blocks),
		steps: make([]int32, 0, n), full: make([]int32, 0, n), toks: make([]int32, 0, n)}
}

// add takes request i's full blocks: its prompt's chained hashes seq and
// their numbers ids.
func (p *privacy) add(i int, r *workload.Request, seq []uint64, ids []int32) {
	steps := int32(max(r.OSL-1, 0))
	p.steps = append(p.steps, steps)
	p.full = append(p.full, int32(len(seq)))
	p.toks = append(p.toks, int32(len(r.Tokens)))
	p.tails.add(r, seq)
	for _, id := range ids {
		if int(id) >= len(p.holders) {
			p.holders = extend(p.holders, int(id)+1, blockHolder{req: -1})
		}
		h := &p.holders[id]
		switch {
		case h.req < 0:
			*h = blockHolder{req: int32(i), steps: steps}
			continue
		case int(h.req) == i:
			continue
		}
		h.shared = true
		if steps > h.steps {
			h.req, h.steps = int32(i), steps
		}
	}
}

func (p *privacy) result(blockSize int, misses int64) kvRequests {
	n := len(p.steps)
	private := make([]int32, n) // full blocks no other request holds
	designated := make([]int64, n)
	for _, h := range p.holders {
		if h.req < 0 {
			continue
		}
		designated[h.req]++
		if !h.shared {
			private[h.req]++
		}
	}
	out := kvRequests{private: make([]int32, n), steps: p.steps, blockSteps: make([]int64, n), misses: misses}
	for i, n := range p.toks {
		shared := int(p.full[i] - private[i])
		// The last token is always computed: at most (n−1)/bs blocks hit.
		cacheable := min(shared*blockSize, (int(n)-1)/blockSize*blockSize)
		out.private[i] = n - int32(max(cacheable, 0))
		out.blockSteps[i] = designated[i]*int64(p.steps[i]) + p.tails.blockSteps(i)
	}
	p.holders = nil
	return out
}

// kvClasses groups a fleet's engines by speed and size, in first-seen
// order.
func (c *Config) kvClasses(workers int) []kvClass {
	dp := max(c.DPSize, 1)
	var out []kvClass
	for i := range workers {
		e := c.engineConfig(i)
		if e.Speed == 0 {
			e.Speed = 1
		}
		j := slices.IndexFunc(out, func(k kvClass) bool { return k.speed == e.Speed && k.blocks == e.NumGPUBlocks })
		if j < 0 {
			out = append(out, kvClass{speed: e.Speed, blocks: e.NumGPUBlocks})
			j = len(out) - 1
		}
		out[j].count += dp
	}
	return out
}

// unequalKV reports whether classes hold caches of more than one size.
func unequalKV(classes []kvClass) bool {
	return slices.ContainsFunc(classes, func(k kvClass) bool { return k.blocks != classes[0].blocks })
}

// kvBound is the KV bound in req/s (see above), 0 when it does not apply
// (nothing to bound, more than two classes).
func kvBound(r *kvRequests, classes []kvClass, eng engine.Config) float64 {
	n := len(r.steps)
	if n == 0 || len(classes) == 0 || len(classes) > 2 || eng.MaxNumSeqs <= 0 {
		return 0
	}
	for _, k := range classes {
		if !(k.speed > 0) || k.blocks <= 0 || k.count <= 0 {
			return 0
		}
	}
	cstar := cheapestPrefillPerToken(eng.MaxNumBatchedTokens)
	var private int64
	for _, p := range r.private {
		private += int64(p)
	}
	pool := float64(max(r.misses-private, 0)) * cstar
	d0 := float64(engine.DecodeTime(0))
	slope := float64(engine.DecodeTime(1)) - d0
	best := math.Inf(1)
	for lambdas := range 1 << len(classes) {
		cost := func(i, c int) float64 {
			k := classes[c]
			lam := float64(lambdas >> c & 1)
			steps, blocks := float64(r.steps[i]), float64(r.blockSteps[i])
			return (cstar*float64(r.private[i]) + d0*(lam*steps/float64(eng.MaxNumSeqs)+(1-lam)*blocks/float64(k.blocks)) + slope*blocks/float64(k.blocks)) / k.speed
		}
		if t := leastTime(n, classes, cost, pool); t > 0 {
			best = min(best, float64(n)/(t/float64(time.Second)))
		}
	}
	if math.IsInf(best, 1) {
		return 0
	}
	return best
}

// leastTime is the least run length T, in ns, for which the requests
// (cost(i, c) on class c, in that class's time) and pool (work at speed
// 1, divisible) fit the classes' capacities, count × T each.
func leastTime(n int, classes []kvClass, cost func(i, c int) float64, pool float64) float64 {
	if len(classes) == 1 {
		k := classes[0]
		var sum float64
		for i := range n {
			sum += cost(i, 0)
		}
		return (sum + pool/k.speed) / float64(k.count)
	}
	// Items in the order the first class should take them: the least
	// cost there per cost on the second first; the pool is the last item.
	type item struct{ a, b float64 }
	items := make([]item, 0, n+1)
	var upper float64
	for i := range n {
		it := item{cost(i, 0), cost(i, 1)}
		items = append(items, it)
		upper += max(it.a, it.b)
	}
	items = append(items, item{pool / classes[0].speed, pool / classes[1].speed})
	upper += max(items[n].a, items[n].b)
	slices.SortFunc(items, func(x, y item) int {
		// x.a/x.b < y.a/y.b without dividing by a zero.
		switch l, r := x.a*y.b, y.a*x.b; {
		case l < r:
			return -1
		case l > r:
			return 1
		}
		return 0
	})
	fits := func(t float64) bool {
		room, rest := float64(classes[0].count)*t, 0.0
		for _, it := range items {
			switch {
			case it.a <= room:
				room -= it.a
			case room > 0:
				rest += (1 - room/it.a) * it.b
				room = 0
			default:
				rest += it.b
			}
		}
		return rest <= float64(classes[1].count)*t
	}
	lo, hi := 0.0, upper
	if hi <= 0 {
		return 0
	}
	for range 100 {
		mid := (lo + hi) / 2
		if fits(mid) {
			hi = mid
		} else {
			lo = mid
		}
	}
	return hi
}
