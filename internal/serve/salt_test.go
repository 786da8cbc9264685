package serve

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/internal/testwait"
	"github.com/kvrouter/kvrouter/mocker/fleet"
)

// saltedOn sends a salted completion pinned to worker target and returns
// the blocks the router credited and the tokens the engine served from
// its cache.
func saltedOn(t *testing.T, s *Server, p []int, salt string, target uint64) (overlap, cached int) {
	t.Helper()
	nvext := map[string]any{"extra_fields": []string{"worker_id"}}
	if target != 0 {
		nvext["backend_instance_id"] = target
	}
	body := map[string]any{"model": "kvrouter-mock", "prompt": p, "max_tokens": 2, "nvext": nvext}
	if salt != "" {
		body["cache_salt"] = salt
	}
	b, _ := json.Marshal(body)
	resp, err := http.Post(s.URL()+"/v1/completions", "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	var out struct {
		NVExt struct {
			OverlapBlocks int `json:"overlap_blocks"`
		} `json:"nvext"`
		Usage struct {
			Details struct {
				Cached int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if resp.StatusCode != http.StatusOK || json.Unmarshal(raw, &out) != nil {
		t.Fatalf("completion: %d %s", resp.StatusCode, raw)
	}
	return out.NVExt.OverlapBlocks, out.Usage.Details.Cached
}

// Two tenants send the same prompt with different cache_salt to simulated
// vLLM engines publishing extra_keys over ZeroMQ. Tenant A's prompt is
// cached in two requests (the second continues the first, so its event
// names a parent and carries no salt); the router credits tenant A with
// all of it, and tenant B, or a request without a salt, with none of it,
// as the engine itself reuses none of it for them.
func TestSaltedTenantsGetNoCreditForEachOthersCache(t *testing.T) {
	f1 := engineFleetWith(t, func(c *fleet.Config) { c.SpeedupRatio = 100 })
	f2 := engineFleetWith(t, func(c *fleet.Config) { c.SpeedupRatio = 100 })
	cfg := router.DefaultConfig()
	cfg.PredictedTTL = 0 // credit only what engines report
	s := startServerWith(t, Config{Router: cfg, Workers: []WorkerSpec{spec(1, f1), spec(2, f2)}, HealthInterval: 50 * time.Millisecond})
	ctx := context.Background()

	first := prompt(0, 1, 512)
	full := append(append([]int{}, first...), prompt(0, 2, 512)...)
	for _, p := range [][]int{first, full} {
		saltedOn(t, s, p, "tenant-a", 1)
		// The engine's events carry the salt in the request's first block
		// only; they are applied once tenant A's whole prompt is credited.
		testwait.Until(t, 10*time.Second, "engine 1's events applied", func() bool {
			for _, l := range s.Router().PotentialLoadsFor(&router.Request{Tokens: tokens32(p), CacheSalt: "tenant-a"}) {
				if l.Worker.ID == 1 && l.OverlapBlocks == len(p)/16 {
					return true
				}
			}
			return false
		})
	}
	for _, tc := range []struct {
		salt string
		want int
	}{{"tenant-a", 64}, {"tenant-b", 0}, {"", 0}} {
		d, err := s.Router().BestWorker(ctx, &router.Request{Tokens: tokens32(full), CacheSalt: tc.salt})
		if err != nil {
			t.Fatal(err)
		}
		if d.OverlapBlocks != tc.want || (tc.want > 0 && d.Worker.ID != 1) {
			t.Errorf("salt %q: %+v, want %d blocks credited", tc.salt, d, tc.want)
		}
	}
	if overlap, cached := saltedOn(t, s, full, "tenant-b", 1); overlap != 0 || cached != 0 {
		t.Errorf("tenant B on tenant A's engine: %d blocks credited, %d tokens served from cache; want none", overlap, cached)
	}
	if overlap, cached := saltedOn(t, s, full, "tenant-a", 0); overlap != 64 || cached < 63*16 {
		t.Errorf("tenant A: %d blocks credited, %d tokens served from cache; want 64 blocks", overlap, cached)
	}
}
