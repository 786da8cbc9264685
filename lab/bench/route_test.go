package bench

import (
	"io"
	"math"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/router"
)

func TestRunRouteSmall(t *testing.T) {
	cfg := DefaultRouteConfig()
	cfg.ISL, cfg.Workers, cfg.Iterations, cfg.Conversations, cfg.SystemTokens, cfg.InFlight = 512, 4, 200, 2, 128, 8
	res, err := RunRoute(cfg, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if res.RouteP50us <= 0 || res.RouteP99us < res.RouteP50us || res.Iterations != 200 {
		t.Fatalf("implausible result %+v", res)
	}
	// Half the prompts continue a cached conversation (3/4 cached), half
	// share only the 8-block system prompt out of 32: hit rate ≈ 0.44.
	if res.HitRate < 0.35 || res.HitRate > 0.55 {
		t.Fatalf("hit rate %.2f outside the workload's expectation", res.HitRate)
	}
}

func TestPercentile(t *testing.T) {
	xs := []float64{5, 1, 4, 2, 3}
	if p := Percentile(xs, 50); p != 3 {
		t.Fatalf("p50 = %v", p)
	}
	if p := Percentile(xs, 100); p != 5 {
		t.Fatalf("p100 = %v", p)
	}
	if Percentile(nil, 50) != 0 {
		t.Fatal("empty")
	}
}

// A thousand workers route, and the stages reported add up to no more than
// the whole decision: each is a part of the span the route time covers;
// with the rest no stage covers, they add up to it.
func TestRunRouteThousandWorkersSplit(t *testing.T) {
	for _, ttl := range []time.Duration{0, router.DefaultPredictedTTL} {
		cfg := DefaultRouteConfig()
		cfg.ISL, cfg.Workers, cfg.Iterations, cfg.Conversations, cfg.SystemTokens, cfg.InFlight = 256, 1000, 300, 1, 64, 8
		cfg.PredictedTTL = ttl
		res, err := RunRoute(cfg, io.Discard)
		if err != nil {
			t.Fatal(err)
		}
		s := res.Split
		if res.Workers != 1000 || res.IndexedPairs != 1000*16 {
			t.Fatalf("predicted TTL %v: %d workers, %d pairs", ttl, res.Workers, res.IndexedPairs)
		}
		if s.Hash <= 0 || s.FindMatches <= 0 || s.Score <= 0 || s.Book <= 0 || s.Free <= 0 {
			t.Errorf("predicted TTL %v: a stage took no time: %+v", ttl, s)
		}
		if sum := s.Hash + s.FindMatches + s.Score + s.Book + s.Free; sum > res.RouteMeanus*(1+1e-9) {
			t.Errorf("predicted TTL %v: stages sum to %.2f µs, more than the %.2f µs decision", ttl, sum, res.RouteMeanus)
		}
		if sum := s.Hash + s.FindMatches + s.Score + s.Book + s.Free + s.Other; math.Abs(sum-res.RouteMeanus) > 1e-6*res.RouteMeanus {
			t.Errorf("predicted TTL %v: stages and the rest sum to %.4f µs, not the %.4f µs decision", ttl, sum, res.RouteMeanus)
		}
		if res.ScoreP50us <= 0 || res.BookP50us <= 0 || res.FreeP50us <= 0 {
			t.Errorf("predicted TTL %v: p50s %+v", ttl, res)
		}
	}
}

// --thread-cpu times each decision and the floor after it by the thread's
// CPU time; --warmup routes untimed decisions first, the measured count
// unchanged.
func TestRunRouteThreadCPUAndWarmup(t *testing.T) {
	if _, ok := threadCPU(); !ok {
		t.Skip("no thread CPU clock here")
	}
	cfg := DefaultRouteConfig()
	cfg.ISL, cfg.Workers, cfg.Iterations, cfg.Conversations, cfg.SystemTokens, cfg.InFlight = 512, 4, 200, 2, 128, 8
	cfg.ThreadCPU, cfg.Warmup = true, 300
	res, err := RunRoute(cfg, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if res.Iterations != 200 || res.CPUP50us <= 0 || res.CPUP99us < res.CPUP50us || res.CPUMeanus <= 0 {
		t.Fatalf("thread CPU figures implausible: %+v", res)
	}
	if res.FloorP50us <= 0 || res.FloorP99us < res.FloorP50us || res.FloorMeanus <= 0 {
		t.Fatalf("floor figures implausible: %+v", res)
	}
}
