package bench

import (
	"io"
	"testing"
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
