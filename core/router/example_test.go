package router_test

import (
	"context"
	"fmt"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
)

// A fleet of two engines; engine 1 reports (through a KV event) that it
// cached a 64-token prompt. A request continuing that prompt is routed to
// engine 1, booked, and released when its stream ends.
func Example() {
	r, err := router.New(router.DefaultConfig())
	if err != nil {
		panic(err)
	}
	r.AddWorker(router.WorkerInfo{ID: 0, TotalKVBlocks: 16384, MaxNumBatchedTokens: 8192})
	r.AddWorker(router.WorkerInfo{ID: 1, TotalKVBlocks: 16384, MaxNumBatchedTokens: 8192})

	prompt := make([]uint32, 64)
	for i := range prompt {
		prompt[i] = uint32(1000 + i)
	}
	// What an engine's KV event says, once its token ids are hashed the
	// router's way: four 16-token blocks, engine ids of its own choosing.
	var blocks []kv.Block
	for i, h := range blockhash.New(16, "").LocalHashes(prompt) {
		blocks = append(blocks, kv.Block{EngineHash: uint64(0xe000 + i), LocalHash: h})
	}
	stored := kv.StoredEvent(kv.Worker{ID: 1}, 0, nil, blocks...)
	if err := r.ApplyEvent(&stored); err != nil {
		panic(err)
	}

	followUp := append(prompt, make([]uint32, 32)...) // two more blocks
	d, err := r.BestWorker(context.Background(), &router.Request{ID: "req-1", Tokens: followUp})
	if err != nil {
		panic(err)
	}
	fmt.Printf("worker %v, %d of %d blocks cached\n", d.Worker, d.OverlapBlocks, d.PromptBlocks)

	r.MarkPrefillCompleted("req-1") // first token streamed
	r.Free("req-1")                 // stream ended
	for _, l := range r.Loads() {
		fmt.Printf("worker %v: %.0f active blocks\n", l.Worker, l.ActiveDecodeBlocks)
	}
	// Output:
	// worker 1/0, 4 of 6 blocks cached
	// worker 0/0: 0 active blocks
	// worker 1/0: 0 active blocks
}
