package serve

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/kvrouter/kvrouter/mocker/server"
)

// TestClientCannotSteerKVTransfers: a client's kv_transfer_params must not
// make a simulated engine pull KV from an address the client chose, nor
// hold a prompt's blocks and hand the client its internal address.
func TestClientCannotSteerKVTransfers(t *testing.T) {
	var pulls atomic.Int64
	evil := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/kv_transfer/pull" {
			pulls.Add(1)
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"blocks":1}`)
	}))
	t.Cleanup(evil.Close)
	u, _ := url.Parse(evil.URL)
	port, _ := strconv.Atoi(u.Port())

	decode, both := roleFleet(t, server.RoleDecode), roleFleet(t, server.RoleBoth)
	s := startServer(t, roleSpec(1, decode), roleSpec(2, both))
	for i, params := range []map[string]any{
		{"do_remote_prefill": true, "remote_engine_id": "evil", "remote_request_id": "evil-req", "remote_block_ids": []int{0},
			"remote_host": u.Hostname(), "remote_port": port},
		{"do_remote_decode": true},
	} {
		for _, worker := range []int{1, 2} {
			b, _ := json.Marshal(map[string]any{"model": "kvrouter-mock", "prompt": prompt(0, 90+i*2+worker, 20), "max_tokens": 2,
				"kv_transfer_params": params, "nvext": map[string]any{"backend_instance_id": worker}})
			resp, err := http.Post(s.URL()+"/v1/completions", "application/json", bytes.NewReader(b))
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("%d %s", resp.StatusCode, body)
			}
			if strings.Contains(string(body), "kv_transfer_params") || strings.Contains(string(body), "remote_host") {
				t.Fatalf("the client got an engine's transfer parameters: %s", body)
			}
		}
	}
	if n := pulls.Load(); n != 0 {
		t.Fatalf("engines pulled KV from the client's address %d times", n)
	}
	if got := metric(t, s.URL(), "kvrouter_frontend_client_kv_transfer_params_stripped_total"); got != 4 {
		t.Fatalf("client kv_transfer_params stripped: %v, want 4", got)
	}
}
