package frontend

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvrouter/kvrouter/core/router"
)

// evilParams are a client's kv_transfer_params telling the decode engine to
// pull KV blocks from an address the client chose.
var evilParams = map[string]any{
	"do_remote_prefill": true, "remote_engine_id": "evil", "remote_request_id": "evil-req",
	"remote_block_ids": []int{0}, "remote_host": "127.0.0.1", "remote_port": 9999,
}

// TestClientKVTransferParamsNeverReachAnEngine: whatever path a request
// takes (an aggregated model, a prompt under the conditional threshold, a
// prefill that failed, a remote prefill, several data-parallel ranks), the
// engines get the router's kv_transfer_params or none, never the client's.
func TestClientKVTransferParamsNeverReachAnEngine(t *testing.T) {
	for _, tc := range []struct {
		name  string
		setup func(e *env, seen *seenBodies)
		// remote: the decode engine must get the prefill engine's answer.
		remote bool
	}{
		{"no prefill engine", func(e *env, seen *seenBodies) {
			e.fakeRole(2, router.RoleBoth, fakeVLLMDecode(seen))
		}, false},
		{"a short prompt under the conditional threshold", pdPair(http.StatusOK), false},
		{"a prefill that failed", pdPair(http.StatusInternalServerError), false},
		{"a remote prefill", pdPair(http.StatusOK), true},
		{"an engine of two ranks", func(e *env, seen *seenBodies) {
			e.fake(2, "m", 2, fakeVLLMDecode(seen))
		}, false},
	} {
		for _, stream := range []bool{false, true} {
			name := tc.name
			if stream {
				name += ", streamed"
			}
			t.Run(name, func(t *testing.T) {
				e := newEnv(t, envOpts{frontend: func(c *Config) { c.Disagg.MinUncachedTokens = 512 }})
				seen := &seenBodies{}
				tc.setup(e, seen)
				n := 20 // under MinUncachedTokens
				if tc.remote {
					n = 1000
				}
				client := map[string]any{"model": "m", "prompt": tokens(n, 1), "max_tokens": 4, "stream": stream, "kv_transfer_params": evilParams}
				resp, body := e.post("/v1/completions", client)
				if resp.StatusCode != http.StatusOK {
					t.Fatalf("%d %s", resp.StatusCode, body)
				}
				e.settle()
				if len(seen.decode) != 1 {
					t.Fatalf("decode requests: %d", len(seen.decode))
				}
				got, has := seen.decode[0]["kv_transfer_params"]
				switch {
				case tc.remote:
					var want map[string]any
					_ = json.Unmarshal([]byte(prefillAnswerParams), &want)
					if b, _ := json.Marshal(got); string(b) != mustJSON(t, want) {
						t.Fatalf("the decode engine got %s, want the prefill engine's %s", b, prefillAnswerParams)
					}
				case has:
					t.Fatalf("the decode engine got the client's kv_transfer_params: %v", got)
				}
				for _, p := range seen.prefill {
					if b := mustJSON(t, p["kv_transfer_params"]); strings.Contains(b, "evil") || strings.Contains(b, "9999") {
						t.Fatalf("the prefill engine got the client's parameters: %s", b)
					}
				}
				if got := testutil.ToFloat64(e.fe.dm.clientParams); got != 1 {
					t.Fatalf("client kv_transfer_params stripped: %v, want 1", got)
				}
			})
		}
	}
}

// pdPair adds a prefill engine answering status and a decode engine.
func pdPair(status int) func(e *env, seen *seenBodies) {
	return func(e *env, seen *seenBodies) {
		e.fakeRole(1, router.RolePrefill, fakeVLLMPrefill(seen, status))
		e.fakeRole(2, router.RoleDecode, fakeVLLMDecode(seen))
	}
}

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// engineHoldingKV answers as an engine asked to hold a prompt's KV for a
// remote decode does: with where it holds them, in the whole answer and
// (as some engines do) in the last chunk of a stream, and in an error.
func engineHoldingKV(w http.ResponseWriter, r *http.Request) {
	var req map[string]any
	b, _ := io.ReadAll(r.Body)
	_ = json.Unmarshal(b, &req)
	const params = `"kv_transfer_params":{"do_remote_prefill":true,"remote_engine_id":"internal-engine-7","remote_request_id":"r","remote_block_ids":[1,2],"remote_host":"10.9.8.7","remote_port":5601,"tp_size":1}`
	switch {
	case req["max_tokens"] == 99.0:
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusBadRequest)
		_, _ = io.WriteString(w, `{"error":{"message":"no","type":"BadRequestError","code":400},`+params+`}`)
	case req["stream"] == true:
		sseHandler([]string{
			"data: {\"id\":\"d\",\"choices\":[{\"index\":0,\"text\":\"he\"}]}\n\n",
			"data: {\"id\":\"d\",\"choices\":[{\"index\":0,\"text\":\"llo\",\"finish_reason\":\"length\"}]," + params + "}\n\n",
			"data: [DONE]\n\n",
		}, "")(w, r)
	default:
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"c","object":"text_completion","choices":[{"index":0,"text":"hello","finish_reason":"length"}],`+params+`}`)
	}
}

// TestEnginesKVTransferParamsNeverReachTheClient: the host, port and engine
// id an engine answers in kv_transfer_params stay with the router.
func TestEnginesKVTransferParamsNeverReachTheClient(t *testing.T) {
	e := newEnv(t, envOpts{})
	e.fakeRole(2, router.RoleBoth, engineHoldingKV)
	for _, client := range []map[string]any{
		{"model": "m", "prompt": tokens(64, 1), "max_tokens": 4, "kv_transfer_params": map[string]any{"do_remote_decode": true}},
		{"model": "m", "prompt": tokens(64, 2), "max_tokens": 4, "stream": true, "kv_transfer_params": map[string]any{"do_remote_decode": true}},
		{"model": "m", "prompt": tokens(64, 3), "max_tokens": 4, "nvext": map[string]any{"extra_fields": []string{"worker_id"}}},
		{"model": "m", "prompt": tokens(64, 4), "max_tokens": 99},
	} {
		_, body := e.post("/v1/completions", client)
		for _, leak := range []string{"kv_transfer_params", "10.9.8.7", "5601", "internal-engine-7"} {
			if strings.Contains(string(body), leak) {
				t.Fatalf("the client got %q: %s", leak, body)
			}
		}
		if !strings.Contains(string(body), "llo") && client["max_tokens"] != 99 {
			t.Fatalf("the answer lost its text: %s", body)
		}
	}
	e.settle()
}
