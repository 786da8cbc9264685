package frontend

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/kvrouter/kvrouter/core/router"
)

// Dynamo's conditional disaggregation policies: where a request is
// prefilled by the prompt's uncached remainder, the prefill worker's
// backlog and the decode worker's room.
func TestConditionalDisaggPolicies(t *testing.T) {
	tiny, full := 0.0001, 1.0
	for _, tc := range []struct {
		name          string
		policy        string
		decodeBusy    *float64
		decodeBlocks  int // the decode worker's capacity; 0 unknown
		prefillLoaded bool
		prompt        int
		wantRemote    bool
		wantReason    string
	}{
		{name: "isl_bounding ignores a busy prefill worker", policy: PolicyISLBounding, prefillLoaded: true, prompt: 1000, wantRemote: true},
		{name: "prefill_load prefills locally beside a busy prefill worker", policy: PolicyPrefillLoad, prefillLoaded: true, prompt: 1000, wantReason: localPrefillLoad},
		{name: "prefill_load disaggregates while the prefill worker has room", policy: PolicyPrefillLoad, prompt: 1000, wantRemote: true},
		{name: "prefill_load ignores a short remainder", policy: PolicyPrefillLoad, prompt: 100, wantRemote: true},
		{name: "isl_or_load: a short remainder", policy: PolicyISLOrLoad, prompt: 100, wantReason: localShortUncached},
		{name: "isl_or_load: a busy prefill worker", policy: PolicyISLOrLoad, prefillLoaded: true, prompt: 1000, wantReason: localPrefillLoad},
		{name: "decode gate: a full decode worker is not given the prefill", policy: PolicyISLBounding, decodeBusy: &tiny, decodeBlocks: 4096, prompt: 100, wantRemote: true},
		{name: "decode gate: unknown capacity is not given the prefill", policy: PolicyISLBounding, decodeBusy: &full, prompt: 100, wantRemote: true},
		{name: "decode gate: room on the decode worker", policy: PolicyISLBounding, decodeBusy: &full, decodeBlocks: 4096, prompt: 100, wantReason: localShortUncached},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, envOpts{frontend: func(c *Config) {
				c.Disagg.MinUncachedTokens = 256
				c.Disagg.Policy = tc.policy
				c.Disagg.PrefillBusyThreshold = 0.5
				c.Disagg.DecodeBusyThreshold = tc.decodeBusy
			}})
			seen := &seenBodies{}
			e.fakeRoleInfo(router.WorkerInfo{ID: 1, Model: "m", DPSize: 1, TotalKVBlocks: 4096, MaxNumBatchedTokens: 512, Role: router.RolePrefill}, fakeVLLMPrefill(seen, http.StatusOK))
			e.fakeRoleInfo(router.WorkerInfo{ID: 2, Model: "m", DPSize: 1, TotalKVBlocks: tc.decodeBlocks, Role: router.RoleDecode}, fakeVLLMDecode(seen))
			if tc.prefillLoaded {
				// 1000 prompt tokens in prefill: over half of its 512-token budget.
				if _, err := e.router.BestWorker(context.Background(), &router.Request{ID: "backlog", Tokens: tokens(1000, 9), Model: "m", Prefill: true}); err != nil {
					t.Fatal(err)
				}
			}
			resp, body := e.post("/v1/completions", map[string]any{"model": "m", "prompt": tokens(tc.prompt, 1), "max_tokens": 5})
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("%d %s", resp.StatusCode, body)
			}
			e.router.Free("backlog")
			e.settle()
			remote := len(seen.prefill) == 1 && e.decisions("remote", "disaggregated") == 1
			if remote != tc.wantRemote {
				t.Fatalf("prefilled remotely: %v (prefill requests %d), want %v", remote, len(seen.prefill), tc.wantRemote)
			}
			if !tc.wantRemote && e.decisions("local", tc.wantReason) != 1 {
				t.Fatalf("local prefills for %s: %v", tc.wantReason, e.decisions("local", tc.wantReason))
			}
		})
	}
}

// fakeRoleInfo is fakeRole with the engine's registration as given.
func (e *env) fakeRoleInfo(info router.WorkerInfo, handler http.HandlerFunc) {
	e.t.Helper()
	srv := httptest.NewServer(handler)
	e.t.Cleanup(srv.Close)
	e.mu.Lock()
	e.workers = append(e.workers, Worker{ID: info.ID, Name: info.Role.String() + "-fake", BaseURL: srv.URL, Model: info.Model, DPSize: 1})
	e.mu.Unlock()
	e.router.AddWorker(info)
}
