package frontend

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
)

// Dynamo's router method names answer as kvrouter's calls do, and
// DynamoMetricNames exports Dynamo's metric names beside kvrouter's.
func TestDynamoRouterAndMetricNames(t *testing.T) {
	e := newEnv(t, envOpts{engines: 2, frontend: func(c *Config) { c.DynamoMetricNames = true }})
	e.settle()
	q := map[string]any{"model": mockModel, "tokens": tokens(64, 1)}
	resp, body := e.post("/router/best_worker_id", q)
	var best struct {
		WorkerID      *uint64 `json:"worker_id"`
		OverlapBlocks *int    `json:"overlap_blocks"`
	}
	if resp.StatusCode != http.StatusOK || json.Unmarshal(body, &best) != nil || best.WorkerID == nil || best.OverlapBlocks == nil {
		t.Errorf("best_worker_id: %d %s", resp.StatusCode, body)
	}
	resp, body = e.post("/router/get_potential_loads", q)
	var loads []potentialLoad
	if resp.StatusCode != http.StatusOK || json.Unmarshal(body, &loads) != nil || len(loads) != 2 {
		t.Errorf("get_potential_loads: %d %s", resp.StatusCode, body)
	}
	if resp, body := e.post("/v1/completions", map[string]any{"model": mockModel, "prompt": tokens(32, 2), "max_tokens": 2}); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	_, metrics := e.get("/metrics")
	for kv, dyn := range DynamoMetricNames {
		for _, name := range dyn {
			if strings.Contains(string(metrics), "\n"+kv) != strings.Contains(string(metrics), "\n"+name) {
				t.Errorf("%s and %s are not exported together", kv, name)
			}
		}
	}
	for _, name := range []string{"dynamo_frontend_requests_total{", "dynamo_component_router_requests_total{", "dynamo_component_router_kv_hit_rate_bucket{", "dynamo_frontend_worker_active_decode_blocks{"} {
		if !strings.Contains(string(metrics), "\n"+name) {
			t.Errorf("/metrics has no %s", name)
		}
	}

	plain := newEnv(t, envOpts{engines: 1})
	if _, metrics := plain.get("/metrics"); strings.Contains(string(metrics), "dynamo_") {
		t.Error("Dynamo's names exported without DynamoMetricNames")
	}
}
