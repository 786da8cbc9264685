package frontend

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/kvrouter/kvrouter/core/router"
)

// BenchmarkCompletion is the frontend's own path for one non-streamed
// completion, engine round trip on loopback included.
func BenchmarkCompletion(b *testing.B) {
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"choices":[{"text":"ok"}],"usage":{"completion_tokens":1}}`))
	}))
	defer engine.Close()
	r, err := router.New(router.DefaultConfig())
	if err != nil {
		b.Fatal(err)
	}
	r.AddWorker(router.WorkerInfo{ID: 1, Model: mockModel, TotalKVBlocks: 4096})
	workers := []Worker{{ID: 1, Name: "e", BaseURL: engine.URL, Model: mockModel, DPSize: 1}}
	fe, err := New(Config{Router: r, Workers: func() []Worker { return workers }})
	if err != nil {
		b.Fatal(err)
	}
	h := fe.Handler()
	body := []byte(`{"model":"kvrouter-mock","prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19,20],"max_tokens":1}`)
	b.ReportAllocs()
	for b.Loop() {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/v1/completions", bytes.NewReader(body)))
		if rec.Code != http.StatusOK {
			b.Fatalf("%d %s", rec.Code, rec.Body)
		}
	}
}
