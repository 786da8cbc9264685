package sim

import (
	"cmp"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/mocker/fleet"
)

// SweepConfig is a sweep: every mode at every arrival speedup, then each
// mode's goodput; the comments name the flags of `kvrouter sim`.
type SweepConfig struct {
	Sim   Config
	Modes []string // --modes
	// WorkerCounts sweeps the fleet size (--workers 4,8,16): every mode at
	// every load on each; empty = Sim.Workers alone.
	WorkerCounts    []int
	ArrivalSpeedups []float64     // --arrival-speedup
	SLOTTFTP90      time.Duration // --slo-ttft-p90
	SLOITLP90       time.Duration // --slo-itl-p90; 0 = no ITL objective
	// BisectSteps is how many runs refine each goodput between the tested
	// speedups around it; each halves the interval. 0 = none: the goodput
	// is then the highest tested speedup meeting the SLO below the first
	// missing it (DefaultBisectSteps is the command's default).
	BisectSteps int
	// Parallel bounds the runs simulated at once; 0 = GOMAXPROCS.
	Parallel int
	// Progress receives one line per run; it is called from the modes'
	// goroutines, one call at a time.
	Progress func(line string)
}

// DefaultBisectSteps narrows the goodput to 1/64 of the interval between
// the two tested loads around it: under 1 % of the load at a typical
// 2 → 4 step.
const DefaultBisectSteps = 6

// ModeResult is results.json's modes.<mode>.
type ModeResult struct {
	// GoodputRPS is the highest arrival rate (requests per second of model
	// time) at which the mode meets the SLO.
	GoodputRPS            float64 `json:"goodput_rps"`
	GoodputArrivalSpeedup float64 `json:"goodput_arrival_speedup"`
	// GoodputBound says when the goodput is only a bound: "at least" when
	// even the highest tested load met the SLO.
	GoodputBound string  `json:"goodput_bound,omitempty"`
	Points       []Point `json:"points"`
	// Probes are the bisection's runs, in the order run.
	Probes []Point `json:"probes,omitempty"`
	// ByWorkers is the same per fleet size when the sweep had several
	// (--workers 4,8,16); the fields above are then the first size's.
	ByWorkers []FleetResult `json:"by_workers,omitempty"`
}

// FleetResult is one mode on one fleet size of a sweep over sizes.
type FleetResult struct {
	Workers               int     `json:"workers"`
	GoodputRPS            float64 `json:"goodput_rps"`
	GoodputArrivalSpeedup float64 `json:"goodput_arrival_speedup"`
	GoodputBound          string  `json:"goodput_bound,omitempty"`
	Points                []Point `json:"points"`
	Probes                []Point `json:"probes,omitempty"`
}

// RunConfig is results.json's config: what was run.
type RunConfig struct {
	Workload        string    `json:"workload"`
	Requests        int       `json:"requests"`
	SpanS           float64   `json:"span_s"` // the workload's arrival span at speedup 1
	Modes           []string  `json:"modes"`
	Workers         int       `json:"workers"`
	WorkerCounts    []int     `json:"worker_counts,omitempty"` // a sweep over fleet sizes
	DPSize          int       `json:"data_parallel_size"`
	ArrivalSpeedups []float64 `json:"arrival_speedups"`
	SLOTTFTP90MS    float64   `json:"slo_ttft_p90_ms"`
	SLOITLP90MS     float64   `json:"slo_itl_p90_ms,omitempty"`
	Seed            uint64    `json:"seed"`
	BlockSize       int       `json:"block_size"`
	NumGPUBlocks    int       `json:"num_gpu_blocks"`
	MaxBatched      int       `json:"max_num_batched_tokens"`
	KVEventDelayMS  float64   `json:"kv_event_delay_ms"`
	MetricsMS       float64   `json:"engine_metrics_interval_ms"`
	CeilingHitRate  float64   `json:"ceiling_hit_rate"`
	// FleetCeilingHitRate is the hit rate of one LRU cache as large as the
	// first fleet's KV caches together: what the fleet's memory allows
	// (replay.NewPooledCeiling).
	FleetCeilingHitRate float64 `json:"fleet_ceiling_hit_rate"`
	// PrefillBoundRPS is the rate no policy can sustain on the first fleet
	// size (PrefillBoundRPS, the function): a bound on every goodput.
	PrefillBoundRPS float64 `json:"prefill_bound_rps"`
	// EngineBoundRPS is the tighter bound that charges decode steps too
	// (EngineBoundRPS, the function).
	EngineBoundRPS float64 `json:"engine_bound_rps"`
	// KVBoundRPS is the engine bound with each engine's blocks charged at
	// its own KV size and each request's work on one engine (kvBound), on
	// a fleet of unequal KV sizes; 0 otherwise. EngineBoundRPS is the
	// lower of the two.
	KVBoundRPS float64 `json:"kv_bound_rps,omitempty"`
	Command    string  `json:"command,omitempty"`
	// Fleet is the unequal engines, in --fleet's syntax, when they were.
	Fleet string `json:"fleet,omitempty"`
	// Disagg is the disaggregated fleet, when it was one (Workers is then
	// its prefill and decode engines together).
	Disagg *DisaggConfig `json:"disagg,omitempty"`
	// Replicas is the router replicas, when several routed or one was
	// measured against a single router (--router-replicas).
	Replicas *ReplicasConfig `json:"replicas,omitempty"`
}

// ReplicasConfig is results.json's config.replicas.
type ReplicasConfig struct {
	Replicas    int     `json:"replicas"`
	Sync        bool    `json:"sync"`
	SyncDelayMS float64 `json:"sync_delay_ms"`
	// Spread is the load balancer's policy: request, burst or session.
	Spread Spread `json:"spread"`
}

// DisaggConfig is results.json's config.disagg.
type DisaggConfig struct {
	PrefillWorkers      int     `json:"prefill_workers"`
	DecodeWorkers       int     `json:"decode_workers"`
	MinUncachedTokens   int     `json:"disagg_min_uncached_tokens"`
	NoAssumeKVReuse     bool    `json:"no_router_assume_kv_reuse"`
	KVBytesPerToken     int     `json:"kv_bytes_per_token"`
	KVTransferBandwidth float64 `json:"kv_transfer_bandwidth"`
}

// Results is results.json. Everything but WallS is a function of the
// inputs: compare two runs with WallS zeroed.
type Results struct {
	Modes  map[string]*ModeResult `json:"modes"`
	Order  []string               `json:"order"`
	Config RunConfig              `json:"config"`
	// ModelS is the model time simulated, every run of every mode summed.
	ModelS float64 `json:"model_s"`
	// WallS is the sweep's wall time, the one field that differs between
	// identical runs.
	WallS float64 `json:"wall_s"`
}

// Sweep runs cfg over w on up to cfg.Parallel cores: every mode's tested
// loads in parallel, then each mode's bisection, whose runs depend on each
// other, beside the other modes'. Each run is the single-threaded loop of
// Run, so a sweep's results do not depend on how many ran at once.
func Sweep(cfg SweepConfig, w Workload) (*Results, error) {
	start := time.Now()
	if len(cfg.Modes) == 0 || len(cfg.ArrivalSpeedups) == 0 {
		return nil, fmt.Errorf("sim: need at least one mode and one arrival speedup")
	}
	if cfg.SLOTTFTP90 <= 0 {
		return nil, fmt.Errorf("sim: the TTFT objective must be positive, got %v", cfg.SLOTTFTP90)
	}
	speedups := slices.Clone(cfg.ArrivalSpeedups)
	slices.Sort(speedups)
	speedups = slices.Compact(speedups)
	par := cfg.Parallel
	if par <= 0 {
		par = runtime.GOMAXPROCS(0)
	}
	fleets := slices.Clone(cfg.WorkerCounts)
	if d := cfg.Sim.Disagg; d.Enabled() {
		if len(fleets) > 1 {
			return nil, fmt.Errorf("sim: a sweep over fleet sizes is for aggregated fleets, not %d prefill + %d decode engines", d.PrefillWorkers, d.DecodeWorkers)
		}
		if err := d.validate(); err != nil {
			return nil, err
		}
		// The sim counts them; Workers is what the report says.
		cfg.Sim.Workers, fleets = d.PrefillWorkers+d.DecodeWorkers, nil
	}
	if len(fleets) == 0 {
		fleets = []int{cfg.Sim.Workers}
	}
	nm := len(cfg.Modes)
	bar := &progressBar{out: cfg.Progress, start: start, total: len(fleets) * nm * (len(speedups) + max(cfg.BisectSteps, 0))}
	// One job per fleet size and mode, any order: job j is fleet j/nm,
	// mode j%nm.
	results := make([]*ModeResult, len(fleets)*nm)
	errs := make([]error, len(results))
	// The semaphore bounds runs, not modes: a mode's loads run side by
	// side, then its bisection one run at a time, each run the
	// deterministic loop of Run, so the results are the serial sweep's.
	sem := make(chan struct{}, par)
	var wg sync.WaitGroup
	for j := range results {
		wg.Add(1)
		go func() {
			defer wg.Done()
			fc := cfg
			fc.Sim.Workers = fleets[j/nm]
			results[j], errs[j] = sweepMode(&fc, cfg.Modes[j%nm], w, speedups, bar, sem)
		}()
	}
	var b fleetBounds
	speed, _, _ := cfg.Sim.fleetSize(fleets[0])
	wg.Add(1)
	go func() {
		defer wg.Done()
		b = boundsOf(&cfg.Sim, w, fleets[0])
	}()
	wg.Wait()
	res := &Results{Modes: map[string]*ModeResult{}}
	for j, mr := range results {
		fleet, mode := fleets[j/nm], cfg.Modes[j%nm]
		if errs[j] != nil {
			return nil, fmt.Errorf("mode %s on %d workers: %w", mode, fleet, errs[j])
		}
		for _, p := range append(slices.Clone(mr.Points), mr.Probes...) {
			res.ModelS += p.ModelS
		}
		if j < nm {
			res.Modes[mode] = mr
			res.Order = append(res.Order, mode)
		}
		if len(fleets) > 1 {
			top := res.Modes[mode]
			top.ByWorkers = append(top.ByWorkers, FleetResult{Workers: fleet, GoodputRPS: mr.GoodputRPS,
				GoodputArrivalSpeedup: mr.GoodputArrivalSpeedup, GoodputBound: mr.GoodputBound, Points: mr.Points, Probes: mr.Probes})
		}
	}
	res.Config = RunConfig{
		Requests: w.Len(), SpanS: Span(w).Seconds(), Modes: slices.Clone(cfg.Modes), Workers: cfg.Sim.Workers, DPSize: max(cfg.Sim.DPSize, 1),
		ArrivalSpeedups: speedups, SLOTTFTP90MS: ms(cfg.SLOTTFTP90), SLOITLP90MS: ms(cfg.SLOITLP90), Seed: cfg.Sim.Seed,
		BlockSize: cfg.Sim.Engine.BlockSize, NumGPUBlocks: cfg.Sim.Engine.NumGPUBlocks, MaxBatched: cfg.Sim.Engine.MaxNumBatchedTokens,
		KVEventDelayMS: ms(cfg.Sim.KVEventDelay), MetricsMS: ms(cfg.Sim.EngineMetricsInterval),
		CeilingHitRate: b.ceiling.Rate(), FleetCeilingHitRate: b.pooled.Rate(),
		PrefillBoundRPS: PrefillBoundRPS(b.ceiling, w.Len(), speed, cfg.Sim.Engine.MaxNumBatchedTokens),
		EngineBoundRPS:  b.engineRPS,
		KVBoundRPS:      b.kvRPS,
		Fleet:           fleet.SpecsString(cfg.Sim.Specs),
	}
	if len(fleets) > 1 {
		res.Config.Workers, res.Config.WorkerCounts = fleets[0], fleets
	}
	if d := cfg.Sim.Disagg; d.Enabled() {
		res.Config.Disagg = &DisaggConfig{PrefillWorkers: d.PrefillWorkers, DecodeWorkers: d.DecodeWorkers, MinUncachedTokens: d.MinUncachedTokens,
			NoAssumeKVReuse: d.NoAssumeKVReuse, KVBytesPerToken: d.KVBytesPerToken, KVTransferBandwidth: d.KVTransferBandwidth}
	}
	if r := cfg.Sim.Replicas; r.Enabled() {
		res.Config.Replicas = &ReplicasConfig{Replicas: r.Count, Sync: !r.NoSync, SyncDelayMS: ms(r.SyncDelay), Spread: cmp.Or(r.Spread, SpreadRequest)}
	}
	res.WallS = time.Since(start).Seconds()
	return res, nil
}

func ms(d time.Duration) float64 { return float64(d) / 1e6 }

func sweepMode(cfg *SweepConfig, mode string, w Workload, speedups []float64, bar *progressBar, sem chan struct{}) (*ModeResult, error) {
	mr := &ModeResult{}
	run := func(s float64, what string) (Point, error) {
		sem <- struct{}{}
		defer func() { <-sem }()
		t0 := time.Now()
		p, err := Run(cfg.Sim, mode, w, s)
		if err != nil {
			return p, err
		}
		p.MeetsSLO = cfg.meets(&p)
		bar.done(1, "%-20s %4d workers %-8s ×%-7.3g %7.2f req/s  TTFT p50 %7.0f p90 %7.0f ms  ITL p90 %5.1f ms  hit %.3f  SLO %-3s  %.1f s model in %.2f s",
			mode, cfg.Sim.Workers, what, s, p.ArrivalRPS, p.TTFT.P50, p.TTFT.P90, p.ITL.P90, p.HitRate, yes(p.MeetsSLO), p.ModelS, time.Since(t0).Seconds())
		return p, nil
	}
	mr.Points = make([]Point, len(speedups))
	errs := make([]error, len(speedups))
	var wg sync.WaitGroup
	for i, s := range speedups {
		wg.Add(1)
		go func() {
			defer wg.Done()
			mr.Points[i], errs[i] = run(s, "point")
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	bisected := 0
	g, err := Goodput(mr.Points, func(s float64) (bool, error) {
		bisected++
		p, err := run(s, "bisect")
		if err != nil {
			return false, err
		}
		mr.Probes = append(mr.Probes, p)
		return p.MeetsSLO, nil
	}, cfg.BisectSteps)
	if err != nil {
		return nil, err
	}
	// A mode that met the SLO at every tested load is not bisected.
	bar.skip(max(cfg.BisectSteps, 0) - bisected)
	mr.GoodputBound = g.Bound
	mr.GoodputRPS, mr.GoodputArrivalSpeedup = carriedRate(append(slices.Clone(mr.Points), mr.Probes...), g.Speedup)
	return mr, nil
}

// progressBar prefixes each run's line with the sweep's progress: a bar of
// runs done out of the runs planned, the time so far and an estimate of the
// time left. Its methods are called from the modes' goroutines.
type progressBar struct {
	out   func(line string)
	start time.Time
	mu    sync.Mutex // guards the fields below and serialises out
	total int
	n     int
}

func (b *progressBar) done(runs int, format string, args ...any) {
	if b.out == nil {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.n += runs
	const width = 24
	fill := width * b.n / max(b.total, 1)
	elapsed := time.Since(b.start)
	left := "?"
	if b.n > 0 {
		left = (time.Duration(float64(elapsed) * float64(b.total-b.n) / float64(b.n))).Round(time.Second).String()
	}
	b.out(fmt.Sprintf("[%s%s] %d/%d runs, %s, ~%s left | %s", strings.Repeat("#", fill), strings.Repeat(".", width-fill),
		b.n, b.total, elapsed.Round(time.Second), left, fmt.Sprintf(format, args...)))
}

// skip drops runs that were planned but will not happen.
func (b *progressBar) skip(runs int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.total -= runs
}

func yes(b bool) string {
	if b {
		return "met"
	}
	return "missed"
}

func (c *SweepConfig) meets(p *Point) bool {
	if p.TTFT.P90 > ms(c.SLOTTFTP90) {
		return false
	}
	return c.SLOITLP90 <= 0 || p.ITL.P90 <= ms(c.SLOITLP90)
}

// carriedRate is the goodput in requests per second: the highest rate
// offered by a run that met the SLO at or below the knee (the speedup
// Goodput found), and that run's speedup. With open-loop arrivals the rate
// grows with the speedup and this is the run at the knee. Closed-loop
// sessions offer what the fleet lets them: past the point where latency
// grows faster than sessions start, a higher speedup offers fewer requests
// a second, so the run at the knee can offer less than one below it that
// the fleet served within the SLO.
func carriedRate(runs []Point, knee float64) (rps, speedup float64) {
	for _, p := range runs {
		if p.MeetsSLO && p.ArrivalSpeedup <= knee && p.ArrivalRPS > rps {
			rps, speedup = p.ArrivalRPS, p.ArrivalSpeedup
		}
	}
	if speedup == 0 {
		speedup = knee
	}
	return rps, speedup
}

// GoodputResult is where the SLO stops being met, in arrival speedup.
type GoodputResult struct {
	Speedup float64
	Bound   string // "at least" when no tested load missed the SLO
}

// Goodput bisects between the highest tested speedup meeting the SLO and
// the first one above it missing it (between 0 and the lowest, when even
// that one misses): steps runs of meets, each halving the interval, and
// the last load known to meet the SLO is the goodput. It assumes, as
// capacity does, that more load never makes latency better; points must
// be sorted by ArrivalSpeedup, with MeetsSLO set.
func Goodput(points []Point, meets func(speedup float64) (bool, error), steps int) (GoodputResult, error) {
	if len(points) == 0 {
		return GoodputResult{}, fmt.Errorf("sim: no points to bisect between")
	}
	first := slices.IndexFunc(points, func(p Point) bool { return !p.MeetsSLO })
	if first < 0 {
		return GoodputResult{Speedup: points[len(points)-1].ArrivalSpeedup, Bound: "at least"}, nil
	}
	lo, hi := 0.0, points[first].ArrivalSpeedup
	if first > 0 {
		lo = points[first-1].ArrivalSpeedup
	}
	for range steps {
		mid := (lo + hi) / 2
		ok, err := meets(mid)
		if err != nil {
			return GoodputResult{}, err
		}
		if ok {
			lo = mid
		} else {
			hi = mid
		}
	}
	return GoodputResult{Speedup: lo}, nil
}
