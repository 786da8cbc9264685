package sched

import (
	"fmt"
	"math"
	"slices"
	"strings"
	"sync/atomic"
)

// Mode names a routing strategy, as spelled by --router-mode.
type Mode string

const (
	ModeKV          Mode = "kv"
	ModeRoundRobin  Mode = "round-robin"
	ModeRandom      Mode = "random"
	ModeDirect      Mode = "direct"
	ModeLeastLoaded Mode = "least-loaded"
	ModePowerOfTwo  Mode = "power-of-two"
	// ModeDeviceAwareWeighted shares requests between CPU and accelerator
	// workers by their throughput ratio (Dynamo's device-aware-weighted).
	ModeDeviceAwareWeighted Mode = "device-aware-weighted"
)

// policy picks one of cands, which the Scheduler has already checked to be
// non-empty and free of busy workers. It returns an index into cands.
type policy interface {
	pick(req *Request, cands []Candidate, rng Rand) (int, error)
}

// policies is the one place where modes are bound to their
// implementations: adding a mode means adding a line here.
var policies = map[Mode]func() policy{
	ModeKV:          func() policy { return kvPolicy{} },
	ModeRoundRobin:  func() policy { return &roundRobin{} },
	ModeRandom:      func() policy { return randomPolicy{} },
	ModeDirect:      func() policy { return directPolicy{} },
	ModeLeastLoaded: func() policy { return leastLoaded{} },
	ModePowerOfTwo:  func() policy { return powerOfTwo{} },

	ModeDeviceAwareWeighted: func() policy { return &deviceAware{ratio: DefaultNonCPUToCPURatio} },

	ModeSGLangCacheAware: newSGLangCacheAware,
	ModeLLMDPrecise:      func() policy { return llmdPrecise{} },
	ModeGIEApproxPrefix:  newGIEApproxPrefix,
}

// Modes lists the valid mode names in sorted order.
func Modes() []Mode {
	out := make([]Mode, 0, len(policies))
	for m := range policies {
		out = append(out, m)
	}
	slices.Sort(out)
	return out
}

// ParseMode reads a --router-mode value; case and surrounding space are
// ignored because flags and environment variables are typed by hand.
func ParseMode(s string) (Mode, error) {
	m := Mode(strings.ToLower(strings.TrimSpace(s)))
	if _, ok := policies[m]; ok {
		return m, nil
	}
	names := make([]string, 0, len(policies))
	for _, m := range Modes() {
		names = append(names, string(m))
	}
	return "", fmt.Errorf("sched: unknown router mode %q (valid: %s)", s, strings.Join(names, ", "))
}

type kvPolicy struct{}

func (kvPolicy) pick(req *Request, cands []Candidate, rng Rand) (int, error) {
	p := &req.Params
	var lightest Lightest
	if req.Lightest != nil {
		lightest = *req.Lightest
	} else {
		lightest = LightestOf(cands)
	}
	lightest.OSL, lightest.MeanOSL = req.OSL, req.meanOSL
	if p.Temperature == 0 && lightest.SecondsPerToken > 0 {
		return pickMin(len(cands), func(i int) float64 {
			return p.Cost(&cands[i], req.ISL, req.BlockSize, lightest)
		}, rng), nil
	}
	if p.Temperature == 0 {
		// pickMin's closure would cost a call per worker of every
		// decision: find the cheapest inline, and leave ties to pickMin.
		best, ties, lo := 0, 0, math.Inf(1)
		for i := range cands {
			c := &cands[i]
			own, shared := p.OverlapCredit*float64(c.OverlapBlocks), 0.0
			if !p.deviceOnly(c) {
				own, shared = p.wholeCredit(c, req.ISL, req.BlockSize, lightest)
			}
			switch cost := p.total(p.prefill(c, req.ISL, req.BlockSize, own+shared), p.affinity(c, req.BlockSize, lightest, own), c); {
			case cost < lo:
				best, ties, lo = i, 1, cost
			case cost == lo:
				ties++
			}
		}
		if ties <= 1 {
			return best, nil
		}
		return pickMin(len(cands), func(i int) float64 {
			return p.Cost(&cands[i], req.ISL, req.BlockSize, lightest)
		}, rng), nil
	}
	var buf [stackCosts]float64
	costs := buf[:0]
	if len(cands) > stackCosts {
		costs = make([]float64, 0, len(cands))
	}
	for i := range cands {
		costs = append(costs, p.Cost(&cands[i], req.ISL, req.BlockSize, lightest))
	}
	return sampleSoftmax(costs, p.Temperature, rng), nil
}

// roundRobin cycles over the candidates in the order the caller lists
// them; a stable order (e.g. sorted by worker) gives a strict cycle. Each
// pool has its own cycle, advanced by bookings only: a query, or a
// booking in the other pool, would otherwise skip workers of the cycle.
// The counters are shared by all goroutines so that concurrent requests
// still spread.
type roundRobin struct {
	next [PoolPrefill + 1]atomic.Uint64
}

func (r *roundRobin) pick(req *Request, cands []Candidate, _ Rand) (int, error) {
	next := &r.next[min(max(req.Pool, 0), PoolPrefill)]
	if !req.Commit {
		return int(next.Load() % uint64(len(cands))), nil
	}
	return int((next.Add(1) - 1) % uint64(len(cands))), nil
}

type randomPolicy struct{}

func (randomPolicy) pick(_ *Request, cands []Candidate, rng Rand) (int, error) {
	return rng.IntN(len(cands)), nil
}

// directPolicy only sees requests that named no worker: the Scheduler routes
// named ones before any policy runs, in every mode.
type directPolicy struct{}

func (directPolicy) pick(*Request, []Candidate, Rand) (int, error) {
	return 0, ErrNoTarget
}

type leastLoaded struct{}

func (leastLoaded) pick(req *Request, cands []Candidate, rng Rand) (int, error) {
	return pickMin(len(cands), func(i int) float64 { return cands[i].load(req.BlockSize) }, rng), nil
}

// powerOfTwo samples two distinct candidates and keeps the less loaded one,
// which avoids the herding of least-loaded when load figures are stale.
// On a tie the first sample wins; it is random already.
type powerOfTwo struct{}

func (powerOfTwo) pick(req *Request, cands []Candidate, rng Rand) (int, error) {
	n := len(cands)
	if n == 1 {
		return 0, nil
	}
	a := rng.IntN(n)
	b := rng.IntN(n - 1)
	if b >= a {
		b++
	}
	if cands[b].load(req.BlockSize) < cands[a].load(req.BlockSize) {
		return b, nil
	}
	return a, nil
}

// DefaultNonCPUToCPURatio is how many requests one accelerator worker is
// taken to serve for each one a CPU worker serves, as Dynamo's
// DYN_ENCODER_CUDA_TO_CPU_RATIO defaults.
const DefaultNonCPUToCPURatio = 8

// deviceAware splits the fleet into CPU workers and the others and keeps
// the requests in flight on the CPU side within a budget: a CPU worker
// may hold 1/ratio of what an accelerator worker holds on average. When
// the CPU side is under budget the request goes there, otherwise to the
// accelerators; within the side, to the worker with the fewest requests
// in flight (ties at random). Counting requests rather than blocks is
// Dynamo's measure, and the budget's integer arithmetic is its too: an
// idle fleet starts on the accelerators, and the CPU side gets work only
// once they hold ratio requests per CPU worker. A fleet of one kind is
// least-loaded by requests.
type deviceAware struct{ ratio int }

func (d *deviceAware) pick(_ *Request, cands []Candidate, rng Rand) (int, error) {
	var cpus, others, cpuLoad, otherLoad int
	for i := range cands {
		if cands[i].CPU {
			cpus++
			cpuLoad += cands[i].ActiveRequests
		} else {
			others++
			otherLoad += cands[i].ActiveRequests
		}
	}
	useCPU := others == 0
	if cpus > 0 && others > 0 {
		useCPU = cpuLoad < otherLoad*cpus/(d.ratio*others)
	}
	return pickMin(len(cands), func(i int) float64 {
		if cands[i].CPU != useCPU {
			return math.Inf(1)
		}
		return float64(cands[i].ActiveRequests)
	}, rng), nil
}

// SetNonCPUToCPURatio sets device-aware-weighted's throughput ratio of one
// accelerator worker to one CPU worker (DYN_ENCODER_CUDA_TO_CPU_RATIO);
// other modes ignore it. Call it before the first Select.
func (s *Scheduler) SetNonCPUToCPURatio(ratio int) error {
	if ratio < 1 {
		return fmt.Errorf("sched: the accelerator to CPU throughput ratio must be at least 1, got %d", ratio)
	}
	if d, ok := s.policy.(*deviceAware); ok {
		d.ratio = ratio
	}
	return nil
}
