package engine

import (
	"reflect"
	"testing"
)

// runOne serves r alone to completion and returns its cached tokens and
// the Stored events it caused.
func runOne(t *testing.T, e *Engine, r Request) (cached int, stored []BlockEvent) {
	t.Helper()
	if err := e.Add(r); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 10000 && !e.Idle(); i++ {
		res := e.Step()
		for _, o := range res.Outputs {
			if o.ID == r.ID && o.Index == 0 {
				cached = o.CachedTokens
			}
		}
		for _, ev := range res.Events {
			if ev.Kind == Stored {
				ev.TokenIDs = append([]uint32(nil), ev.TokenIDs...)
				stored = append(stored, ev)
			}
		}
	}
	if !e.Idle() {
		t.Fatal("engine never went idle")
	}
	return cached, stored
}

// The same tokens under another salt, adapter or image are other blocks,
// as in vLLM: no cache reuse across them, reuse within each.
func TestExtraKeysSeparateBlocks(t *testing.T) {
	cfg := DefaultConfig()
	cfg.BlockSize = 4
	cfg.NumGPUBlocks = 256
	prompt := seqTokens(100, 12)
	img := []MMFeature{{Identifier: "img-a", Offset: 2, Length: 4}}
	cases := []struct {
		name string
		a, b Request
		hit  int // cached tokens of b after a
	}{
		{"same salt", Request{CacheSalt: "t1"}, Request{CacheSalt: "t1"}, 8},
		{"other salt", Request{CacheSalt: "t1"}, Request{CacheSalt: "t2"}, 0},
		{"salt vs none", Request{}, Request{CacheSalt: "t2"}, 0},
		{"other adapter", Request{LoRA: "a"}, Request{LoRA: "b"}, 0},
		{"adapter vs base", Request{LoRA: "a"}, Request{}, 0},
		{"same image", Request{MM: img}, Request{MM: img}, 8},
		{"other image", Request{MM: img}, Request{MM: []MMFeature{{Identifier: "img-b", Offset: 2, Length: 4}}}, 0},
		{"image moved", Request{MM: img}, Request{MM: []MMFeature{{Identifier: "img-a", Offset: 3, Length: 3}}}, 0},
		{"image in 2nd block only", Request{MM: []MMFeature{{Identifier: "img-a", Offset: 5, Length: 2}}},
			Request{MM: []MMFeature{{Identifier: "img-b", Offset: 5, Length: 2}}}, 4},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			e := mustNew(t, cfg)
			c.a.ID, c.a.Tokens, c.a.MaxTokens = "a", prompt, 1
			c.b.ID, c.b.Tokens, c.b.MaxTokens = "b", prompt, 1
			runOne(t, e, c.a)
			if got, _ := runOne(t, e, c.b); got != c.hit {
				t.Fatalf("cached tokens = %d, want %d", got, c.hit)
			}
		})
	}
}

// Stored events carry each block's extra keys in vLLM's order: adapter,
// (identifier, offset from the block start) per item, salt on block 0.
func TestExtraKeysPublished(t *testing.T) {
	cfg := DefaultConfig()
	cfg.BlockSize = 4
	e := mustNew(t, cfg)
	_, stored := runOne(t, e, Request{ID: "r", Tokens: seqTokens(1, 12), MaxTokens: 1, LoRA: "sql", CacheSalt: "t1",
		MM: []MMFeature{{Identifier: "img", Offset: 2, Length: 3}}})
	if len(stored) != 1 {
		t.Fatalf("stored events: %+v", stored)
	}
	ev := stored[0]
	want := [][]any{{"sql", []any{"img", 2}, "t1"}, {"sql", []any{"img", -2}}, {"sql"}}
	if ev.LoRAName != "sql" || !reflect.DeepEqual(ev.ExtraKeys, want) {
		t.Fatalf("event keys: lora %q %v, want %v", ev.LoRAName, ev.ExtraKeys, want)
	}
	cached := e.CachedBlocks()
	if len(cached) != 3 || !reflect.DeepEqual(cached[0].ExtraKeys, want[0]) || cached[2].LoRAName != "sql" {
		t.Fatalf("cached blocks: %+v", cached)
	}
	_, plain := runOne(t, e, Request{ID: "p", Tokens: seqTokens(1, 12), MaxTokens: 1})
	if len(plain) != 1 || plain[0].ExtraKeys != nil || plain[0].LoRAName != "" {
		t.Fatalf("plain request's events: %+v", plain)
	}
	if plain[0].BlockHashes[0] == ev.BlockHashes[0] {
		t.Fatal("a keyed block and a plain one share an id")
	}
}

func TestExtraKeysValidation(t *testing.T) {
	e := mustNew(t, DefaultConfig())
	for _, mm := range [][]MMFeature{
		{{Identifier: "a", Offset: 0, Length: 0}},
		{{Identifier: "a", Offset: 5, Length: 10}},
		{{Identifier: "", Offset: 0, Length: 1}},
		{{Identifier: "a", Offset: 4, Length: 1}, {Identifier: "b", Offset: 1, Length: 1}},
	} {
		if err := e.Add(Request{ID: "x", Tokens: seqTokens(0, 8), MaxTokens: 1, MM: mm}); err == nil {
			t.Errorf("%+v accepted", mm)
		}
	}
}
