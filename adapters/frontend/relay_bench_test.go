package frontend

import (
	"bytes"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/kvrouter/kvrouter/core/router"
)

// BenchmarkStreamRelay relays one streamed completion of 1,000 chunks, in
// the mocker's shape, from an engine on loopback to the client; migration
// on keeps what a continuation would need.
func BenchmarkStreamRelay(b *testing.B) {
	var payload []byte
	for i := range 1000 {
		payload = fmt.Appendf(payload, "data: {\"id\":\"cmpl-1\",\"object\":\"text_completion\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"text\":\" w%d\",\"logprobs\":null,\"finish_reason\":null}]}\n\n", i)
	}
	payload = append(payload, "data: [DONE]\n\n"...)
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = w.Write(payload)
	}))
	defer engine.Close()
	body := []byte(`{"model":"m","prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17],"max_tokens":1000,"stream":true}`)
	for _, limit := range []int{0, 1} {
		b.Run(fmt.Sprintf("migration-limit=%d", limit), func(b *testing.B) {
			rt, err := router.New(router.DefaultConfig())
			if err != nil {
				b.Fatal(err)
			}
			rt.AddWorker(router.WorkerInfo{ID: 1, Model: "m", TotalKVBlocks: 4096})
			workers := []Worker{{ID: 1, Name: "e", BaseURL: engine.URL, Model: "m"}}
			fe, err := New(Config{Router: rt, Workers: func() []Worker { return workers }, MigrationLimit: limit})
			if err != nil {
				b.Fatal(err)
			}
			h := fe.Handler()
			b.SetBytes(int64(len(payload)))
			b.ReportAllocs()
			for b.Loop() {
				w := httptest.NewRecorder()
				h.ServeHTTP(w, httptest.NewRequest(http.MethodPost, "/v1/completions", bytes.NewReader(body)))
				if w.Code != 200 || !bytes.HasSuffix(w.Body.Bytes(), []byte("data: [DONE]\n\n")) {
					b.Fatalf("%d %q", w.Code, w.Body.Bytes())
				}
			}
		})
	}
}
