package serve

import (
	"io"
	"log/slog"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/index"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/internal/testwait"
)

// An engine declared with 1,000 blocks whose events claim 10,000 keeps
// its bound in the index; /health, the metrics and the log (once) say so.
func TestEngineClaimingTenTimesItsCapacityIsBoundedAndReported(t *testing.T) {
	var logs testwait.Buffer
	sp := spec(1, engineFleet(t))
	sp.KVBlocks = 1000
	s := startServerWith(t, Config{
		Router: router.DefaultConfig(), Workers: []WorkerSpec{sp}, HealthInterval: 20 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelInfo})),
	})
	r := s.Router()
	w := kv.Worker{ID: 1}
	for i := range 100 {
		blocks := make([]kv.Block, 100)
		for j := range blocks {
			h := uint64(1<<40 + i*100 + j)
			blocks[j] = kv.Block{EngineHash: h, LocalHash: h}
		}
		ev := kv.StoredEvent(w, uint64(i), nil, blocks...)
		if err := r.ApplyEvent(&ev); err != nil {
			t.Fatal(err)
		}
	}
	bound := index.RankBound(1000)
	if got := len(r.HeldBlocks(w)); got > bound {
		t.Fatalf("the index holds %d blocks of an engine bounded to %d", got, bound)
	}
	testwait.Until(t, 10*time.Second, "the warning", func() bool {
		return strings.Contains(logs.String(), "claim more blocks than its capacity")
	})
	h := getHealth(t, s)
	if h.Status != "degraded" || len(h.Reasons) != 1 || !strings.Contains(h.Reasons[0], "claimed more blocks than its capacity") {
		t.Fatalf("/health: %+v", h)
	}
	resp, err := http.Get(s.URL() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(body), `kvrouter_worker_kv_blocks_over_bound_total{dp_rank="0",worker_id="1"} `) {
		t.Fatal("no over-bound series for the engine in /metrics")
	}
	// More of the same is not warned about again.
	ev := kv.StoredEvent(w, 1000, nil, kv.Block{EngineHash: 1, LocalHash: 1})
	_ = r.ApplyEvent(&ev)
	if h := getHealth(t, s); h.Status != "degraded" {
		t.Fatalf("/health: %+v", h)
	}
	if n := strings.Count(logs.String(), "claim more blocks than its capacity"); n != 1 {
		t.Fatalf("warned %d times, want once", n)
	}
}
