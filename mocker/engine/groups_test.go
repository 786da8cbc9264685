package engine

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"testing"
)

func TestParseKVCacheGroups(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want []KVCacheGroup
		err  bool
	}{
		{in: "", want: nil},
		{in: "full:16,sliding_window:32:4096", want: []KVCacheGroup{{"full_attention", 16, 0}, {"sliding_window", 32, 4096}}},
		{in: "sliding:32:4096, full_attention", want: []KVCacheGroup{{"sliding_window", 32, 4096}, {"full_attention", 0, 0}}},
		{in: "mla:64,mamba:528,chunked_local_attention:64:8192", want: []KVCacheGroup{{"mla_attention", 64, 0}, {"mamba", 528, 0}, {"chunked_local_attention", 64, 8192}}},
		{in: "sliding_window:32:4096", err: true},         // no main-attention group
		{in: "full:16,sliding_window:32", err: true},      // a window needs its size
		{in: "full:16:128", err: true},                    // full attention has no window
		{in: "full:16,linear:16", err: true},              // unknown kind
		{in: "full:0", err: true},                         // not positive
		{in: "full:x", err: true},                         // not a number
		{in: "full:16,sliding_window:32:64:1", err: true}, // too many fields
	} {
		got, err := ParseKVCacheGroups(tc.in)
		if (err != nil) != tc.err || !reflect.DeepEqual(got, tc.want) {
			t.Errorf("ParseKVCacheGroups(%q) = %v, %v; want %v, error %v", tc.in, got, err, tc.want, tc.err)
		}
	}
}

func TestKVCacheGroupsConfig(t *testing.T) {
	base := Config{BlockSize: 16, NumGPUBlocks: 64, MaxNumSeqs: 4, MaxNumBatchedTokens: 256, EnablePrefixCaching: true}
	for _, groups := range [][]KVCacheGroup{
		{{"full_attention", 32, 0}},                           // not --block-size
		{{"sliding_window", 0, 64}, {"full_attention", 0, 0}}, // a side group needs its size
		{{"mamba", 16, 0}},                                    // no main-attention group
	} {
		cfg := base
		cfg.KVCacheGroups = groups
		if _, err := New(cfg); !errors.Is(err, ErrInvalid) {
			t.Errorf("groups %v: err %v, want ErrInvalid", groups, err)
		}
	}
	cfg := base
	cfg.KVCacheGroups = []KVCacheGroup{{"sliding_window", 32, 64}, {"full_attention", 0, 0}}
	if g := cfg.Group(1); g != (KVCacheGroup{"full_attention", 16, 0}) {
		t.Errorf("Group(1) = %v", g)
	}
	if g := base.Group(0); g != (KVCacheGroup{BlockSize: 16}) {
		t.Errorf("a plain model's Group(0) = %v", g)
	}
}

// One request's step on a hybrid model whose group 0 is a sliding window
// of 32-token blocks over 64 tokens and group 1 full attention: each group
// stores its own blocks, and the sliding group drops those that left its
// window.
func TestHybridEngineEvents(t *testing.T) {
	cfg := Config{BlockSize: 16, NumGPUBlocks: 64, MaxNumSeqs: 4, MaxNumBatchedTokens: 256, EnablePrefixCaching: true, Seed: 5,
		KVCacheGroups: []KVCacheGroup{{"sliding_window", 32, 64}, {"full_attention", 0, 0}}}
	e := mustNew(t, cfg)
	toks := seqTokens(100, 128)
	mustAdd(t, e, "a", toks, 1)
	res := e.Step()
	var own, side []BlockEvent
	for _, ev := range res.Events {
		switch ev.Group {
		case 1:
			own = append(own, ev)
		case 0:
			side = append(side, ev)
		default:
			t.Fatalf("event of group %d", ev.Group)
		}
	}
	if len(own) != 1 || own[0].Kind != Stored || len(own[0].BlockHashes) != 8 {
		t.Fatalf("own group events %+v", own)
	}
	if len(side) != 2 || side[0].Kind != Stored || len(side[0].BlockHashes) != 4 || len(side[0].TokenIDs) != 128 || side[1].Kind != Removed {
		t.Fatalf("sliding group events %+v", side)
	}
	if want := hashBlock(cfg.Seed, 0, toks[:32]); side[0].BlockHashes[0] != want {
		t.Fatalf("sliding block id %x, want %x", side[0].BlockHashes[0], want)
	}
	// 128 tokens computed: the window covers tokens 64..127, blocks 2 and 3.
	if !slices.Equal(side[1].BlockHashes, side[0].BlockHashes[:2]) {
		t.Fatalf("removed %x, want the first two sliding blocks %x", side[1].BlockHashes, side[0].BlockHashes[:2])
	}

	// At equal block sizes the groups name the same content alike, as
	// vLLM's, whose block hash does not mix in the group.
	cfg.KVCacheGroups = []KVCacheGroup{{"full_attention", 0, 0}, {"sliding_window", 16, 1024}}
	e = mustNew(t, cfg)
	mustAdd(t, e, "a", toks, 1)
	res = e.Step()
	if len(res.Events) != 2 || res.Events[0].Group != 0 || res.Events[1].Group != 1 || !slices.Equal(res.Events[0].BlockHashes, res.Events[1].BlockHashes) {
		t.Fatalf("events %+v", res.Events)
	}
}

// sideIndex is what a consumer of one side group's events builds.
type sideIndex struct {
	seed    uint64
	bs      int
	present map[uint64]bool
}

func (x *sideIndex) apply(t *testing.T, ev BlockEvent) {
	t.Helper()
	switch ev.Kind {
	case Stored:
		if len(ev.BlockHashes) == 0 || len(ev.TokenIDs) != len(ev.BlockHashes)*x.bs {
			t.Fatalf("group %d: stored event with %d blocks and %d tokens", ev.Group, len(ev.BlockHashes), len(ev.TokenIDs))
		}
		var parent uint64
		if ev.Parent != nil {
			parent = *ev.Parent // a sliding group's parent may be gone already
		}
		for i, h := range ev.BlockHashes {
			if want := hashBlock(x.seed, parent, ev.TokenIDs[i*x.bs:(i+1)*x.bs]); h != want || x.present[h] {
				t.Fatalf("group %d: stored block %x: id of its content %x, stored before %v", ev.Group, h, want, x.present[h])
			}
			x.present[h] = true
			parent = h
		}
	case Removed:
		for _, h := range ev.BlockHashes {
			if !x.present[h] {
				t.Fatalf("group %d: removed block %x was never stored", ev.Group, h)
			}
			delete(x.present, h)
		}
	case Cleared:
		clear(x.present)
	}
}

// Random streams on a hybrid model: the engine's own group behaves and
// publishes exactly as a plain model's, and every side group's events add
// up to what it caches.
func TestHybridRandomStreams(t *testing.T) {
	cfg := Config{BlockSize: 4, NumGPUBlocks: 48, MaxNumSeqs: 4, MaxNumBatchedTokens: 32, EnablePrefixCaching: true, Seed: 9,
		KVCacheGroups: []KVCacheGroup{{"sliding_window", 8, 24}, {"full_attention", 0, 0}, {"mamba", 16, 0}}}
	e := mustNew(t, cfg)
	plain := cfg
	plain.KVCacheGroups = nil
	twin := mustNew(t, plain)
	own := newEventIndex(cfg)
	sides := map[int]*sideIndex{}
	for _, g := range []int{0, 2} {
		sides[g] = &sideIndex{seed: cfg.Seed, bs: cfg.Group(g).BlockSize, present: map[uint64]bool{}}
	}
	rng := rand.New(rand.NewPCG(4, 2))
	prefix := randTokens(rng, 60, 1000)
	dropped, reset := 0, false
	for step := 0; step < 3000 || !e.Idle(); step++ {
		if step > 60000 {
			t.Fatal("the engine does not drain")
		}
		if step < 3000 && rng.IntN(3) == 0 {
			toks := append(slices.Clone(prefix[:rng.IntN(len(prefix))]), randTokens(rng, 1+rng.IntN(20), 1000)...)
			id := fmt.Sprintf("r%d", step)
			maxOut := 1 + rng.IntN(20)
			mustAdd(t, e, id, toks, maxOut)
			mustAdd(t, twin, id, toks, maxOut)
		}
		res, tres := e.Step(), twin.Step()
		var ownEvents []BlockEvent
		for _, ev := range res.Events {
			if ev.Group == 1 {
				ownEvents = append(ownEvents, ev)
				continue
			}
			if ev.Kind == Removed && ev.Group == 0 {
				dropped += len(ev.BlockHashes)
			}
			sides[ev.Group].apply(t, ev)
		}
		for i := range ownEvents {
			ownEvents[i].Group = 0
		}
		if !reflect.DeepEqual(ownEvents, tres.Events) || !reflect.DeepEqual(res.Outputs, tres.Outputs) {
			t.Fatalf("step %d: the own group differs from a plain model's:\n%+v\n%+v", step, ownEvents, tres.Events)
		}
		own.apply(t, ownEvents)
		own.check(t, e)
		checkEngine(t, e)
		for i, g := range e.bm.groups {
			x := sides[g.idx]
			if len(x.present) != len(g.blocks) || len(g.blocks) > g.capacity+cfg.MaxNumSeqs*200 {
				t.Fatalf("step %d: group %d caches %d blocks, its events say %d", step, g.idx, len(g.blocks), len(x.present))
			}
			for h := range g.blocks {
				if !x.present[h] {
					t.Fatalf("step %d: group %d caches %x, never published", step, i, h)
				}
			}
		}
		if step >= 2000 && !reset && e.Idle() {
			evs, ok := e.ResetPrefixCache()
			if _, tok := twin.ResetPrefixCache(); !ok || !tok {
				t.Fatal("reset refused on idle engines")
			}
			reset = true
			for _, ev := range evs {
				own.apply(t, []BlockEvent{ev})
				for _, x := range sides {
					x.apply(t, ev)
				}
			}
		}
	}
	if dropped == 0 || !reset {
		t.Errorf("dropped %d sliding blocks, reset %v: the test does not exercise them", dropped, reset)
	}
}

// A side group keys its blocks by the request's extra keys too, and
// publishes them, as the engine's own group does.
func TestSideGroupKeysBlocksByExtraKeys(t *testing.T) {
	cfg := DefaultConfig()
	cfg.BlockSize = 4
	cfg.KVCacheGroups = []KVCacheGroup{{Kind: "full_attention"}, {Kind: "sliding_window", BlockSize: 8, SlidingWindow: 64}}
	e := mustNew(t, cfg)
	side := func(stored []BlockEvent) []BlockEvent {
		var out []BlockEvent
		for _, ev := range stored {
			if ev.Group == 1 {
				out = append(out, ev)
			}
		}
		return out
	}
	_, a := runOne(t, e, Request{ID: "a", Tokens: seqTokens(1, 16), MaxTokens: 1, CacheSalt: "t1"})
	_, b := runOne(t, e, Request{ID: "b", Tokens: seqTokens(1, 16), MaxTokens: 1, CacheSalt: "t2"})
	sa, sb := side(a), side(b)
	if len(sa) != 1 || len(sb) != 1 {
		t.Fatalf("side group events: %+v / %+v", sa, sb)
	}
	if sa[0].BlockHashes[0] == sb[0].BlockHashes[0] {
		t.Fatal("two salts share a side-group block")
	}
	if !reflect.DeepEqual(sa[0].ExtraKeys, [][]any{{"t1"}, nil}) {
		t.Fatalf("side group's extra keys: %v", sa[0].ExtraKeys)
	}
}
