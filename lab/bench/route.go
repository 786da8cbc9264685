package bench

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"runtime"
	"slices"
	"strconv"
	"time"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
)

// RouteConfig sets up `kvrouter bench route`.
type RouteConfig struct {
	ISL           int // prompt tokens per request
	Workers       int // engines, one rank each
	BlockSize     int // tokens per KV block
	Conversations int // cached conversations per worker in the warm index
	SystemTokens  int // system prompt shared by every conversation
	InFlight      int // requests kept booked while measuring
	// Warmup decisions are routed, untimed, after the in-flight set is
	// filled. Predict-on-route's index grows for its confirm window (2 s)
	// before expiries balance bookings; a short run at the bench's rate
	// measures only that first fill, which a router goes through once.
	Warmup       int
	Iterations   int // measured decisions
	EventThreads int // --router-event-threads
	// PredictedTTL is the router's predict-on-route TTL (0: off). Its cost
	// lands in book and free: each decision indexes its prompt as predicted
	// and each completed prefill settles it.
	PredictedTTL time.Duration
	Seed         uint64
	// ThreadCPU also times each decision by its thread's CPU time, which
	// leaves out the time other processes hold the core: on a shared
	// machine the wall clock's tail is theirs, not the router's. After each
	// decision it times a fixed computation of about a decision's length
	// the same way (the floor): what the machine adds to any span of that
	// length (interrupts, a hypervisor's exits) shows in the floor's tail
	// as much as in the decisions'.
	ThreadCPU bool
}

// DefaultRouteConfig is the reference setup: 8,192-token prompts
// over 64 workers.
func DefaultRouteConfig() RouteConfig {
	return RouteConfig{ISL: 8192, Workers: 64, BlockSize: 16, Conversations: 8, SystemTokens: 1024, InFlight: 128, Iterations: 20000, EventThreads: 4,
		PredictedTTL: router.DefaultPredictedTTL, Seed: 1}
}

// RouteResult is what `kvrouter bench route` prints.
type RouteResult struct {
	RouteP50us    float64 `json:"route_p50_us"`
	RouteP99us    float64 `json:"route_p99_us"`
	RouteMeanus   float64 `json:"route_mean_us"`
	HashP50us     float64 `json:"hash_p50_us"`
	FindP50us     float64 `json:"find_matches_p50_us"`
	ScheduleP50us float64 `json:"schedule_p50_us"`
	// Schedule is scoring plus booking; free (marking the prefill done and
	// freeing the oldest booked request) is outside the router's timings,
	// timed by the bench. Means add up where medians do not.
	ScoreP50us float64 `json:"score_p50_us"`
	BookP50us  float64 `json:"book_p50_us"`
	FreeP50us  float64 `json:"free_p50_us"`
	// The same span by the thread's CPU time (ThreadCPU), which includes
	// half of each of the two clock reads around it.
	CPUP50us      float64 `json:"cpu_p50_us,omitempty"`
	CPUP99us      float64 `json:"cpu_p99_us,omitempty"`
	CPUMeanus     float64 `json:"cpu_mean_us,omitempty"`
	FloorP50us    float64 `json:"floor_p50_us,omitempty"`
	FloorP99us    float64 `json:"floor_p99_us,omitempty"`
	FloorMeanus   float64 `json:"floor_mean_us,omitempty"`
	Split         Split   `json:"mean_split_us"`
	DecisionsPerS float64 `json:"decisions_per_sec"`
	HitRate       float64 `json:"hit_rate"`
	IndexedPairs  uint64  `json:"indexed_pairs"`
	Iterations    int     `json:"iterations"`
	Workers       int     `json:"workers"`
	ISL           int     `json:"isl"`
	Seed          uint64  `json:"seed"`
}

// Split is the mean time of each stage of a routing decision, µs. Other
// is the rest of the decision's span, which no stage's timer covers:
// mostly listing the candidates (every worker's load and overlap), which
// grows with the fleet. The five stages and Other add up to the mean.
type Split struct {
	Hash        float64 `json:"hash"`
	FindMatches float64 `json:"find_matches"`
	Score       float64 `json:"score"`
	Book        float64 `json:"book"`
	Free        float64 `json:"free"`
	Other       float64 `json:"other"`
}

// RunRoute measures whole routing decisions. The warm index holds, on every
// worker, conversations that start with one shared system prompt. Half of
// the measured requests continue a cached conversation (three quarters of
// the prompt cached on one worker), half start a new one (only the system
// prompt cached, everywhere). Each decision books the request and frees the
// oldest of InFlight booked ones, so the load tracker is never empty; the
// timed span covers hashing, matching, scoring, booking and freeing.
func RunRoute(cfg RouteConfig, progress io.Writer) (RouteResult, error) {
	if cfg.BlockSize < 1 || cfg.ISL < cfg.BlockSize || cfg.SystemTokens < 0 || cfg.SystemTokens > cfg.ISL ||
		cfg.Workers < 1 || cfg.Iterations < 1 || cfg.InFlight < 1 || cfg.Conversations < 1 {
		return RouteResult{}, fmt.Errorf("bench route: need block size ≥ 1, isl ≥ block size, 0 ≤ system tokens ≤ isl, workers, iterations, in-flight and conversations ≥ 1")
	}
	rcfg := router.DefaultConfig()
	rcfg.BlockSize = cfg.BlockSize
	rcfg.EventThreads = cfg.EventThreads
	rcfg.PredictedTTL = cfg.PredictedTTL
	rcfg.Rand = rand.New(rand.NewPCG(cfg.Seed, 99))
	r, err := router.New(rcfg)
	if err != nil {
		return RouteResult{}, err
	}
	for id := range cfg.Workers {
		r.AddWorker(router.WorkerInfo{ID: uint64(id), TotalKVBlocks: 16384, MaxNumBatchedTokens: 8192})
	}
	rng := rand.New(rand.NewPCG(cfg.Seed, 1))
	system := randomTokens(rng, cfg.SystemTokens)
	hasher := blockhash.New(cfg.BlockSize, "")
	type conv struct {
		worker uint64
		tokens []uint32
	}
	var convs []conv
	engineID := uint64(1)
	for wid := range cfg.Workers {
		for range cfg.Conversations {
			toks := append(slices.Clone(system), randomTokens(rng, cfg.ISL-cfg.SystemTokens)...)
			local := hasher.LocalHashes(toks)
			blocks := make([]kv.Block, len(local))
			for i, l := range local {
				blocks[i] = kv.Block{EngineHash: engineID, LocalHash: l}
				engineID++
			}
			ev := kv.StoredEvent(kv.Worker{ID: uint64(wid)}, 0, nil, blocks...)
			if err := r.ApplyEvent(&ev); err != nil {
				return RouteResult{}, err
			}
			convs = append(convs, conv{uint64(wid), toks})
		}
	}
	fmt.Fprintf(progress, "warm index: %d workers, %d conversations, %d pairs\n", cfg.Workers, len(convs), r.Stats().IndexedPairs)

	// Prompts are built before timing starts: the bench measures the
	// router, not the token generator.
	const pool = 512
	prompts := make([][]uint32, pool)
	for i := range prompts {
		if i%2 == 0 {
			c := convs[rng.IntN(len(convs))]
			cached := cfg.ISL * 3 / 4
			prompts[i] = append(slices.Clone(c.tokens[:cached]), randomTokens(rng, cfg.ISL-cached)...)
		} else {
			prompts[i] = append(slices.Clone(system), randomTokens(rng, cfg.ISL-cfg.SystemTokens)...)
		}
	}

	ctx := context.Background()
	total := make([]float64, 0, cfg.Iterations)
	hash := make([]float64, 0, cfg.Iterations)
	find := make([]float64, 0, cfg.Iterations)
	schedule := make([]float64, 0, cfg.Iterations)
	score := make([]float64, 0, cfg.Iterations)
	booking := make([]float64, 0, cfg.Iterations)
	free := make([]float64, 0, cfg.Iterations)
	other := make([]float64, 0, cfg.Iterations)
	var cpu, floor []float64
	var sink uint64 // floorWork's results, kept so that its loop stays
	if cfg.ThreadCPU {
		if _, ok := threadCPU(); !ok {
			return RouteResult{}, fmt.Errorf("bench route: the thread's CPU time cannot be read here")
		}
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		cpu = make([]float64, 0, cfg.Iterations)
		floor = make([]float64, 0, cfg.Iterations)
	}
	ring := make([]string, cfg.InFlight)
	var overlap, blocks int
	start := time.Now()
	lastReport := start
	// A router hashes tokens it has just decoded from the request's body,
	// still in the core's caches; the pool's 16 MB are not, once the index
	// has been read. Each prompt is copied in as the frontend would have
	// written it, outside the timed span.
	tokens := make([]uint32, 0, cfg.ISL)
	untimed := cfg.InFlight + cfg.Warmup
	for i := range untimed + cfg.Iterations {
		id := strconv.Itoa(i)
		tokens = append(tokens[:0], prompts[i%pool]...)
		req := router.Request{ID: id, Tokens: tokens}
		var c0 time.Duration
		if cfg.ThreadCPU {
			c0, _ = threadCPU()
		}
		t0 := time.Now()
		d, err := r.BestWorker(ctx, &req)
		if err != nil {
			return RouteResult{}, err
		}
		tf := time.Now()
		r.MarkPrefillCompleted(id)
		slot := i % max(1, cfg.InFlight)
		if old := ring[slot]; old != "" {
			r.Free(old)
		}
		ring[slot] = id
		end := time.Now()
		var c1 time.Duration
		if cfg.ThreadCPU {
			c1, _ = threadCPU()
		}
		elapsed, freeing := end.Sub(t0), end.Sub(tf)
		if i < untimed {
			continue // filling the in-flight set, warming up
		}
		if cfg.ThreadCPU {
			cpu = append(cpu, us(c1-c0))
			f0, _ := threadCPU()
			sink += floorWork()
			f1, _ := threadCPU()
			floor = append(floor, us(f1-f0))
		}
		total = append(total, us(elapsed))
		hash = append(hash, us(d.Timings.Hash))
		find = append(find, us(d.Timings.FindMatches))
		schedule = append(schedule, us(d.Timings.Schedule))
		score = append(score, us(d.Timings.Schedule-d.Timings.Book))
		booking = append(booking, us(d.Timings.Book))
		free = append(free, us(freeing))
		other = append(other, us(elapsed-d.Timings.Hash-d.Timings.FindMatches-d.Timings.Schedule-freeing))
		overlap += d.OverlapBlocks
		blocks += d.PromptBlocks
		if progress != nil && time.Since(lastReport) > time.Second {
			lastReport = time.Now()
			fmt.Fprintf(progress, "route: %d/%d decisions\n", len(total), cfg.Iterations)
		}
	}
	wall := time.Since(start)
	runtime.KeepAlive(sink)
	// Means first: Percentile sorts in place.
	split := Split{Hash: Mean(hash), FindMatches: Mean(find), Score: Mean(score), Book: Mean(booking), Free: Mean(free), Other: Mean(other)}
	res := RouteResult{
		RouteP50us: Percentile(total, 50), RouteP99us: Percentile(total, 99), RouteMeanus: Mean(total),
		HashP50us: Percentile(hash, 50), FindP50us: Percentile(find, 50), ScheduleP50us: Percentile(schedule, 50),
		ScoreP50us: Percentile(score, 50), BookP50us: Percentile(booking, 50), FreeP50us: Percentile(free, 50), Split: split,
		DecisionsPerS: float64(untimed+cfg.Iterations) / wall.Seconds(),
		HitRate:       float64(overlap) / float64(max(1, blocks)),
		IndexedPairs:  r.Stats().IndexedPairs,
		CPUMeanus:     Mean(cpu), CPUP50us: Percentile(cpu, 50), CPUP99us: Percentile(cpu, 99),
		FloorMeanus: Mean(floor), FloorP50us: Percentile(floor, 50), FloorP99us: Percentile(floor, 99),
		Iterations: cfg.Iterations, Workers: cfg.Workers, ISL: cfg.ISL, Seed: cfg.Seed,
	}
	return res, nil
}

// floorWork is a fixed chain of multiplies, about 10 µs, that touches no
// memory: its time varies only with the machine.
func floorWork() uint64 {
	x := uint64(0x9e3779b97f4a7c15)
	for i := range uint64(5000) {
		x = x*0xbf58476d1ce4e5b9 + i
		x ^= x >> 31
	}
	return x
}

func randomTokens(rng *rand.Rand, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(rng.IntN(128000))
	}
	return out
}

func us(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }

// Percentile sorts xs in place and returns the p-th percentile (nearest rank).
func Percentile(xs []float64, p float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	slices.Sort(xs)
	i := int(float64(len(xs))*p/100+0.5) - 1
	return xs[min(max(i, 0), len(xs)-1)]
}

// Mean is the arithmetic mean of xs, 0 for none.
func Mean(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := 0.0
	for _, x := range xs {
		s += x
	}
	return s / float64(len(xs))
}
