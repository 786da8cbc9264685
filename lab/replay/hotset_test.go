package replay

import (
	"context"
	"io"
	"testing"
	"time"
)

// The hot set live, on two mocker engines behind kvrouter serve: eight
// conversations cached on the first, twelve clients continuing them. The
// second engine must get a fair share. Timing on a shared machine is too
// noisy to compare latencies here; the simulator's
// TestHotSetDoesNotStarveAnIdleEngine compares them with Dynamo's cost.
func TestHotSetLiveSpreadsOverTheIdleEngine(t *testing.T) {
	if testing.Short() {
		t.Skip("starts fleets")
	}
	cfg := DefaultHotSetConfig()
	cfg.Clients, cfg.Modes = []int{12}, []string{"kv"}
	// Conversations of 1,024 tokens keep the router's and the engines' work
	// small enough for a loaded machine (and the race detector) to reach a
	// steady state in the window: the first engine still decodes 512 more
	// blocks than the second, weighing 171 prefill blocks, more than the 64
	// its cache saves.
	cfg.HistoryTokens = 1024
	cfg.Speedup, cfg.Warmup, cfg.Duration = 5, time.Second, 3*time.Second
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	rows, err := RunHotSet(ctx, cfg, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	r := rows[0]
	total := r.Served[0] + r.Served[1]
	t.Logf("served %v, TTFT p50 %.1f p90 %.1f ms, %.1f req/s", r.Served, r.TTFTP50, r.TTFTP90, r.RPS)
	if r.Errors > 0 || total == 0 {
		t.Fatalf("%d errors (%s), %d requests served", r.Errors, r.FirstErr, total)
	}
	// The router that starved it sent the idle engine nothing; a fair
	// share is 40–50 % on a quiet machine and fell to 20 % on a loaded
	// one, where the window holds fewer requests.
	if share := float64(r.Served[1]) / float64(total); share < 0.1 {
		t.Errorf("the idle engine served %.0f %% of the requests (%v)", 100*share, r.Served)
	}
}
