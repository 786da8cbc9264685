package chaos

import (
	"bytes"
	"context"
	"encoding/json"
	"testing"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
)

// A router that lost an engine's history re-anchors the engine's events in
// the prompts it routed; the prefix above the anchor is held under ids the
// router makes up. The end-of-run check must see that index as equal to the
// engine's cache by content, and count the blocks it knows under an
// inferred id, rather than report them as both missing and extra.
func TestIndexComparedByContentAfterALostHistory(t *testing.T) {
	const bs = 4
	cfg := router.DefaultConfig()
	cfg.BlockSize = bs
	r, err := router.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	w := kv.Worker{ID: 1}
	r.AddWorker(router.WorkerInfo{ID: w.ID})

	prompt := make([]uint32, 4*bs+2)
	for i := range prompt {
		prompt[i] = uint32(100 + i)
	}
	other := []uint32{9, 9, 9, 9}
	// Engine ids of the prompt's four blocks; the router never saw 900
	// stored (its event was lost), and no event names it later.
	engineIDs := []uint64{900, 901, 902, 903}
	stored := func(parent uint64, ids []uint64, toks []uint32) error {
		return r.ApplyEngineStored(&router.EngineStored{Worker: w, Parent: &parent, EngineHashes: ids, Tokens: toks, BlockSize: bs})
	}
	// Refused: it opens the rank's recovery, which keeps the prompts
	// booked from then on.
	if err := stored(800, []uint64{801}, other); err == nil {
		t.Fatal("a block below an unknown parent was accepted with no prompt to place it")
	}
	if _, err := r.BestWorker(context.Background(), &router.Request{ID: "a", Tokens: prompt}); err != nil {
		t.Fatal(err)
	}
	if err := stored(engineIDs[1], engineIDs[2:], prompt[2*bs:4*bs]); err != nil {
		t.Fatalf("re-anchoring: %v", err)
	}

	dump, err := json.Marshal(r.DumpEvents())
	if err != nil {
		t.Fatal(err)
	}
	held, err := heldFromDump(bytes.NewReader(dump))
	if err != nil {
		t.Fatal(err)
	}
	have := held[w.ID]
	wantSeqs := map[uint64]bool{}
	for _, seq := range r.HeldBlocks(w) {
		wantSeqs[seq] = true
	}
	if len(have.seqs) != 4 || len(wantSeqs) != 4 {
		t.Fatalf("dump read as %d blocks, router holds %d; want 4 each", len(have.seqs), len(wantSeqs))
	}
	for seq := range wantSeqs {
		if !have.seqs[seq] {
			t.Fatalf("the dump lost held block %x", seq)
		}
	}

	// The engine's cache, with its own ids.
	engine := newHeldBlocks()
	h := blockhash.New(bs, "")
	var seq uint64
	for i, id := range engineIDs {
		local := h.LocalHash(prompt[i*bs : (i+1)*bs])
		if i == 0 {
			seq = local
		} else {
			seq = blockhash.Chain(seq, local)
		}
		engine.ids[id], engine.seqs[seq] = seq, true
	}
	row := compareHeld("engine-1", have, engine)
	if row.Missing != 0 || row.Extra != 0 || row.Unnamed != 1 || row.RouterBlocks != 4 || row.EngineBlocks != 4 {
		t.Fatalf("comparison %+v: want equal by content, 1 block under an inferred id", row)
	}

	// Content the router lacks, or holds and the engine does not, counts.
	delete(engine.seqs, seq)
	engine.seqs[seq^1] = true
	engine.ids[engineIDs[3]] = seq ^ 1
	if row := compareHeld("engine-1", have, engine); row.Missing != 1 || row.Extra != 1 {
		t.Fatalf("comparison %+v: want 1 missing, 1 extra", row)
	}
}
