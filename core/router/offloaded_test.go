package router

import (
	"errors"
	"math/rand/v2"
	"testing"

	"github.com/kvrouter/kvrouter/core/kv"
)

// Blocks offloaded by id alone (vLLM's connector: medium CPU, no parent,
// no tokens) are placed from the engine's device blocks: a run with a
// block the host already held is chained below each block's own parent,
// a block never seen on the device is counted, and the book forgets a
// block once no tier holds it.
func TestTokenlessOffloadedBlocksArePlaced(t *testing.T) {
	r, _ := newRouter(t, 0, func(c *Config) { c.BlockSize = 16 })
	r.AddWorker(WorkerInfo{ID: 1})
	rng := rand.New(rand.NewPCG(5, 6))
	toks := randomTokens(rng, 16*8)
	ids := []uint64{11, 12, 13, 14, 15, 16, 17, 18}
	device := func(from, to int) {
		t.Helper()
		es := EngineStored{Worker: w(1), Tokens: toks[from*16 : to*16], BlockSize: 16, EngineHashes: ids[from:to]}
		if from > 0 {
			es.Parent = kv.Ptr(ids[from-1])
		}
		if err := r.ApplyEngineStored(&es); err != nil {
			t.Fatal(err)
		}
	}
	host := func(hashes ...uint64) error {
		return r.ApplyEngineStored(&EngineStored{Worker: w(1), Tier: kv.TierHostPinned, EngineHashes: hashes, Tokens: []uint32{}, BlockSize: 16})
	}
	// The engine's first host block comes before the router books its
	// device blocks: it cannot be placed.
	device(0, 2)
	if err := host(11); !errors.Is(err, ErrUnplacedBlocks) || r.Stats().UnplacedOffloadedBlocks != 1 {
		t.Fatalf("first host block: %v, %d unplaced; want ErrUnplacedBlocks and 1", err, r.Stats().UnplacedOffloadedBlocks)
	}
	device(2, 8)
	// 13 and 14 first, then 15–18 with 16 already there: the event skips
	// it, as vLLM's store leaves out what the host holds.
	if err := host(13, 14); err != nil {
		t.Fatal(err)
	}
	if err := host(16); err != nil {
		t.Fatal(err)
	}
	if err := host(15, 17, 18); err != nil {
		t.Fatal(err)
	}
	// Evict blocks 2..7 from the GPU: the host tier continues the device run of 2.
	ev := kv.RemovedEvent(w(1), 0, ids[2:]...)
	if err := r.ApplyEvent(&ev); err != nil {
		t.Fatal(err)
	}
	c := candidatesFor(t, r, toks)[w(1)]
	if c.OverlapBlocks != 2 || c.HostBlocks != 8 {
		t.Fatalf("device %d host %d, want 2 and 8", c.OverlapBlocks, c.HostBlocks)
	}
	// Blocks 3–7 leave the host too: no tier holds them, the book forgets
	// them, and naming them again cannot place them.
	ev = kv.RemovedEvent(w(1), 0, ids[3:]...)
	ev.Tier = kv.TierHostPinned
	if err := r.ApplyEvent(&ev); err != nil {
		t.Fatal(err)
	}
	if c := candidatesFor(t, r, toks)[w(1)]; c.HostBlocks != 3 {
		t.Fatalf("host %d after the host evicted blocks 3..7, want 3", c.HostBlocks)
	}
	if err := host(ids[3:]...); !errors.Is(err, ErrUnplacedBlocks) || r.Stats().UnplacedOffloadedBlocks != 6 {
		t.Fatalf("forgotten blocks: %v, %d unplaced; want ErrUnplacedBlocks and 6", err, r.Stats().UnplacedOffloadedBlocks)
	}
	if b := r.offload.of(w(1)); len(b.blocks) != 1 {
		t.Fatalf("the book holds %d blocks, want 1 (block 2, on the host; 0 and 1 came before it opened)", len(b.blocks))
	}
}
