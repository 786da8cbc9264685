package frontend

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/kvrouter/kvrouter/core/router"
)

// TestLargePromptsAllocateLittleBeyondTheirSize sends 16 concurrent text
// prompts of 2 MiB through tokenization, routing and forwarding, and
// bounds what the frontend allocates per request by a small multiple of
// the body: decoding the token list through []int64, re-encoding the
// prompt for /tokenize and the body for the engine once cost 25 times it.
func TestLargePromptsAllocateLittleBeyondTheirSize(t *testing.T) {
	e := newEnv(t, envOpts{maxBody: 8 << 20, router: func(c *router.Config) { c.PredictedTTL = 0 }})
	const size, concurrent = 2 << 20, 16
	text := strings.Repeat("hello world ", size/12)
	tokenList := []byte(`{"tokens":[` + strings.TrimSuffix(strings.Repeat("12345,", len(text)/6), ",") + `],"count":1}`)
	e.fake(1, "m", 1, func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		if r.URL.Path == "/tokenize" {
			w.Header().Set("Content-Length", strconv.Itoa(len(tokenList)))
			_, _ = w.Write(tokenList)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"choices":[{"text":"x"}],"usage":{"completion_tokens":1}}`)
	})
	body, err := json.Marshal(map[string]any{"model": "m", "prompt": text, "max_tokens": 1, "nvext": map[string]any{"extra_fields": []string{"worker_id"}}})
	if err != nil {
		t.Fatal(err)
	}
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	var wg sync.WaitGroup
	statuses := make([]int, concurrent)
	for i := range concurrent {
		wg.Go(func() {
			resp, err := http.Post(e.srv.URL+"/v1/completions", "application/json", bytes.NewReader(body))
			if err != nil {
				t.Error(err)
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			statuses[i] = resp.StatusCode
		})
	}
	wg.Wait()
	e.settle()
	runtime.ReadMemStats(&after)
	for i, s := range statuses {
		if s != http.StatusOK {
			t.Fatalf("request %d: status %d", i, s)
		}
	}
	perRequest := float64(after.TotalAlloc-before.TotalAlloc) / concurrent
	t.Logf("allocated %.1f MiB per request of %.1f MiB", perRequest/(1<<20), float64(len(body))/(1<<20))
	if perRequest > 4*float64(len(body)) {
		t.Fatalf("allocated %.1f× the body per request, want ≤ 4×", perRequest/float64(len(body)))
	}
}
