package frontend

import (
	"net/http"
	"testing"

	"github.com/kvrouter/kvrouter/core/router"
)

// An engine's KV capacity is counted in its own blocks: one of 64-token
// blocks behind a 16-token router holds four times the tokens.
func TestBookingBoundCountsEachEngineInItsBlockSize(t *testing.T) {
	e := newEnv(t, envOpts{engines: 1})
	w := e.list()[0]
	e.router.AddWorker(router.WorkerInfo{ID: w.ID, Model: w.Model, DPSize: w.DPSize, TotalKVBlocks: 4096, BlockSize: 64})
	book := func(id string, n int) (*http.Response, []byte) {
		return e.post("/router/best_worker", map[string]any{"model": mockModel, "tokens": tokens(n, 1), "request_id": id})
	}
	if resp, body := book("fits", 4096*16+1); resp.StatusCode != 200 {
		t.Fatalf("a booking the engine can hold: %d %s", resp.StatusCode, body)
	}
	e.post("/router/free", map[string]any{"request_id": "fits"})
	if resp, body := book("huge", 4096*64+1); openAIError(t, resp, body, 400) != "booking_too_large" {
		t.Fatal("a booking beyond the engine's 4096 blocks of 64 tokens was accepted")
	}
	e.settle()
}
