package frontend

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
)

// The fake vLLM pair below is written from vLLM's P/D protocol (its
// NixlConnector proxy and connector docs), not from kvrouter's mocker: the
// prefill engine must get exactly the proxy's request, and the decode
// engine exactly the transfer parameters the prefill engine answered.

// wantPrefillParams is vLLM's proxy's kv_transfer_params to the prefill
// engine, as a decoded JSON value.
var wantPrefillParams = map[string]any{
	"do_remote_decode": true, "do_remote_prefill": false,
	"remote_engine_id": nil, "remote_block_ids": nil, "remote_host": nil, "remote_port": nil,
}

// prefillAnswerParams is what a NixlConnector prefill engine answers.
const prefillAnswerParams = `{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[7,8,9,12],` +
	`"remote_engine_id":"6f1c2a0e-prefill","remote_request_id":"cmpl-p-1","remote_host":"10.1.2.3","remote_port":5600,"tp_size":1}`

type seenBodies struct {
	mu      sync.Mutex
	prefill []map[string]any
	decode  []map[string]any
}

func (s *seenBodies) record(dst *[]map[string]any, r *http.Request) map[string]any {
	b, _ := io.ReadAll(r.Body)
	var m map[string]any
	_ = json.Unmarshal(b, &m)
	s.mu.Lock()
	*dst = append(*dst, m)
	s.mu.Unlock()
	return m
}

// fakeVLLMPrefill answers as a vLLM prefill engine with a NixlConnector.
func fakeVLLMPrefill(seen *seenBodies, status int) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		seen.record(&seen.prefill, r)
		if status != http.StatusOK {
			w.WriteHeader(status)
			_, _ = io.WriteString(w, `{"error":{"message":"boom","type":"InternalServerError","code":500}}`)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"cmpl-p-1","object":"text_completion","created":1,"model":"m",`+
			`"choices":[{"index":0,"text":"x","finish_reason":"length"}],`+
			`"usage":{"prompt_tokens":64,"completion_tokens":1,"total_tokens":65},`+
			`"kv_transfer_params":`+prefillAnswerParams+`}`)
	}
}

// fakeVLLMDecode answers as a vLLM decode engine, streamed or not.
func fakeVLLMDecode(seen *seenBodies) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		m := seen.record(&seen.decode, r)
		if m["stream"] == true {
			sseHandler([]string{"data: {\"id\":\"d\",\"choices\":[{\"index\":0,\"text\":\"he\"}]}\n\n",
				"data: {\"id\":\"d\",\"choices\":[{\"index\":0,\"text\":\"llo\",\"finish_reason\":\"length\"}]}\n\n", "data: [DONE]\n\n"}, "")(w, r)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"cmpl-d-1","object":"text_completion","created":1,"model":"m",`+
			`"choices":[{"index":0,"text":"hello","finish_reason":"length"}],"usage":{"prompt_tokens":64,"completion_tokens":2,"total_tokens":66}}`)
	}
}

func (e *env) fakeRole(id uint64, role router.Role, handler http.HandlerFunc) Worker {
	e.t.Helper()
	srv := httptest.NewServer(handler)
	e.t.Cleanup(srv.Close)
	w := Worker{ID: id, Name: role.String() + "-fake", BaseURL: srv.URL, Model: "m", DPSize: 1}
	e.mu.Lock()
	e.workers = append(e.workers, w)
	e.mu.Unlock()
	e.router.AddWorker(router.WorkerInfo{ID: id, Model: "m", DPSize: 1, TotalKVBlocks: 4096, Role: role})
	return w
}

func (e *env) decisions(prefill, reason string) float64 {
	return testutil.ToFloat64(e.fe.dm.decisions.WithLabelValues("m", prefill, reason))
}

func TestDisaggSpeaksVLLMsProtocol(t *testing.T) {
	for _, tc := range []struct {
		name   string
		path   string
		client map[string]any
	}{
		{"completions, not streamed", "/v1/completions", map[string]any{"model": "m", "prompt": tokens(64, 1), "max_tokens": 20, "temperature": 0.5,
			"nvext": map[string]any{"extra_fields": []string{"worker_id", "timing"}}}},
		{"completions, streamed with usage", "/v1/completions", map[string]any{"model": "m", "prompt": tokens(64, 2), "max_tokens": 20, "stream": true,
			"stream_options": map[string]any{"include_usage": true}, "nvext": map[string]any{"extra_fields": []string{"worker_id"}}}},
		{"chat with max_completion_tokens", "/v1/chat/completions", map[string]any{"model": "m", "messages": []map[string]string{{"role": "user", "content": "hi"}},
			"max_completion_tokens": 30, "nvext": map[string]any{"token_data": tokens(64, 3), "extra_fields": []string{"worker_id"}}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, envOpts{})
			seen := &seenBodies{}
			e.fakeRole(1, router.RolePrefill, fakeVLLMPrefill(seen, http.StatusOK))
			e.fakeRole(2, router.RoleDecode, fakeVLLMDecode(seen))
			resp, body := e.post(tc.path, tc.client)
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("status %d: %s", resp.StatusCode, body)
			}
			e.settle()
			if len(seen.prefill) != 1 || len(seen.decode) != 1 {
				t.Fatalf("prefill got %d requests, decode %d: want 1 each", len(seen.prefill), len(seen.decode))
			}

			// Step 1: the client's request, non-streamed, one token, the
			// proxy's transfer parameters, nothing of nvext.
			p := seen.prefill[0]
			want := map[string]any{}
			for k, v := range tc.client {
				want[k] = jsonValue(t, v)
			}
			delete(want, "nvext")
			delete(want, "stream_options")
			want["stream"] = false
			want["max_tokens"] = float64(1)
			if _, ok := tc.client["max_completion_tokens"]; ok {
				want["max_completion_tokens"] = float64(1)
			}
			want["kv_transfer_params"] = wantPrefillParams
			if !reflect.DeepEqual(p, want) {
				t.Fatalf("prefill request\n got %v\nwant %v", p, want)
			}

			// Step 2: the client's request as it was, with the prefill's
			// kv_transfer_params unchanged.
			d := seen.decode[0]
			want = map[string]any{}
			for k, v := range tc.client {
				want[k] = jsonValue(t, v)
			}
			delete(want, "nvext")
			var params any
			_ = json.Unmarshal([]byte(prefillAnswerParams), &params)
			want["kv_transfer_params"] = params
			if !reflect.DeepEqual(d, want) {
				t.Fatalf("decode request\n got %v\nwant %v", d, want)
			}

			// Step 3: one ordinary answer, from the decode engine, naming both.
			var ext map[string]any
			if tc.client["stream"] == true {
				chunks := strings.Split(string(body), "\n\n")
				if !strings.Contains(chunks[0], `"he"`) || !strings.Contains(string(body), "data: [DONE]") {
					t.Fatalf("stream not relayed: %s", body)
				}
				var first map[string]any
				_ = json.Unmarshal([]byte(strings.TrimPrefix(chunks[0], "data: ")), &first)
				ext, _ = first["nvext"].(map[string]any)
			} else {
				var out map[string]any
				if err := json.Unmarshal(body, &out); err != nil {
					t.Fatal(err)
				}
				if _, leaked := out["kv_transfer_params"]; leaked {
					t.Fatalf("the client got transfer parameters: %s", body)
				}
				ext, _ = out["nvext"].(map[string]any)
				if tm, ok := ext["timing"].(map[string]any); tc.name == "completions, not streamed" && (!ok || tm["prefill_ms"] == nil || tm["decode_ttft_ms"] == nil) {
					t.Fatalf("no prefill/decode timing split: %v", ext)
				}
			}
			if ext["worker_id"] != float64(2) || ext["prefill_worker_id"] != float64(1) || ext["transfer_blocks"] != float64(4) {
				t.Fatalf("nvext = %v: want worker_id 2, prefill_worker_id 1, the 4 prompt blocks transferred", ext)
			}
			if got := e.decisions("remote", "disaggregated"); got != 1 {
				t.Fatalf("remote prefills counted: %v", got)
			}
		})
	}
}

// jsonValue is v as it reads back from JSON.
func jsonValue(t *testing.T, v any) any {
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	var out any
	_ = json.Unmarshal(b, &out)
	return out
}

func TestDisaggFallsBackToLocalPrefill(t *testing.T) {
	for _, tc := range []struct {
		name    string
		prefill func(e *env, seen *seenBodies)
		reason  string
	}{
		{"the prefill engine errors", func(e *env, seen *seenBodies) {
			e.fakeRole(1, router.RolePrefill, fakeVLLMPrefill(seen, http.StatusInternalServerError))
		}, localPrefillError},
		{"the prefill engine is gone", func(e *env, _ *seenBodies) {
			e.mu.Lock()
			e.workers = append(e.workers, Worker{ID: 1, Name: "dead", BaseURL: closedURL(e.t), Model: "m", DPSize: 1})
			e.mu.Unlock()
			e.router.AddWorker(router.WorkerInfo{ID: 1, Model: "m", Role: router.RolePrefill})
		}, localUnreachable},
		{"the prefill answer has no transfer parameters", func(e *env, seen *seenBodies) {
			e.fakeRole(1, router.RolePrefill, func(w http.ResponseWriter, r *http.Request) {
				seen.record(&seen.prefill, r)
				_, _ = io.WriteString(w, `{"id":"x","choices":[{"index":0,"text":"x"}]}`)
			})
		}, localNoParams},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, envOpts{})
			seen := &seenBodies{}
			tc.prefill(e, seen)
			e.fakeRole(2, router.RoleDecode, fakeVLLMDecode(seen))
			client := map[string]any{"model": "m", "prompt": tokens(64, 1), "max_tokens": 20}
			resp, body := e.post("/v1/completions", client)
			if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), "hello") {
				t.Fatalf("the client saw the prefill failure: %d %s", resp.StatusCode, body)
			}
			e.settle()
			if len(seen.decode) != 1 {
				t.Fatalf("decode requests: %d", len(seen.decode))
			}
			if _, ok := seen.decode[0]["kv_transfer_params"]; ok {
				t.Fatalf("a local prefill carried transfer parameters: %v", seen.decode[0])
			}
			if got := e.decisions("local", tc.reason); got != 1 {
				t.Fatalf("local prefills for %s: %v", tc.reason, got)
			}
		})
	}
}

func TestDisaggOnlyWithBothPools(t *testing.T) {
	e := newEnv(t, envOpts{})
	seen := &seenBodies{}
	e.fakeRole(2, router.RoleDecode, fakeVLLMDecode(seen))
	e.fakeRole(3, router.RoleBoth, fakeVLLMDecode(seen))
	client := map[string]any{"model": "m", "prompt": tokens(64, 1), "max_tokens": 20}
	for range 2 {
		if resp, body := e.post("/v1/completions", client); resp.StatusCode != http.StatusOK {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
	}
	e.settle()
	if len(seen.decode) != 2 {
		t.Fatalf("decode requests: %d", len(seen.decode))
	}
	for _, d := range seen.decode {
		if _, ok := d["kv_transfer_params"]; ok {
			t.Fatal("an aggregated model's request carried transfer parameters")
		}
	}
	// A prefill worker arrives: the model is served disaggregated.
	e.fakeRole(1, router.RolePrefill, fakeVLLMPrefill(seen, http.StatusOK))
	if resp, body := e.post("/v1/completions", client); resp.StatusCode != http.StatusOK {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	e.settle()
	if len(seen.prefill) != 1 {
		t.Fatalf("prefill requests: %d", len(seen.prefill))
	}
	// It leaves: aggregated again, no restart.
	e.router.RemoveWorker(1)
	if resp, body := e.post("/v1/completions", client); resp.StatusCode != http.StatusOK {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	e.settle()
	if len(seen.prefill) != 1 || len(seen.decode) != 4 {
		t.Fatalf("prefill %d, decode %d requests: want 1 and 4", len(seen.prefill), len(seen.decode))
	}
}

func TestDisaggPins(t *testing.T) {
	e := newEnv(t, envOpts{})
	seen := &seenBodies{}
	hits := map[uint64]int{}
	var mu sync.Mutex
	for _, id := range []uint64{1, 4} {
		e.fakeRole(id, router.RolePrefill, func(w http.ResponseWriter, r *http.Request) {
			mu.Lock()
			hits[id]++
			mu.Unlock()
			fakeVLLMPrefill(seen, http.StatusOK)(w, r)
		})
	}
	e.fakeRole(2, router.RoleDecode, fakeVLLMDecode(seen))
	e.fakeRole(3, router.RoleDecode, fakeVLLMDecode(seen))
	for range 3 {
		client := map[string]any{"model": "m", "prompt": tokens(64, 1), "max_tokens": 5,
			"nvext": map[string]any{"prefill_worker_id": 4, "backend_instance_id": 3, "extra_fields": []string{"worker_id"}}}
		resp, body := e.post("/v1/completions", client)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
		var out struct {
			Nvext struct {
				WorkerID        uint64 `json:"worker_id"`
				PrefillWorkerID uint64 `json:"prefill_worker_id"`
			} `json:"nvext"`
		}
		_ = json.Unmarshal(body, &out)
		if out.Nvext.WorkerID != 3 || out.Nvext.PrefillWorkerID != 4 {
			t.Fatalf("decode pin not kept: %s", body)
		}
	}
	e.settle()
	if hits[4] != 3 || hits[1] != 0 {
		t.Fatalf("prefill pin not kept: %v", hits)
	}
}

func TestDisaggConditionalPrefillsShortRemaindersLocally(t *testing.T) {
	e := newEnv(t, envOpts{frontend: func(c *Config) { c.Disagg.MinUncachedTokens = 256 }})
	seen := &seenBodies{}
	e.fakeRole(1, router.RolePrefill, fakeVLLMPrefill(seen, http.StatusOK))
	e.fakeRole(2, router.RoleDecode, fakeVLLMDecode(seen))
	short := map[string]any{"model": "m", "prompt": tokens(100, 1), "max_tokens": 5}
	long := map[string]any{"model": "m", "prompt": tokens(1000, 2), "max_tokens": 5}
	for _, c := range []map[string]any{short, long} {
		if resp, body := e.post("/v1/completions", c); resp.StatusCode != http.StatusOK {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
	}
	e.settle()
	if len(seen.prefill) != 1 || e.decisions("local", localShortUncached) != 1 || e.decisions("remote", "disaggregated") != 1 {
		t.Fatalf("prefill requests %d, local %v, remote %v: want the long prompt alone prefilled remotely",
			len(seen.prefill), e.decisions("local", localShortUncached), e.decisions("remote", "disaggregated"))
	}
}

func TestRouterAPIPools(t *testing.T) {
	e := newEnv(t, envOpts{})
	seen := &seenBodies{}
	e.fakeRole(1, router.RolePrefill, fakeVLLMPrefill(seen, http.StatusOK))
	e.fakeRole(2, router.RoleDecode, fakeVLLMDecode(seen))
	for pool, want := range map[string]float64{"prefill": 1, "decode": 2} {
		resp, body := e.post("/router/best_worker", map[string]any{"model": "m", "tokens": tokens(64, 1), "pool": pool})
		var out map[string]any
		_ = json.Unmarshal(body, &out)
		if resp.StatusCode != http.StatusOK || out["worker_id"] != want {
			t.Fatalf("pool %s: %d %s, want worker %v", pool, resp.StatusCode, body, want)
		}
	}
	resp, body := e.post("/router/best_worker", map[string]any{"model": "m", "tokens": tokens(64, 1), "pool": "both"})
	if code := openAIError(t, resp, body, http.StatusBadRequest); code != "invalid_pool" {
		t.Fatalf("code %s", code)
	}
}

func TestDisaggSessionPinsTheDecodeWorker(t *testing.T) {
	e := newEnv(t, envOpts{})
	seen := &seenBodies{}
	e.fakeRole(1, router.RolePrefill, fakeVLLMPrefill(seen, http.StatusOK))
	e.fakeRole(2, router.RoleDecode, fakeVLLMDecode(seen))
	e.fakeRole(3, router.RoleDecode, fakeVLLMDecode(seen))
	var first float64
	for i, action := range []string{"open", "", "", "close"} {
		sc := map[string]any{"session_id": "s1"}
		if action != "" {
			sc["action"] = action
		}
		resp, body := e.post("/v1/completions", map[string]any{"model": "m", "prompt": tokens(64, 10+i), "max_tokens": 5,
			"nvext": map[string]any{"session_control": sc, "extra_fields": []string{"worker_id"}}})
		var out struct {
			Nvext map[string]float64 `json:"nvext"`
		}
		if err := json.Unmarshal(body, &out); err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("%d %s", resp.StatusCode, body)
		}
		if out.Nvext["prefill_worker_id"] != 1 {
			t.Fatalf("turn %d not prefilled remotely: %s", i, body)
		}
		if i == 0 {
			// Load the pinned worker heavily: left to the policy, the next
			// turns would go to the other one.
			first = out.Nvext["worker_id"]
			w := kv.Worker{ID: uint64(first)}
			if _, err := e.router.BestWorker(context.Background(), &router.Request{ID: "ballast", Tokens: tokens(4000, 99), Target: &w}); err != nil {
				t.Fatal(err)
			}
			defer e.router.Free("ballast")
		} else if out.Nvext["worker_id"] != first {
			t.Fatalf("turn %d decoded on %v, the session is pinned to %v", i, out.Nvext["worker_id"], first)
		}
	}
	e.idle.wait(t)
}

// --enforce-disagg: a request no prefill worker takes fails instead of
// being prefilled on the decode worker; conditional disaggregation's
// local prefills still happen.
func TestEnforcedDisaggFailsWithoutAPrefill(t *testing.T) {
	e := newEnv(t, envOpts{frontend: func(c *Config) { c.Disagg.Enforce, c.Disagg.MinUncachedTokens = true, 256 }})
	seen := &seenBodies{}
	e.fakeRole(1, router.RolePrefill, fakeVLLMPrefill(seen, http.StatusInternalServerError))
	e.fakeRole(2, router.RoleDecode, fakeVLLMDecode(seen))
	resp, body := e.post("/v1/completions", map[string]any{"model": "m", "prompt": tokens(1000, 1), "max_tokens": 5})
	if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(body), "prefill_unavailable") {
		t.Fatalf("a failed prefill under --enforce-disagg: %d %s, want 503 prefill_unavailable", resp.StatusCode, body)
	}
	if len(seen.decode) != 0 {
		t.Fatalf("the decode worker got %d requests", len(seen.decode))
	}
	if resp, body := e.post("/v1/completions", map[string]any{"model": "m", "prompt": tokens(100, 2), "max_tokens": 5}); resp.StatusCode != http.StatusOK {
		t.Fatalf("a short prompt, prefilled locally by choice: %d %s", resp.StatusCode, body)
	}
}

// Dynamo's ratio threshold: a local prefill also needs the uncached share
// of the prompt below it.
func TestConditionalDisaggRatio(t *testing.T) {
	e := newEnv(t, envOpts{frontend: func(c *Config) { c.Disagg.MinUncachedTokens, c.Disagg.MaxUncachedRatio = 256, 0.5 }})
	seen := &seenBodies{}
	e.fakeRole(1, router.RolePrefill, fakeVLLMPrefill(seen, http.StatusOK))
	e.fakeRole(2, router.RoleDecode, fakeVLLMDecode(seen))
	// 100 tokens, none cached: under 256 but all of the prompt.
	if resp, body := e.post("/v1/completions", map[string]any{"model": "m", "prompt": tokens(100, 1), "max_tokens": 5}); resp.StatusCode != http.StatusOK {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	e.settle()
	if len(seen.prefill) != 1 || e.decisions("local", localShortUncached) != 0 {
		t.Fatalf("prefill requests %d, local %v: a wholly uncached prompt goes to the prefill worker under the ratio", len(seen.prefill), e.decisions("local", localShortUncached))
	}
}
