package router

import (
	"errors"
	"testing"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/kv"
)

// mmPrompt is a prompt of 10 blocks whose tokens [40, 40+72) are one
// image's placeholders (all the same id, as engines expand them): blocks
// 2..6 hold part of it.
func mmPrompt() (toks []uint32, off, n int) {
	toks = tokens(7, 10, 7, 10)
	off, n = 40, 72
	for i := off; i < off+n; i++ {
		toks[i] = 32000
	}
	return toks, off, n
}

// storeMM feeds the router what an engine emits after caching toks with
// the item id on the blocks its placeholders cover, as vLLM's extra keys
// give them.
func storeMM(t *testing.T, r *Router, w kv.Worker, toks []uint32, off, n int, id uint64) {
	t.Helper()
	blocks := len(toks) / bs
	es := EngineStored{Worker: w, Tokens: toks[:blocks*bs], BlockSize: bs, MM: make([][]uint64, blocks)}
	for b := range blocks {
		es.EngineHashes = append(es.EngineHashes, w.ID<<32|uint64(b+1))
		if b*bs < off+n && (b+1)*bs > off {
			es.MM[b] = []uint64{id}
		}
	}
	if err := r.ApplyEngineStored(&es); err != nil {
		t.Fatal(err)
	}
}

// The same tokens around another image are other blocks from the image's
// first placeholder block on; an item the router cannot identify stops the
// match there even when the engine holds that very image; the whole prompt
// still counts as its blocks.
func TestMultimodalBlocksMatchOnlyTheSameItem(t *testing.T) {
	toks, off, n := mmPrompt()
	imgA, _ := blockhash.HashMMIdentifier("image-a")
	imgB, _ := blockhash.HashMMIdentifier("image-b")
	r, _ := newRouter(t, 1, nil)
	storeMM(t, r, w(0), toks, off, n, imgA)
	const before = 2 // blocks 0 and 1 precede the image's first block
	for _, tc := range []struct {
		name string
		item MMItem
		want int
	}{
		{"same image", MMItem{Offset: off, Length: n, Hash: imgA, Known: true}, 10},
		{"other image", MMItem{Offset: off, Length: n, Hash: imgB, Known: true}, before},
		{"unknown identifier", MMItem{Offset: off, Length: n, Hash: imgA}, before},
	} {
		d, err := r.BestWorker(ctx(), &Request{Tokens: toks, MM: []MMItem{tc.item}})
		if err != nil {
			t.Fatal(err)
		}
		if d.OverlapBlocks != tc.want || d.PromptBlocks != 10 {
			t.Errorf("%s: overlap %d of %d blocks, want %d of 10", tc.name, d.OverlapBlocks, d.PromptBlocks, tc.want)
		}
	}
	// Without the item the router would see text-only blocks: the engine
	// holds none of them past the image either.
	if d, _ := r.BestWorker(ctx(), &Request{Tokens: toks}); d.OverlapBlocks != before {
		t.Errorf("without its item the prompt matched %d blocks, want %d", d.OverlapBlocks, before)
	}
}

// A request with an unknown item teaches the approximate index nothing
// past the item's first block: a follow-up with the same unknown item is
// never credited beyond it.
func TestUnknownItemIsNeverPredictedBeyondItsFirstBlock(t *testing.T) {
	toks, off, n := mmPrompt()
	r, _ := newRouter(t, 2, func(c *Config) { c.KVEvents = false })
	item := []MMItem{{Offset: off, Length: n, Hash: 42}}
	if _, err := r.BestWorker(ctx(), &Request{ID: "a", Tokens: toks, MM: item}); err != nil {
		t.Fatal(err)
	}
	d, err := r.BestWorker(ctx(), &Request{Tokens: toks, MM: item})
	if err != nil || d.OverlapBlocks != 2 {
		t.Fatalf("follow-up: %+v (%v), want 2 blocks credited", d, err)
	}
	known := []MMItem{{Offset: off, Length: n, Hash: 42, Known: true}}
	if _, err := r.BestWorker(ctx(), &Request{ID: "b", Tokens: toks, MM: known}); err != nil {
		t.Fatal(err)
	}
	if d, _ := r.BestWorker(ctx(), &Request{Tokens: toks, MM: known}); d.OverlapBlocks != 10 {
		t.Fatalf("a known item's follow-up matched %d blocks, want 10", d.OverlapBlocks)
	}
}

// Engines of another block size are matched with the items placed on
// their own blocks.
func TestMultimodalItemsInAnotherBlockSize(t *testing.T) {
	toks, off, n := mmPrompt()
	img, _ := blockhash.HashMMIdentifier("image-a")
	r, _ := newRouter(t, 0, nil)
	r.AddWorker(WorkerInfo{ID: 1, BlockSize: 32})
	blocks := len(toks) / 32
	es := EngineStored{Worker: w(1), Tokens: toks[:blocks*32], BlockSize: 32, MM: make([][]uint64, blocks)}
	for b := range blocks {
		es.EngineHashes = append(es.EngineHashes, uint64(b+1))
		if b*32 < off+n && (b+1)*32 > off {
			es.MM[b] = []uint64{img}
		}
	}
	if err := r.ApplyEngineStored(&es); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		known bool
		want  int
	}{{true, 10}, {false, 2}} { // engine block 1 = router blocks 2, 3 holds the image
		d, err := r.BestWorker(ctx(), &Request{Tokens: toks, MM: []MMItem{{Offset: off, Length: n, Hash: img, Known: tc.known}}})
		if err != nil || d.OverlapBlocks != tc.want {
			t.Errorf("known=%v: %+v (%v), want %d blocks", tc.known, d, err, tc.want)
		}
	}
}

func TestMultimodalItemsOutsideThePromptAreRefused(t *testing.T) {
	r, _ := newRouter(t, 1, nil)
	toks := tokens(1, 2, 1, 2)
	for _, it := range []MMItem{{Offset: -1, Length: 2}, {Offset: 0, Length: 0}, {Offset: 30, Length: 3}} {
		if _, err := r.BestWorker(ctx(), &Request{Tokens: toks, MM: []MMItem{it}}); !errors.Is(err, ErrInvalidMM) {
			t.Errorf("%+v: %v, want ErrInvalidMM", it, err)
		}
	}
}
