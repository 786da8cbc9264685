package frontend

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
)

// With the learned prefill model, /health and the dashboard give each
// engine's learned prefill rate once enough first tokens have come (the
// router's clock is a fake one: the rate is the one its first tokens show).
func TestHealthAndDashboardShowLearnedPrefill(t *testing.T) {
	var mu sync.Mutex
	now := time.Unix(1_000_000, 0)
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	e := newEnv(t, envOpts{engines: 1, router: func(c *router.Config) { c.PrefillLoadModel = "learned"; c.Now = clock }})
	// 12 first tokens, each 100 µs per prompt token after its request.
	target := kv.Worker{ID: 10}
	for i := range 12 {
		toks := make([]uint32, 400+40*i)
		for j := range toks {
			toks[j] = uint32(i*100_000 + j)
		}
		id := fmt.Sprint("r", i)
		if _, err := e.router.BestWorker(context.Background(), &router.Request{ID: id, Tokens: toks, Target: &target}); err != nil {
			t.Fatal(err)
		}
		mu.Lock()
		now = now.Add(time.Duration(len(toks)) * 100 * time.Microsecond)
		mu.Unlock()
		e.router.MarkPrefillCompleted(id)
		e.router.Free(id)
	}
	resp, body := e.get("/health")
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("health %d %s", resp.StatusCode, body)
	}
	var h struct {
		Workers []healthWorker `json:"workers"`
	}
	if err := json.Unmarshal(body, &h); err != nil {
		t.Fatal(err)
	}
	if len(h.Workers) != 1 || len(h.Workers[0].LearnedPrefill) != 1 {
		t.Fatalf("health workers %s", body)
	}
	lp := h.Workers[0].LearnedPrefill[0]
	if lp.Samples != 12 || lp.TokensPerSecond < 9000 || lp.TokensPerSecond > 11000 {
		t.Fatalf("learned prefill %+v", lp)
	}
	st := getState(t, e, 0)
	if r := st.Engines[0].Ranks[0]; r.LearnedPrefillTPS == nil || *r.LearnedPrefillTPS != round2(lp.TokensPerSecond) {
		t.Fatalf("dashboard rank %+v, health %+v", r, lp)
	}
}
