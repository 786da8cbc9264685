package bench

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"time"

	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/internal/serve"
	"github.com/kvrouter/kvrouter/mocker/fleet"
)

// OverheadConfig sets up `kvrouter bench overhead`.
type OverheadConfig struct {
	Workers     int
	Speedup     float64
	Concurrency int // streams kept open
	ISL, OSL    int // prompt and output tokens of the streaming phase
	Duration    time.Duration
	Warmup      time.Duration
	// Short-completion throughput phase: ShortISL-token prompts, one output
	// token, not streamed, ShortConcurrency clients.
	ShortISL, ShortConcurrency int
	Seed                       uint64
}

// DefaultOverheadConfig is the reference load.
func DefaultOverheadConfig() OverheadConfig {
	return OverheadConfig{Workers: 4, Speedup: 1000, Concurrency: 200, ISL: 8192, OSL: 16, Duration: 15 * time.Second, Warmup: 3 * time.Second,
		ShortISL: 32, ShortConcurrency: 64, Seed: 1}
}

// Phase is one measured load.
type Phase struct {
	Requests   int     `json:"requests"`
	Errors     int     `json:"errors"`
	RequestsPS float64 `json:"requests_per_s"`
	TTFTp50ms  float64 `json:"ttft_p50_ms"`
	TTFTp99ms  float64 `json:"ttft_p99_ms"`
	TTFTmeanMs float64 `json:"ttft_mean_ms"`
	E2Ep50ms   float64 `json:"e2e_p50_ms"`
	E2Ep99ms   float64 `json:"e2e_p99_ms"`
	// Frontend* are what the kvrouter frontend reported holding each
	// request before the engine got it (routed phases only).
	FrontendP50ms float64 `json:"frontend_p50_ms,omitempty"`
	FrontendP99ms float64 `json:"frontend_p99_ms,omitempty"`
	DurationSec   float64 `json:"duration_s"`
}

// OverheadResult compares the same load sent straight to the engines and
// through the router.
type OverheadResult struct {
	Direct      Phase   `json:"direct"`
	Routed      Phase   `json:"routed"`
	AddedP50ms  float64 `json:"added_ttft_p50_ms"`
	AddedP99ms  float64 `json:"added_ttft_p99_ms"`
	ShortDirect Phase   `json:"short_direct"`
	ShortRouted Phase   `json:"short_routed"`
	Config      OverheadConfig
}

// RunOverhead measures what the frontend adds. Both phases run in this
// process against the same engines, so they share the machine equally;
// prompts are unique (no prefix is ever cached), so routing choices cannot
// change the engines' work, and round-robin spreads the direct load the
// way an even router would.
func RunOverhead(ctx context.Context, cfg OverheadConfig, progress io.Writer) (OverheadResult, error) {
	fcfg := fleet.DefaultConfig()
	fcfg.NumWorkers, fcfg.SpeedupRatio = cfg.Workers, cfg.Speedup
	fcfg.HTTPPort, fcfg.KVEventsPort, fcfg.KVEventsReplayPort = 0, 0, 0
	fcfg.Server.MaxModelLen = 1 << 20
	f, err := fleet.Start(ctx, fcfg)
	if err != nil {
		return OverheadResult{}, err
	}
	defer f.Close()
	workers := serve.FleetWorkers(f, fcfg)
	var direct []string
	for _, w := range workers {
		direct = append(direct, w.URL)
	}
	rcfg := router.DefaultConfig()
	rcfg.QueueThreshold = nil // measure the path, not admission control
	s, err := serve.Start(ctx, serve.Config{Router: rcfg, Workers: workers, Addr: "127.0.0.1:0"})
	if err != nil {
		return OverheadResult{}, err
	}
	defer s.Close()
	ready, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := s.WaitReady(ready); err != nil {
		return OverheadResult{}, err
	}
	routed := []string{"http://" + s.Addr()}

	res := OverheadResult{Config: cfg}
	run := func(name string, targets []string, isl, osl, conc int, stream bool) (Phase, error) {
		if progress != nil {
			fmt.Fprintf(progress, "overhead: %s, %d clients, %d-token prompts, %d output tokens...\n", name, conc, isl, osl)
		}
		return loadPhase(ctx, targets, fcfg.Server.Model, isl, osl, conc, stream, targets[0] == routed[0], cfg.Warmup, cfg.Duration, cfg.Seed)
	}
	if res.Direct, err = run("direct to the engines", direct, cfg.ISL, cfg.OSL, cfg.Concurrency, true); err != nil {
		return res, err
	}
	if res.Routed, err = run("through the router", routed, cfg.ISL, cfg.OSL, cfg.Concurrency, true); err != nil {
		return res, err
	}
	res.AddedP50ms = res.Routed.TTFTp50ms - res.Direct.TTFTp50ms
	res.AddedP99ms = res.Routed.TTFTp99ms - res.Direct.TTFTp99ms
	if res.ShortDirect, err = run("short completions, direct", direct, cfg.ShortISL, 1, cfg.ShortConcurrency, false); err != nil {
		return res, err
	}
	if res.ShortRouted, err = run("short completions, through the router", routed, cfg.ShortISL, 1, cfg.ShortConcurrency, false); err != nil {
		return res, err
	}
	return res, nil
}

// loadPhase keeps conc clients busy against targets (round-robin) and
// measures after warmup.
func loadPhase(ctx context.Context, targets []string, model string, isl, osl, conc int, stream, timing bool, warmup, duration time.Duration, seed uint64) (Phase, error) {
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: conc}}
	defer client.CloseIdleConnections()
	type sample struct{ ttft, e2e, held float64 }
	rngs := make([]*rand.Rand, conc)
	for c := range rngs {
		rngs[c] = rand.New(rand.NewPCG(seed, uint64(c)+7))
	}
	w, _ := ClosedLoop(ctx, conc, warmup, duration, func(ctx context.Context, c, i int) (sample, error) {
		prompt := randomTokens(rngs[c], isl)
		t0 := time.Now()
		res, err := send(ctx, client, targets[(c+i)%len(targets)], model, prompt, osl, stream, timing)
		return sample{float64(res.ttft.Microseconds()) / 1e3, float64(time.Since(t0).Microseconds()) / 1e3, res.frontendMS}, err
	})
	var ttfts, e2es, held []float64
	for _, s := range w.Samples {
		ttfts, e2es = append(ttfts, s.ttft), append(e2es, s.e2e)
		if s.held >= 0 {
			held = append(held, s.held)
		}
	}
	elapsed := w.Elapsed
	p := Phase{
		Requests: len(ttfts), Errors: w.Errors, RequestsPS: float64(len(ttfts)) / elapsed.Seconds(),
		TTFTmeanMs: Mean(ttfts), TTFTp50ms: Percentile(ttfts, 50), TTFTp99ms: Percentile(ttfts, 99),
		E2Ep50ms: Percentile(e2es, 50), E2Ep99ms: Percentile(e2es, 99), DurationSec: elapsed.Seconds(),
		FrontendP50ms: Percentile(held, 50), FrontendP99ms: Percentile(held, 99),
	}
	if p.Requests == 0 && w.FirstErr != nil {
		return p, fmt.Errorf("no request succeeded: %w", w.FirstErr)
	}
	return p, nil
}
