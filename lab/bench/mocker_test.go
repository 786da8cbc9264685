package bench

import (
	"context"
	"io"
	"testing"
	"time"
)

func TestRunMockerSmall(t *testing.T) {
	cfg := DefaultMockerConfig()
	cfg.Workers, cfg.Concurrency, cfg.Speedup = 2, 6, 50
	cfg.Duration, cfg.Warmup = 700*time.Millisecond, 100*time.Millisecond
	cfg.SystemTokens, cfg.MinUser, cfg.MaxUser, cfg.MinOutput, cfg.MaxOutput = 64, 16, 64, 4, 16
	res, err := RunMocker(context.Background(), cfg, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if res.Requests == 0 || res.Errors != 0 || res.Steps == 0 || res.ModelSeconds <= 0 || res.ActualSeconds <= 0 {
		t.Fatalf("implausible result %+v", res)
	}
}
