package engine

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"reflect"
	"slices"
	"testing"
	"time"
)

func mustNew(t testing.TB, cfg Config) *Engine {
	t.Helper()
	e, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func mustAdd(t testing.TB, e *Engine, id string, toks []uint32, maxTokens int) {
	t.Helper()
	if err := e.Add(Request{ID: id, Tokens: toks, MaxTokens: maxTokens}); err != nil {
		t.Fatal(err)
	}
}

func seqTokens(base uint32, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = base + uint32(i)
	}
	return out
}

// eventIndex is what a router builds from the engine's events: the set of
// engine block ids it believes cached.
type eventIndex struct {
	seed    uint64
	bs      int
	present map[uint64]bool
	parent  map[uint64]publishedParent // as the Stored events named it
}

type publishedParent struct {
	hash uint64
	root bool
}

func newEventIndex(cfg Config) *eventIndex {
	return &eventIndex{seed: cfg.Seed, bs: cfg.BlockSize, present: map[uint64]bool{}, parent: map[uint64]publishedParent{}}
}

func (x *eventIndex) apply(t *testing.T, evs []BlockEvent) {
	t.Helper()
	for _, e := range evs {
		switch e.Kind {
		case Stored:
			if len(e.BlockHashes) == 0 || len(e.TokenIDs) != len(e.BlockHashes)*x.bs {
				t.Fatalf("stored event with %d blocks and %d tokens", len(e.BlockHashes), len(e.TokenIDs))
			}
			var parent uint64
			root := e.Parent == nil
			if !root {
				parent = *e.Parent
				if !x.present[parent] {
					t.Fatalf("stored event with unknown parent %x", parent)
				}
			}
			for i, h := range e.BlockHashes {
				x.parent[h] = publishedParent{parent, root}
				root = false
				if want := hashBlock(x.seed, parent, e.TokenIDs[i*x.bs:(i+1)*x.bs]); h != want {
					t.Fatalf("stored block %x is not the id of its parent and tokens (%x)", h, want)
				}
				if x.present[h] {
					t.Fatalf("block %x stored twice", h)
				}
				x.present[h] = true
				parent = h
			}
		case Removed:
			for _, h := range e.BlockHashes {
				if !x.present[h] {
					t.Fatalf("removed block %x was never stored", h)
				}
				delete(x.present, h)
			}
		case Cleared:
			clear(x.present)
		default:
			t.Fatalf("event kind %v", e.Kind)
		}
	}
}

func (x *eventIndex) check(t *testing.T, e *Engine) {
	t.Helper()
	cached := e.CachedBlocks()
	if len(x.present) != len(cached) {
		t.Fatalf("events say %d blocks cached, the engine has %d", len(x.present), len(cached))
	}
	listed := make(map[uint64]bool, len(cached))
	for _, b := range cached {
		if !x.present[b.Hash] {
			t.Fatalf("cached block %x never published", b.Hash)
		}
		want := x.parent[b.Hash]
		if (b.Parent == nil) != want.root || b.Parent != nil && *b.Parent != want.hash {
			t.Fatalf("cached block %x: parent %v, published with %+v", b.Hash, b.Parent, want)
		}
		if b.Parent != nil && x.present[*b.Parent] && !listed[*b.Parent] {
			t.Fatalf("cached block %x listed before its parent %x", b.Hash, *b.Parent)
		}
		listed[b.Hash] = true
	}
}

// checkEngine verifies the scheduler's and block manager's invariants.
func checkEngine(t *testing.T, e *Engine) {
	t.Helper()
	var holders []*seqBlocks
	bs := e.cfg.BlockSize
	if len(e.running) > e.cfg.MaxNumSeqs {
		t.Fatalf("%d running > max %d", len(e.running), e.cfg.MaxNumSeqs)
	}
	for _, s := range e.running {
		if s.state != stRunning {
			t.Fatalf("request %s in running with state %d", s.id, s.state)
		}
		holders = append(holders, &s.seqBlocks)
		if e.cfg.EnablePrefixCaching {
			if len(s.blocks) != s.numComputed/bs || s.partial != (s.numComputed%bs != 0) {
				t.Fatalf("request %s computed %d tokens, holds %d full blocks, partial %v", s.id, s.numComputed, len(s.blocks), s.partial)
			}
		} else if s.anon != (s.numComputed+bs-1)/bs {
			t.Fatalf("request %s computed %d tokens, holds %d blocks", s.id, s.numComputed, s.anon)
		}
	}
	for i := 0; i < e.waiting.len(); i++ {
		s := e.waiting.at(i)
		if s.state != stWaiting || len(s.blocks) != 0 || s.partial || s.anon != 0 || s.numComputed != 0 {
			t.Fatalf("waiting request %s holds blocks or computed tokens", s.id)
		}
	}
	if len(e.byID) != len(e.running)+e.waiting.len() {
		t.Fatalf("%d live ids, %d running + %d waiting", len(e.byID), len(e.running), e.waiting.len())
	}
	held := 0
	for id, s := range e.held {
		if e.byID[id] != nil || s.state != stDone || s.partial || s.anon != 0 || len(s.blocks) == 0 || len(s.blocks) > s.numPrompt/bs {
			t.Fatalf("held request %s: live %v, state %d, %d full blocks of a %d-token prompt, partial %v", id, e.byID[id] != nil, s.state, len(s.blocks), s.numPrompt, s.partial)
		}
		held += len(s.blocks)
		holders = append(holders, &s.seqBlocks)
	}
	if held != e.heldBlocks {
		t.Fatalf("held requests hold %d blocks, the engine counts %d", held, e.heldBlocks)
	}
	checkManager(t, e.bm, holders)
}

// TestRandomStreams runs long random request streams (shared prefixes,
// varied lengths, aborts) through engines of various sizes, down to ones so
// small that they preempt all the time, and checks after every step: the
// invariants, the step budget, the outputs of every request, and that an
// index rebuilt from the events equals the engine's cached blocks.
func TestRandomStreams(t *testing.T) {
	for _, tc := range []struct {
		name                       string
		bs, blocks, seqs, budget   int
		maxPrompt, maxOut, steps   int
		every                      int // a batch of 1-3 requests arrives every `every` steps on average
		caching                    bool
		wantPreempt, wantEvictions bool
	}{
		{"tiny", 4, 16, 4, 32, 30, 20, 4000, 3, true, true, true},
		{"small", 16, 64, 8, 128, 400, 200, 4000, 40, true, true, true},
		{"medium", 16, 1024, 32, 512, 2000, 300, 1000, 3, true, false, true},
		{"no-caching", 4, 16, 4, 32, 30, 20, 3000, 3, false, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := Config{BlockSize: tc.bs, NumGPUBlocks: tc.blocks, MaxNumSeqs: tc.seqs,
				MaxNumBatchedTokens: tc.budget, EnablePrefixCaching: tc.caching, Seed: 3}
			e := mustNew(t, cfg)
			idx := newEventIndex(cfg)
			rng := rand.New(rand.NewPCG(1, uint64(tc.blocks)))
			prefixes := make([][]uint32, 3)
			for i := range prefixes {
				prefixes[i] = randTokens(rng, tc.maxPrompt, 1000)
			}
			type reqState struct {
				max, got int
				done     bool
				aborted  bool
			}
			reqs := map[string]*reqState{}
			var live []string
			var evictions, added int
			for step := 0; ; step++ {
				adding := step < tc.steps
				if !adding && e.Idle() {
					break
				}
				if step > tc.steps*20 {
					m := e.Metrics()
					t.Fatalf("the engine does not drain: %+v", m)
				}
				if adding && rng.IntN(tc.every) == 0 {
					for range 1 + rng.IntN(3) {
						pre := prefixes[rng.IntN(len(prefixes))]
						toks := slices.Clone(pre[:rng.IntN(len(pre))])
						toks = append(toks, randTokens(rng, 1+rng.IntN(tc.maxPrompt/4), 1000)...)
						toks = toks[:min(len(toks), tc.maxPrompt)]
						maxOut := 1 + rng.IntN(tc.maxOut)
						if (len(toks)+maxOut+tc.bs-1)/tc.bs > tc.blocks {
							maxOut = tc.blocks*tc.bs - len(toks)
						}
						id := fmt.Sprintf("r%d", added)
						added++
						mustAdd(t, e, id, toks, maxOut)
						reqs[id] = &reqState{max: maxOut}
						live = append(live, id)
					}
				}
				if adding && len(live) > 0 && rng.IntN(40) == 0 {
					i := rng.IntN(len(live))
					if !e.Abort(live[i]) {
						t.Fatalf("abort of live request %s failed", live[i])
					}
					reqs[live[i]].aborted = true
					live = slices.Delete(live, i, i+1)
				}
				res := e.Step()
				if res.PrefillTokens+res.DecodeSeqs > tc.budget {
					t.Fatalf("step %d: %d prefill tokens + %d decodes > budget %d", step, res.PrefillTokens, res.DecodeSeqs, tc.budget)
				}
				if want := StepTime(res.PrefillTokens, res.DecodeSeqs, res.KVUsage); res.Duration != want {
					t.Fatalf("step %d: duration %v, want %v", step, res.Duration, want)
				}
				if !e.Idle() && res.Duration == 0 && res.Preempted == 0 {
					t.Fatalf("step %d: nothing ran while requests wait", step)
				}
				for _, o := range res.Outputs {
					r := reqs[o.ID]
					if r == nil || r.aborted || r.done {
						t.Fatalf("step %d: output for %s, which is not running", step, o.ID)
					}
					if o.Index != r.got || o.Finished != (o.Index == r.max-1) {
						t.Fatalf("step %d: %s output %d (finished %v), want index %d of %d", step, o.ID, o.Index, o.Finished, r.got, r.max)
					}
					if o.Index > 0 && o.CachedTokens != 0 {
						t.Fatalf("CachedTokens on output %d", o.Index)
					}
					if o.Token >= 128000 {
						t.Fatalf("token %d out of the vocabulary", o.Token)
					}
					r.got++
					if o.Finished {
						r.done = true
						live = slices.DeleteFunc(live, func(id string) bool { return id == o.ID })
					}
				}
				if !tc.caching && len(res.Events) > 0 {
					t.Fatal("events with prefix caching off")
				}
				evictions += len(removed(res.Events))
				idx.apply(t, res.Events)
				idx.check(t, e)
				checkEngine(t, e)
			}
			for id, r := range reqs {
				if !r.aborted && (!r.done || r.got != r.max) {
					t.Fatalf("request %s: %d of %d outputs, done %v", id, r.got, r.max, r.done)
				}
			}
			m := e.Metrics()
			t.Logf("%d requests, %d preemptions, %d evictions, prefix hits %d/%d tokens", added, m.Preemptions, evictions, m.PrefixHits, m.PrefixQueries)
			if tc.wantPreempt && m.Preemptions == 0 {
				t.Error("no preemption: the test does not exercise it")
			}
			if tc.wantEvictions && evictions == 0 {
				t.Error("no eviction: the test does not exercise it")
			}
			if tc.caching && m.PrefixHits == 0 {
				t.Error("no prefix hit: the test does not exercise it")
			}
			if m.KVUsage != 0 || m.Running != 0 || m.Waiting != 0 {
				t.Fatalf("drained engine: %+v", m)
			}
		})
	}
}

func TestAddValidation(t *testing.T) {
	e := mustNew(t, Config{BlockSize: 16, NumGPUBlocks: 10, MaxNumSeqs: 4, MaxNumBatchedTokens: 64})
	mustAdd(t, e, "dup", seqTokens(0, 10), 5)
	for _, tc := range []struct {
		name string
		r    Request
		want error
	}{
		{"empty id", Request{Tokens: seqTokens(0, 3), MaxTokens: 1}, ErrInvalid},
		{"empty prompt", Request{ID: "a", MaxTokens: 1}, ErrInvalid},
		{"zero max tokens", Request{ID: "a", Tokens: seqTokens(0, 3)}, ErrInvalid},
		{"negative max tokens", Request{ID: "a", Tokens: seqTokens(0, 3), MaxTokens: -1}, ErrInvalid},
		{"duplicate", Request{ID: "dup", Tokens: seqTokens(0, 3), MaxTokens: 1}, ErrDuplicateID},
		{"too long", Request{ID: "a", Tokens: seqTokens(0, 150), MaxTokens: 11}, ErrPromptTooLong},
		{"fits exactly", Request{ID: "b", Tokens: seqTokens(0, 150), MaxTokens: 10}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := e.Add(tc.r); !errors.Is(err, tc.want) {
				t.Fatalf("Add: %v, want %v", err, tc.want)
			}
		})
	}
	if _, err := New(Config{BlockSize: 0, NumGPUBlocks: 1, MaxNumSeqs: 1, MaxNumBatchedTokens: 1}); !errors.Is(err, ErrInvalid) {
		t.Fatalf("New with block size 0: %v", err)
	}
}

func TestChunkedPrefill(t *testing.T) {
	e := mustNew(t, DefaultConfig())
	mustAdd(t, e, "long", seqTokens(0, 20000), 3)
	for i, want := range []int{8192, 8192, 3616} {
		res := e.Step()
		if res.PrefillTokens != want || res.DecodeSeqs != 0 {
			t.Fatalf("step %d: %d prefill tokens, %d decodes; want %d, 0", i, res.PrefillTokens, res.DecodeSeqs, want)
		}
		if got := len(res.Outputs); got != 0 && i < 2 || got != 1 && i == 2 {
			t.Fatalf("step %d: %d outputs", i, got)
		}
		if res.Duration != PrefillTime(want) {
			t.Fatalf("step %d: duration %v, want %v", i, res.Duration, PrefillTime(want))
		}
	}
	for i := 1; i < 3; i++ {
		res := e.Step()
		if res.PrefillTokens != 0 || res.DecodeSeqs != 1 || len(res.Outputs) != 1 || res.Outputs[0].Index != i {
			t.Fatalf("decode %d: %+v", i, res)
		}
	}
	if !e.Idle() {
		t.Fatal("not idle after the last token")
	}
	if res := e.Step(); res.Duration != 0 || len(res.Outputs) != 0 || len(res.Events) != 0 {
		t.Fatalf("idle step: %+v", res)
	}
}

func TestBudgetAndMaxSeqs(t *testing.T) {
	for _, tc := range []struct {
		name                     string
		seqs, budget, n, prompt  int
		wantRunning, wantPrefill []int // per step
	}{
		// 10 prompts of 1000 tokens, 2048 tokens per step: 2 whole prompts
		// and a chunk of a third, then the third finishes while the first
		// two decode, and so on.
		{"budget", 256, 2048, 10, 1000, []int{3, 5, 7}, []int{2048, 2046, 2044}},
		// 10 prompts of 10 tokens, at most 4 running.
		{"max-seqs", 4, 8192, 10, 10, []int{4, 4, 4}, []int{40, 0, 0}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := mustNew(t, Config{BlockSize: 16, NumGPUBlocks: 4096, MaxNumSeqs: tc.seqs, MaxNumBatchedTokens: tc.budget, EnablePrefixCaching: true})
			for i := range tc.n {
				mustAdd(t, e, fmt.Sprint(i), seqTokens(uint32(i)*10000, tc.prompt), 100)
			}
			for i := range tc.wantRunning {
				res := e.Step()
				m := e.Metrics()
				if m.Running != tc.wantRunning[i] || res.PrefillTokens != tc.wantPrefill[i] || m.Running+m.Waiting != tc.n {
					t.Fatalf("step %d: %d running, %d waiting, %d prefill tokens; want %d running, %d prefill tokens",
						i, m.Running, m.Waiting, res.PrefillTokens, tc.wantRunning[i], tc.wantPrefill[i])
				}
				if res.PrefillTokens+res.DecodeSeqs > tc.budget {
					t.Fatalf("step %d over budget", i)
				}
			}
		})
	}
}

// TestPreemption: a cache too small for all the requests at once makes the
// scheduler preempt, and every request still ends with exactly MaxTokens
// outputs, in order.
func TestPreemption(t *testing.T) {
	cfg := Config{BlockSize: 4, NumGPUBlocks: 12, MaxNumSeqs: 8, MaxNumBatchedTokens: 64, EnablePrefixCaching: true}
	e := mustNew(t, cfg)
	idx := newEventIndex(cfg)
	const n, maxOut = 6, 24
	for i := range n {
		mustAdd(t, e, fmt.Sprint(i), seqTokens(uint32(i)*100, 10), maxOut)
	}
	outs := map[string][]Output{}
	preempted := 0
	for steps := 0; !e.Idle(); steps++ {
		if steps > 10000 {
			t.Fatal("no progress")
		}
		res := e.Step()
		preempted += res.Preempted
		for _, o := range res.Outputs {
			outs[o.ID] = append(outs[o.ID], o)
		}
		idx.apply(t, res.Events)
		idx.check(t, e)
		checkEngine(t, e)
	}
	if preempted == 0 || e.Metrics().Preemptions != uint64(preempted) {
		t.Fatalf("%d preemptions (metrics %d), want > 0", preempted, e.Metrics().Preemptions)
	}
	for i := range n {
		o := outs[fmt.Sprint(i)]
		if len(o) != maxOut {
			t.Fatalf("request %d: %d outputs, want %d", i, len(o), maxOut)
		}
		for j, out := range o {
			if out.Index != j || out.Finished != (j == maxOut-1) {
				t.Fatalf("request %d output %d: %+v", i, j, out)
			}
		}
	}
}

// TestPrefixHit: a second request sharing a long prefix with a finished one
// finds it cached: the hit is counted in tokens (full blocks only), its
// first step prefills only the rest, and takes less time.
func TestPrefixHit(t *testing.T) {
	for _, tc := range []struct {
		name        string
		shared, len int
		wantCached  int
	}{
		{"shared prefix", 1000, 1024, 992}, // 62 full blocks
		{"identical", 1024, 1024, 1008},    // the last token is always computed: 63 blocks
		{"nothing shared", 0, 1024, 0},
		{"shorter than a block", 10, 1024, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := mustNew(t, DefaultConfig())
			a := seqTokens(0, 1024)
			mustAdd(t, e, "a", a, 2)
			first := e.Step()
			for !e.Idle() {
				e.Step()
			}
			b := slices.Concat(a[:tc.shared], seqTokens(50000, tc.len-tc.shared))
			mustAdd(t, e, "b", b, 2)
			res := e.Step()
			if len(res.Outputs) != 1 || res.Outputs[0].CachedTokens != tc.wantCached {
				t.Fatalf("outputs %+v, want CachedTokens %d", res.Outputs, tc.wantCached)
			}
			if res.PrefillTokens != tc.len-tc.wantCached {
				t.Fatalf("%d prefill tokens, want %d", res.PrefillTokens, tc.len-tc.wantCached)
			}
			if tc.wantCached > 0 && res.Duration >= first.Duration {
				t.Fatalf("cached first step %v not shorter than %v", res.Duration, first.Duration)
			}
			m := e.Metrics()
			if m.PrefixQueries != 2048 || m.PrefixHits != uint64(tc.wantCached) {
				t.Fatalf("prefix queries %d hits %d, want 2048 %d", m.PrefixQueries, m.PrefixHits, tc.wantCached)
			}
		})
	}
}

// TestGeneratedBlocksCached: generated tokens fill blocks that are Stored and
// can be hit by a follow-up turn that sends the conversation back.
func TestGeneratedBlocksCached(t *testing.T) {
	cfg := Config{BlockSize: 4, NumGPUBlocks: 100, MaxNumSeqs: 4, MaxNumBatchedTokens: 64, EnablePrefixCaching: true}
	e := mustNew(t, cfg)
	idx := newEventIndex(cfg)
	prompt := seqTokens(0, 8)
	mustAdd(t, e, "turn1", prompt, 9)
	var gen []uint32
	for !e.Idle() {
		res := e.Step()
		idx.apply(t, res.Events)
		for _, o := range res.Outputs {
			gen = append(gen, o.Token)
		}
	}
	// 8 prompt + 8 computed generated tokens (the 9th is never computed): 4 blocks.
	if len(idx.present) != 4 {
		t.Fatalf("%d blocks stored, want 4", len(idx.present))
	}
	turn2 := slices.Concat(prompt, gen, seqTokens(900, 3))
	mustAdd(t, e, "turn2", turn2, 1)
	res := e.Step()
	if res.Outputs[0].CachedTokens != 16 {
		t.Fatalf("turn 2 cached %d tokens, want 16", res.Outputs[0].CachedTokens)
	}
}

func TestAbort(t *testing.T) {
	e := mustNew(t, DefaultConfig())
	mustAdd(t, e, "run", seqTokens(0, 100), 50)
	mustAdd(t, e, "wait", seqTokens(1000, 100), 50)
	e.Step()
	if e.KVUsage() == 0 {
		t.Fatal("no blocks in use")
	}
	mustAdd(t, e, "late", seqTokens(2000, 100), 50)
	if !e.Abort("run") || !e.Abort("late") || e.Abort("run") || e.Abort("nope") {
		t.Fatal("abort results")
	}
	checkEngine(t, e)
	for !e.Idle() {
		for _, o := range e.Step().Outputs {
			if o.ID != "wait" {
				t.Fatalf("output for aborted %s", o.ID)
			}
		}
	}
	if m := e.Metrics(); m.KVUsage != 0 || m.RequestsAborted != 2 || m.RequestsFinished != 1 || m.CachedBlocks == 0 {
		t.Fatalf("metrics %+v", m)
	}
	// An id can be reused once its request is gone.
	mustAdd(t, e, "run", seqTokens(0, 100), 1)
}

func TestResetPrefixCache(t *testing.T) {
	e := mustNew(t, DefaultConfig())
	mustAdd(t, e, "a", seqTokens(0, 100), 5)
	e.Step()
	if _, ok := e.ResetPrefixCache(); ok {
		t.Fatal("reset while a request holds blocks")
	}
	for !e.Idle() {
		e.Step()
	}
	evs, ok := e.ResetPrefixCache()
	if !ok || len(evs) != 1 || evs[0].Kind != Cleared {
		t.Fatalf("reset: %v %v", evs, ok)
	}
	if m := e.Metrics(); m.CachedBlocks != 0 || m.FreeBlocks != m.TotalBlocks {
		t.Fatalf("after reset: %+v", m)
	}
	mustAdd(t, e, "b", seqTokens(0, 100), 1)
	if res := e.Step(); res.Outputs[0].CachedTokens != 0 {
		t.Fatal("hit after reset")
	}
	checkEngine(t, e)
}

func TestTiming(t *testing.T) {
	ms := func(f float64) time.Duration { return time.Duration(f * 1e6) }
	near := func(a, b time.Duration) bool { d := a - b; return d < 2 && d > -2 }
	for _, tc := range []struct {
		t       int
		decodes int
		u       float64
		want    time.Duration
	}{
		{0, 0, 0, 0},
		{1, 0, 0, ms(4.209989e-7 + 1.518344e-2 + 16.50142)},
		{1000, 0, 0.5, ms(4.209989e-7*1e6 + 1.518344e-2*1000 + 16.50142)},
		{8192, 0, 0, ms(4.209989e-7*8192*8192 + 1.518344e-2*8192 + 16.50142)},
		{0, 1, 0, ms(5.74)},
		{0, 256, 0.5, ms(-25.74*0.25 + 54.01*0.5 + 5.74)},
		{0, 3, 1, ms(-25.74 + 54.01 + 5.74)},
		{0, 3, 2, ms(-25.74 + 54.01 + 5.74)}, // u clamped to 1
		{512, 10, 0.25, ms(4.209989e-7*512*512+1.518344e-2*512+16.50142) + ms(-25.74*0.0625+54.01*0.25+5.74)},
	} {
		if got := StepTime(tc.t, tc.decodes, tc.u); !near(got, tc.want) {
			t.Errorf("StepTime(%d, %d, %v) = %v, want %v", tc.t, tc.decodes, tc.u, got, tc.want)
		}
	}
	if DecodeTime(-1) != ms(5.74) || PrefillTime(-5) != 0 {
		t.Error("edge values")
	}
}

// runWorkload replays a fixed random workload and returns every step result.
func runWorkload(t *testing.T, cfg Config) []StepResult {
	e := mustNew(t, cfg)
	rng := rand.New(rand.NewPCG(42, 42))
	prefix := randTokens(rng, 300, 1000)
	var out []StepResult
	for step := 0; step < 400 || !e.Idle(); step++ {
		if step < 400 && rng.IntN(4) == 0 {
			toks := slices.Concat(prefix[:rng.IntN(300)], randTokens(rng, 1+rng.IntN(200), 1000))
			mustAdd(t, e, fmt.Sprint(step), toks, 1+rng.IntN(60))
		}
		if step < 400 && rng.IntN(50) == 0 {
			e.Abort(fmt.Sprint(rng.IntN(step + 1)))
		}
		out = append(out, e.Step())
	}
	return out
}

func TestDeterminism(t *testing.T) {
	cfg := Config{BlockSize: 16, NumGPUBlocks: 96, MaxNumSeqs: 16, MaxNumBatchedTokens: 256, EnablePrefixCaching: true, Seed: 9}
	a, b := runWorkload(t, cfg), runWorkload(t, cfg)
	if !reflect.DeepEqual(a, b) {
		t.Fatal("same config and requests gave different results")
	}
	cfg.Seed = 10
	c := runWorkload(t, cfg)
	// Another seed: same schedule (timing does not depend on ids), other ids and tokens.
	for i := range a {
		if a[i].Duration != c[i].Duration || a[i].PrefillTokens != c[i].PrefillTokens {
			t.Fatalf("step %d: seed changed the schedule", i)
		}
	}
	idsA, idsC := map[uint64]bool{}, 0
	tokSame, toks := 0, 0
	for i := range a {
		for _, ev := range a[i].Events {
			for _, h := range ev.BlockHashes {
				idsA[h] = true
			}
		}
		for j, o := range a[i].Outputs {
			toks++
			if o.Token == c[i].Outputs[j].Token {
				tokSame++
			}
		}
	}
	for i := range c {
		for _, ev := range c[i].Events {
			for _, h := range ev.BlockHashes {
				if idsA[h] {
					idsC++
				}
			}
		}
	}
	if len(idsA) == 0 || idsC != 0 || tokSame > toks/100 {
		t.Fatalf("seeds share %d block ids and %d/%d tokens", idsC, tokSame, toks)
	}
}

// An owned prompt with room for the output is taken over, not copied: the
// engine writes its generated tokens after it in the caller's array, and
// produces exactly what it produces from a copied prompt. Without room, or
// not owned, the caller's array is left alone.
func TestOwnedPromptIsTakenOver(t *testing.T) {
	cfg := Config{BlockSize: 4, NumGPUBlocks: 100, MaxNumSeqs: 4, MaxNumBatchedTokens: 64, EnablePrefixCaching: true}
	run := func(toks []uint32, owned bool) ([]Output, [][]BlockEvent) {
		e := mustNew(t, cfg)
		if err := e.Add(Request{ID: "r", Tokens: toks, MaxTokens: 6, Owned: owned}); err != nil {
			t.Fatal(err)
		}
		var outs []Output
		var evs [][]BlockEvent
		for !e.Idle() {
			res := e.Step()
			outs = append(outs, res.Outputs...)
			evs = append(evs, res.Events)
		}
		return outs, evs
	}
	wantOuts, wantEvs := run(seqTokens(1, 10), false)
	roomy := append(make([]uint32, 0, 16), seqTokens(1, 10)...)
	outs, evs := run(roomy, true)
	if !reflect.DeepEqual(outs, wantOuts) || !reflect.DeepEqual(evs, wantEvs) {
		t.Fatalf("owned prompt: outputs %v, events %v; copied: %v, %v", outs, evs, wantOuts, wantEvs)
	}
	// The last output is never appended (nothing computes it).
	if got := roomy[:15]; !slices.Equal(got[10:], []uint32{wantOuts[0].Token, wantOuts[1].Token, wantOuts[2].Token, wantOuts[3].Token, wantOuts[4].Token}) {
		t.Fatalf("the engine did not append into the owned array: %v", got)
	}
	for _, c := range []struct {
		owned bool
		cap   int
	}{{false, 12}, {true, 12}, {false, 16}} { // 12: no room for 6 more
		arr := append(make([]uint32, 0, c.cap), seqTokens(1, 10)...)
		run(arr, c.owned)
		if extra := arr[:12][10:]; extra[0] != 0 || extra[1] != 0 {
			t.Fatalf("owned %v, capacity %d: the caller's array was written: %v", c.owned, c.cap, extra)
		}
	}
}

// stepTwins feeds engines a and b the same random stream of requests
// sharing prefixes until both are idle, holding every step's results
// equal, and hands each step's results to check.
func stepTwins(t *testing.T, a, b *Engine, seed uint64, check func(step int, ra, rb StepResult)) {
	t.Helper()
	rng := rand.New(rand.NewPCG(seed, 0))
	prefix := randTokens(rng, 120, 500)
	for step := 0; step < 600 || !a.Idle(); step++ {
		if step > 5000 {
			t.Fatal("engines never idle")
		}
		if step < 600 && rng.IntN(3) == 0 {
			toks := slices.Concat(prefix[:rng.IntN(120)], randTokens(rng, 1+rng.IntN(60), 500))
			n := 1 + rng.IntN(30)
			mustAdd(t, a, fmt.Sprint(step), slices.Clone(toks), n)
			mustAdd(t, b, fmt.Sprint(step), toks, n)
		}
		ra, rb := a.Step(), b.Step()
		if !reflect.DeepEqual(ra, rb) {
			t.Fatalf("step %d: results differ", step)
		}
		check(step, ra, rb)
	}
}

// An engine that keeps no block tokens steps exactly as one that does, and
// lists the same cached blocks, without their tokens, and the GPU's without
// their parents.
func TestNoBlockTokensChangesNothingElse(t *testing.T) {
	byHash := func(a, b CachedBlock) int { return cmp.Compare(a.Hash, b.Hash) }
	for _, cpu := range []int{0, 48} {
		cfg := Config{BlockSize: 4, NumGPUBlocks: 64, NumCPUBlocks: cpu, MaxNumSeqs: 8, MaxNumBatchedTokens: 64, EnablePrefixCaching: true, Seed: 3}
		bare := cfg
		bare.NoBlockTokens = true
		a, b := mustNew(t, cfg), mustNew(t, bare)
		listed := 0
		stepTwins(t, a, b, 7+uint64(cpu), func(step int, _, _ StepResult) {
			if step%37 != 0 {
				return
			}
			ga, gb := a.CachedBlocks(), b.CachedBlocks()
			ha, hb := a.HostBlocks(), b.HostBlocks()
			for i := range ga {
				if ga[i].Tokens == nil {
					t.Fatalf("cpu %d, step %d: block %x listed without tokens", cpu, step, ga[i].Hash)
				}
				ga[i].Tokens, ga[i].Parent = nil, nil
			}
			for _, x := range gb {
				if x.Tokens != nil || x.Parent != nil {
					t.Fatalf("cpu %d, step %d: NoBlockTokens listed tokens or a parent", cpu, step)
				}
			}
			slices.SortFunc(ga, byHash)
			slices.SortFunc(gb, byHash)
			for i := range ha {
				if ha[i].Tokens == nil || hb[i].Tokens != nil {
					t.Fatalf("cpu %d, step %d: host block %x listed with tokens %v, and %v under NoBlockTokens", cpu, step, ha[i].Hash, ha[i].Tokens != nil, hb[i].Tokens != nil)
				}
				ha[i].Tokens = nil
			}
			if !reflect.DeepEqual(ga, gb) || !reflect.DeepEqual(ha, hb) {
				t.Fatalf("cpu %d, step %d: cached blocks differ", cpu, step)
			}
			listed += len(ga)
		})
		if listed == 0 {
			t.Fatalf("cpu %d: no cached block listed", cpu)
		}
	}
}

// TestDecodeTimeMatchesClampedFit holds DecodeTime to the fit clamped with
// math.Max and math.Min, at the bounds, beyond them, at ±0, ±Inf and NaN.
func TestDecodeTimeMatchesClampedFit(t *testing.T) {
	ref := func(u float64) time.Duration {
		u = math.Max(0, math.Min(1, u))
		return millis(max(-25.74*u*u+54.01*u+5.74, 1))
	}
	us := []float64{0, math.Copysign(0, -1), 1, -1, 2, 0.5, 1e-300, math.Nextafter(1, 2), math.Nextafter(0, -1),
		math.Inf(1), math.Inf(-1), math.NaN()}
	rng := rand.New(rand.NewPCG(3, 4))
	for range 100_000 {
		us = append(us, rng.Float64()*3-1)
	}
	for _, u := range us {
		if got, want := DecodeTime(u), ref(u); got != want {
			t.Fatalf("DecodeTime(%v) = %v, want %v", u, got, want)
		}
	}
}

func BenchmarkStepTime(b *testing.B) {
	var d time.Duration
	u := 0.0
	for b.Loop() {
		d += StepTime(0, 8, u)
		if u += 0.001; u > 1 {
			u = 0
		}
	}
	_ = d
}

// TestOutputsCarryTheRequestsTag holds every output of a request, through
// preemptions on a small cache, to the request's Tag.
func TestOutputsCarryTheRequestsTag(t *testing.T) {
	e := mustNew(t, Config{BlockSize: 4, NumGPUBlocks: 24, MaxNumSeqs: 8, MaxNumBatchedTokens: 64, EnablePrefixCaching: true, Seed: 5})
	rng := rand.New(rand.NewPCG(9, 10))
	tags := map[string]int32{}
	for i := range 12 {
		id := fmt.Sprint("r", i)
		tags[id] = int32(i % 3 * (i + 100)) // some untagged (0)
		r := Request{ID: id, Tokens: randTokens(rng, 10+rng.IntN(30), 500), MaxTokens: 1 + rng.IntN(40), Tag: tags[id]}
		if err := e.Add(r); err != nil {
			t.Fatal(err)
		}
	}
	outputs, preempted := 0, 0
	for step := 0; !e.Idle(); step++ {
		if step > 10_000 {
			t.Fatal("engine never idle")
		}
		res := e.Step()
		preempted += res.Preempted
		for _, o := range res.Outputs {
			outputs++
			if o.Tag != tags[o.ID] {
				t.Fatalf("output %d of %s has tag %d, want %d", o.Index, o.ID, o.Tag, tags[o.ID])
			}
		}
	}
	if outputs == 0 || preempted == 0 {
		t.Fatalf("%d outputs, %d preemptions: the test should see both", outputs, preempted)
	}
}

// TestRecycledEventsChangeNothing runs one random stream through an engine
// whose caller recycles every step's events, their id lists overwritten
// first (as a caller done with them may leave them), and one whose caller
// keeps them: every step's results agree, with and without a host tier.
// The recycling engine's spare lists (id lists and finished requests' slot
// lists) are poisoned whole after every step, so that nothing it reuses
// may show what it held before.
func TestRecycledEventsChangeNothing(t *testing.T) {
	for _, cpu := range []int{0, 48} {
		cfg := Config{BlockSize: 4, NumGPUBlocks: 64, NumCPUBlocks: cpu, MaxNumSeqs: 8, MaxNumBatchedTokens: 64, EnablePrefixCaching: true, Seed: 3}
		a, b := mustNew(t, cfg), mustNew(t, cfg)
		removed := 0
		stepTwins(t, a, b, 11+uint64(cpu), func(_ int, _, rb StepResult) {
			for _, ev := range rb.Events {
				if ev.Kind == Removed {
					removed++
					for i := range ev.BlockHashes {
						ev.BlockHashes[i] = ^uint64(0)
					}
				}
			}
			b.Recycle(rb.Events)
			poisonSpares(b)
		})
		if removed == 0 {
			t.Fatalf("cpu %d: no evictions: the stream should fill the cache", cpu)
		}
	}
}

// StepTo writes every field of the result Step returns, over whatever
// the caller's result held: steps with and without events, preempting
// ones, waits for host loads (LoadWait) and idle ones.
func TestStepToMatchesStep(t *testing.T) {
	junk := Output{ID: "junk", Token: 7, Tag: 9, Index: 5, Finished: true, CachedTokens: 3}
	res := StepResult{Duration: 1, PrefillTokens: 2, DecodeSeqs: 3, Outputs: []Output{junk}, Events: []BlockEvent{{Kind: Cleared}}, Preempted: 4, KVUsage: 0.5, LoadWait: true}
	var preempted, waited, idle, evented int
	step := func(a, b *Engine, label string) {
		t.Helper()
		want := a.Step()
		res.Outputs = append(res.Outputs[:0], junk)
		res.Duration, res.Preempted, res.LoadWait, res.KVUsage = 9, 9, true, 9
		b.StepTo(&res)
		if !reflect.DeepEqual(res, want) {
			t.Fatalf("%s: StepTo gave %+v, Step %+v", label, res, want)
		}
		preempted += want.Preempted
		if want.LoadWait {
			waited++
		}
		if a.Idle() && want.Duration == 0 {
			idle++
		}
		if len(want.Events) > 0 {
			evented++
		}
	}
	for _, c := range []struct{ gpu, cpu int }{{64, 0}, {32, 0}, {40, 48}} {
		cfg := Config{BlockSize: 4, NumGPUBlocks: c.gpu, NumCPUBlocks: c.cpu, MaxNumSeqs: 8, MaxNumBatchedTokens: 64, EnablePrefixCaching: true, Seed: 3}
		a, b := mustNew(t, cfg), mustNew(t, cfg)
		rng := rand.New(rand.NewPCG(uint64(c.gpu), uint64(c.cpu)))
		prefix := randTokens(rng, 60, 500)
		idle = 0
		for n := 0; n < 400 || !a.Idle() || idle == 0; n++ {
			if n > 5000 {
				t.Fatal("engines never idle")
			}
			if n < 400 && rng.IntN(3) == 0 {
				toks := slices.Concat(prefix[:rng.IntN(60)], randTokens(rng, 1+rng.IntN(30), 500))
				out := 1 + rng.IntN(30)
				mustAdd(t, a, fmt.Sprint(n), slices.Clone(toks), out)
				mustAdd(t, b, fmt.Sprint(n), toks, out)
			}
			step(a, b, fmt.Sprintf("gpu %d, cpu %d, step %d", c.gpu, c.cpu, n))
		}
	}
	// A prompt the host tier alone holds: the engine waits for its load.
	prompt := seqTokens(1000, 20*16+1)
	a, b := hostOnly(t, 48, 25, prompt), hostOnly(t, 48, 25, prompt)
	mustAdd(t, a, "loaded", prompt, 3)
	mustAdd(t, b, "loaded", prompt, 3)
	for n := 0; !a.Idle(); n++ {
		step(a, b, fmt.Sprintf("host load, step %d", n))
	}
	if evented == 0 || idle == 0 || preempted == 0 || waited == 0 {
		t.Fatalf("%d steps with events, %d idle, %d preemptions, %d load waits", evented, idle, preempted, waited)
	}
}

// poisonSpares overwrites the whole room of e's spare id and slot lists.
func poisonSpares(e *Engine) {
	for _, l := range e.bm.spareIDs {
		l = l[:cap(l)]
		for i := range l {
			l[i] = ^uint64(0)
		}
	}
	for _, l := range e.bm.spareBlocks {
		l = l[:cap(l)]
		for i := range l {
			l[i] = -7
		}
	}
}
