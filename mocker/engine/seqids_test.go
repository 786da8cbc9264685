package engine

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/core/blockhash"
)

// idRenaming checks that two engines' ids name the same blocks: every id
// of one engine always meets the same id of the other.
type idRenaming struct{ to, from map[uint64]uint64 }

func (r *idRenaming) same(t *testing.T, a, b uint64) {
	t.Helper()
	if x, ok := r.to[a]; ok && x != b {
		t.Fatalf("id %#x met %#x and %#x", a, x, b)
	}
	if x, ok := r.from[b]; ok && x != a {
		t.Fatalf("id %#x met %#x and %#x", b, x, a)
	}
	r.to[a], r.from[b] = b, a
}

// withoutNames is a step result with its ids, generated tokens and the
// blocks' tokens left out (generated tokens seed on the prompt's last
// block id), after checking a's ids against b's.
func withoutNames(t *testing.T, r *idRenaming, a, b StepResult) (StepResult, StepResult) {
	t.Helper()
	strip := func(s StepResult) StepResult {
		s.Outputs = slices.Clone(s.Outputs)
		for i := range s.Outputs {
			s.Outputs[i].Token = 0
		}
		s.Events = slices.Clone(s.Events)
		for i := range s.Events {
			ev := &s.Events[i]
			ev.BlockHashes, ev.Parent, ev.TokenIDs, ev.LocalHashes = nil, nil, nil, nil
		}
		return s
	}
	if len(a.Events) == len(b.Events) {
		for i := range a.Events {
			ea, eb := &a.Events[i], &b.Events[i]
			if len(ea.BlockHashes) != len(eb.BlockHashes) || (ea.Parent == nil) != (eb.Parent == nil) {
				break
			}
			for j := range ea.BlockHashes {
				r.same(t, ea.BlockHashes[j], eb.BlockHashes[j])
			}
			if ea.Parent != nil {
				r.same(t, *ea.Parent, *eb.Parent)
			}
		}
	}
	return strip(a), strip(b)
}

// checkSequenceHashes checks that a Stored event of an engine of
// sequence-hash ids names its blocks by the router's hashes of their
// tokens under their request's keys.
func checkSequenceHashes(t *testing.T, ev *BlockEvent, bs int, keys map[int32][2]string) {
	t.Helper()
	if ev.Kind != Stored || ev.Host {
		return
	}
	k := keys[ev.Tag]
	h := blockhash.NewKeyed(bs, k[0], k[1])
	local := h.LocalHashes(ev.TokenIDs)
	seq := blockhash.SequenceHashes(local)
	if ev.Parent != nil {
		prev := *ev.Parent
		for i, l := range local {
			prev = blockhash.Chain(prev, l)
			seq[i] = prev
		}
	}
	if !slices.Equal(ev.LocalHashes, local) || !slices.Equal(ev.BlockHashes, seq) {
		t.Fatalf("stored blocks %#x (local %#x), the router hashes them %#x (local %#x)", ev.BlockHashes, ev.LocalHashes, seq, local)
	}
}

// An engine that names its blocks by sequence hashes does what one of its
// own ids does, step by step (the same outputs, durations and events, its
// ids a renaming of the other's), with and without a host tier, for
// plain, salted and adapted requests; and its ids are the router's
// sequence hashes of the blocks, chained from their parents.
func TestSequenceHashIDsRenameBlocks(t *testing.T) {
	for _, cpu := range []int{0, 48} {
		cfg := Config{BlockSize: 4, NumGPUBlocks: 64, NumCPUBlocks: cpu, MaxNumSeqs: 8, MaxNumBatchedTokens: 64, EnablePrefixCaching: true, Seed: 3}
		seqCfg := cfg
		seqCfg.SequenceHashIDs = true
		own, seq := mustNew(t, cfg), mustNew(t, seqCfg)
		r := &idRenaming{to: map[uint64]uint64{}, from: map[uint64]uint64{}}
		keys := map[int32][2]string{}
		rng := rand.New(rand.NewPCG(5+uint64(cpu), 0))
		prefix := randTokens(rng, 120, 500)
		stored := 0
		for step := 0; step < 600 || !own.Idle() || !seq.Idle(); step++ {
			if step > 5000 {
				t.Fatal("engines never idle")
			}
			if step < 600 && rng.IntN(3) == 0 {
				toks := slices.Concat(prefix[:rng.IntN(120)], randTokens(rng, 1+rng.IntN(60), 500))
				req := Request{ID: fmt.Sprint(step), Tokens: toks, MaxTokens: 1 + rng.IntN(30), Tag: int32(step + 1)}
				switch rng.IntN(5) {
				case 0:
					req.CacheSalt = []string{"a", "b"}[rng.IntN(2)]
				case 1:
					req.LoRA = "l"
				}
				keys[req.Tag] = [2]string{req.LoRA, req.CacheSalt}
				for _, e := range []*Engine{own, seq} {
					q := req
					q.Tokens = slices.Clone(toks)
					if err := e.Add(q); err != nil {
						t.Fatal(err)
					}
				}
			}
			ra, rb := own.Step(), seq.Step()
			for i := range rb.Events {
				checkSequenceHashes(t, &rb.Events[i], cfg.BlockSize, keys)
				if rb.Events[i].Kind == Stored {
					stored++
				}
			}
			if a, b := withoutNames(t, r, ra, rb); !reflect.DeepEqual(a, b) {
				t.Fatalf("cpu %d, step %d: the engines differ beyond their ids:\n%+v\n%+v", cpu, step, a, b)
			}
		}
		if stored < 100 {
			t.Fatalf("cpu %d: only %d stored events", cpu, stored)
		}
	}
}

// An engine of sequence-hash ids handed its prompts' hashes steps exactly
// as one that hashes them itself, whether it gets all of a prompt's or the
// first few; and a wrong hash shows, so the comparison would see hashes
// taken without checking.
func TestSuppliedSequenceHashesChangeNothing(t *testing.T) {
	for _, c := range []struct {
		cpu   int
		wrong bool
	}{{0, false}, {0, true}, {48, false}, {48, true}} {
		cfg := Config{BlockSize: 4, NumGPUBlocks: 64, NumCPUBlocks: c.cpu, MaxNumSeqs: 8, MaxNumBatchedTokens: 64, EnablePrefixCaching: true, Seed: 3, SequenceHashIDs: true}
		wrong := c.wrong
		a, b := mustNew(t, cfg), mustNew(t, cfg)
		rng := rand.New(rand.NewPCG(22, uint64(c.cpu)))
		prefix := randTokens(rng, 120, 500)
		differ := false
		for step := 0; step < 600 || !a.Idle() || !b.Idle(); step++ {
			if step > 5000 {
				t.Fatal("engines never idle")
			}
			if step < 600 && rng.IntN(3) == 0 {
				toks := slices.Concat(prefix[:rng.IntN(120)], randTokens(rng, 1+rng.IntN(60), 500))
				salt := []string{"", "", "s"}[rng.IntN(3)]
				local, seq := blockhash.NewKeyed(cfg.BlockSize, "", salt).Hashes(toks)
				n := rng.IntN(len(local) + 1)
				local, seq = local[:n], seq[:n]
				if wrong && n > 0 {
					seq[n-1]++
				}
				id, maxTokens := fmt.Sprint(step), 1+rng.IntN(30)
				if err := a.Add(Request{ID: id, Tokens: slices.Clone(toks), MaxTokens: maxTokens, CacheSalt: salt, BlockIDs: seq, LocalHashes: local}); err != nil {
					t.Fatal(err)
				}
				if err := b.Add(Request{ID: id, Tokens: slices.Clone(toks), MaxTokens: maxTokens, CacheSalt: salt}); err != nil {
					t.Fatal(err)
				}
			}
			if ra, rb := a.Step(), b.Step(); !reflect.DeepEqual(ra, rb) {
				if !wrong {
					t.Fatalf("cpu %d, step %d: supplied sequence hashes changed the step", c.cpu, step)
				}
				differ = true
			}
		}
		if wrong && !differ {
			t.Fatalf("cpu %d: wrong sequence hashes changed nothing", c.cpu)
		}
	}
}

func TestSequenceHashIDsValidation(t *testing.T) {
	cfg := Config{BlockSize: 4, NumGPUBlocks: 64, MaxNumSeqs: 8, MaxNumBatchedTokens: 64, EnablePrefixCaching: true, SequenceHashIDs: true}
	withGroups := cfg
	withGroups.KVCacheGroups = []KVCacheGroup{{BlockSize: 4}, {BlockSize: 4, SlidingWindow: 8}}
	if _, err := New(withGroups); !errors.Is(err, ErrInvalid) {
		t.Errorf("KV-cache groups: %v, want ErrInvalid", err)
	}
	e, own := mustNew(t, cfg), mustNew(t, Config{BlockSize: 4, NumGPUBlocks: 64, MaxNumSeqs: 8, MaxNumBatchedTokens: 64, EnablePrefixCaching: true})
	toks := seqTokens(0, 9) // two full blocks
	local, seq := blockhash.New(4, "").Hashes(toks)
	for _, c := range []struct {
		e *Engine
		r Request
	}{
		{e, Request{ID: "mm", Tokens: toks, MaxTokens: 1, MM: []MMFeature{{Identifier: "x", Offset: 0, Length: 2}}}},
		{e, Request{ID: "nolocal", Tokens: toks, MaxTokens: 1, BlockIDs: seq}},
		{e, Request{ID: "short", Tokens: toks, MaxTokens: 1, BlockIDs: seq, LocalHashes: local[:1]}},
		{e, Request{ID: "long", Tokens: toks[:7], MaxTokens: 1, BlockIDs: seq, LocalHashes: local}},
		{own, Request{ID: "local", Tokens: toks, MaxTokens: 1, LocalHashes: local}},
		{own, Request{ID: "own", Tokens: toks, MaxTokens: 1, BlockIDs: seq, LocalHashes: local}},
	} {
		if err := c.e.Add(c.r); !errors.Is(err, ErrInvalid) {
			t.Errorf("%s: %v, want ErrInvalid", c.r.ID, err)
		}
	}
	if err := e.Add(Request{ID: "ok", Tokens: toks, MaxTokens: 1, BlockIDs: seq, LocalHashes: local, CacheSalt: "s"}); err != nil {
		t.Fatal(err)
	}
}
