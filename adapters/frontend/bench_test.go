package frontend

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/kvrouter/kvrouter/core/router"
)

// BenchmarkCompletion is the frontend's own path for one short
// non-streamed completion, engine round trip on loopback included.
func BenchmarkCompletion(b *testing.B) {
	benchCompletion(b, []byte(`{"model":"m","prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20],"max_tokens":1}`))
}

// BenchmarkCompletion8k is the frontend's path for a typical request: an
// 8k-token prompt of token ids with nvext, read, routed and spliced for
// the engine.
func BenchmarkCompletion8k(b *testing.B) {
	body, _ := json.Marshal(map[string]any{"model": "m", "prompt": tokens(8192, 1), "max_tokens": 1, "nvext": map[string]any{"extra_fields": []string{"worker_id"}}})
	benchCompletion(b, body)
}

// benchCompletion sends body through the handler, called directly, to a
// fake engine answering at once.
func benchCompletion(b *testing.B, body []byte) {
	r, err := router.New(router.DefaultConfig())
	if err != nil {
		b.Fatal(err)
	}
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		_, _ = io.Copy(io.Discard, req.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"choices":[{"text":"x"}],"usage":{"completion_tokens":1}}`)
	}))
	defer engine.Close()
	r.AddWorker(router.WorkerInfo{ID: 1, Model: "m", TotalKVBlocks: 16384})
	workers := []Worker{{ID: 1, Name: "e", BaseURL: engine.URL, Model: "m", DPSize: 1}}
	fe, err := New(Config{Router: r, Workers: func() []Worker { return workers }})
	if err != nil {
		b.Fatal(err)
	}
	h := fe.Handler()
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		w := httptest.NewRecorder()
		h.ServeHTTP(w, httptest.NewRequest(http.MethodPost, "/v1/completions", bytes.NewReader(body)))
		if w.Code != http.StatusOK {
			b.Fatalf("%d %s", w.Code, w.Body)
		}
	}
}
