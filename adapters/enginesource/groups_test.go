package enginesource

import (
	"context"
	"log/slog"
	"sync"
	"testing"

	"github.com/kvrouter/kvrouter/adapters/vllmevents"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
)

// warnLog records the fields of the "not honoured" warnings.
type warnLog struct {
	mu     sync.Mutex
	fields []string
}

func (w *warnLog) Enabled(context.Context, slog.Level) bool { return true }
func (w *warnLog) WithAttrs([]slog.Attr) slog.Handler       { return w }
func (w *warnLog) WithGroup(string) slog.Handler            { return w }
func (w *warnLog) Handle(_ context.Context, r slog.Record) error {
	if r.Level < slog.LevelWarn {
		return nil
	}
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "field" {
			w.mu.Lock()
			w.fields = append(w.fields, a.Value.String())
			w.mu.Unlock()
		}
		return true
	})
	return nil
}

func (w *warnLog) count(field string) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	n := 0
	for _, f := range w.fields {
		if f == field {
			n++
		}
	}
	return n
}

// groupRig is a router with worker 1 fed by a source from a test engine,
// the source's warnings recorded.
func groupRig(t *testing.T) (*testPub, *router.Router, *Source, *warnLog) {
	t.Helper()
	p := newTestPub(t, pubOpts{})
	r := newRouter(t, router.WorkerInfo{ID: 1})
	logs := &warnLog{}
	s := start(t, Config{Worker: kv.Worker{ID: 1}, Events: p.events(), Replay: p.replay(), Logger: slog.New(logs)}, r)
	warmUp(t, p, s)
	return p, r, s, logs
}

// groupStored is a BlockStored of blocks of size bsz cut from tokens, ids
// base+i, in group idx of kind (window when > 0).
func groupStored(tokens []uint32, bsz int, base uint64, from, to, idx int, kind string, window int) *vllmevents.BlockStored {
	var parent *uint64
	if from > 0 {
		parent = kv.Ptr(base + uint64(from-1))
	}
	ev := &vllmevents.BlockStored{ParentBlockHash: parent, TokenIDs: tokens[from*bsz : to*bsz], BlockSize: bsz, Medium: "GPU", GroupIdx: idx, KVCacheSpecKind: kind}
	for i := from; i < to; i++ {
		ev.BlockHashes = append(ev.BlockHashes, base+uint64(i))
	}
	if window > 0 {
		ev.KVCacheSpecSlidingWindow = &window
	}
	return ev
}

// A hybrid model whose group 0 is a sliding-window group of 32-token blocks
// and group 1 the full-attention group of 16-token blocks, plus a Mamba
// group: the router indexes group 1 only.
func TestHybridModelIndexesTheFullAttentionGroup(t *testing.T) {
	p, r, s, logs := groupRig(t)
	before := s.Stats()
	w := kv.Worker{ID: 1}
	a := toks(8, 21) // 8 blocks of 16 tokens, 4 of 32, 2 of 64
	b := toks(8, 22)
	for i, prompt := range [][]uint32{a, b} {
		base := uint64(1000 * (i + 1))
		p.publish(t, encode(t, &vllmevents.Batch{TS: 1, Events: []vllmevents.Event{
			groupStored(prompt, 32, base+100, 0, 4, 0, "sliding_window", 64),
			groupStored(prompt, 16, base, 0, 8, 1, "full_attention", 0),
			groupStored(prompt, 64, base+200, 0, 2, 2, "mamba", 0),
		}}), true)
	}
	// The sliding window moved on: its first blocks are dropped, while
	// the full-attention group keeps them.
	seq := p.publish(t, encode(t, &vllmevents.Batch{TS: 1, Events: []vllmevents.Event{
		&vllmevents.BlockRemoved{BlockHashes: []uint64{1100, 1101}, GroupIdx: 0},
		&vllmevents.BlockRemoved{BlockHashes: []uint64{1200}, GroupIdx: 2},
		&vllmevents.BlockRemoved{BlockHashes: []uint64{2007}, GroupIdx: 1},
	}}), true)
	wait(t, s, seq)

	if got := overlap(t, r, w, a); got != 8 {
		t.Fatalf("a repeated prompt matches %d blocks of the full-attention group, want 8", got)
	}
	if got := overlap(t, r, w, b); got != 7 {
		t.Fatalf("after the full group removed b's last block, overlap = %d, want 7", got)
	}
	if got := r.WorkerBlockSize(1); got != 16 {
		t.Fatalf("the router learnt block size %d from another group's events, want 16", got)
	}
	st := s.Stats()
	if st.BlocksStored != 16 || st.BlocksRemoved != 1 || st.OtherGroup-before.OtherGroup != 6 || st.ApplyErrors != 0 {
		t.Fatalf("stats %+v", st)
	}
	if st.Unsupported["kv_cache_spec_kind=mamba"] != 3 || len(st.Unsupported) != 1 {
		t.Fatalf("unsupported %v, want only 3 mamba events", st.Unsupported)
	}
	if n := logs.count("kv_cache_spec_kind=mamba"); n != 1 {
		t.Fatalf("the mamba group was warned about %d times, want once", n)
	}
	if g, kind, ok := s.groups.Indexed(); !ok || g != 1 || kind != "full_attention" {
		t.Fatalf("indexed group %d %q %v", g, kind, ok)
	}
}

// Two groups of equal block size name the same content with the same ids
// (vLLM's block hash does not mix in the group): the sliding group dropping
// blocks that left its window must not drop them from the index.
func TestSlidingGroupRemovalsDoNotTouchTheIndex(t *testing.T) {
	p, r, s, _ := groupRig(t)
	a := toks(6, 23)
	p.publish(t, encode(t, &vllmevents.Batch{TS: 1, Events: []vllmevents.Event{
		groupStored(a, bs, 500, 0, 6, 0, "sliding_window", 32),
		groupStored(a, bs, 500, 0, 6, 1, "full_attention", 0),
	}}), true)
	seq := p.publish(t, encode(t, &vllmevents.Batch{TS: 1, Events: []vllmevents.Event{
		&vllmevents.BlockRemoved{BlockHashes: []uint64{500, 501, 502, 503}, GroupIdx: 0},
	}}), true)
	wait(t, s, seq)
	if got := overlap(t, r, kv.Worker{ID: 1}, a); got != 6 {
		t.Fatalf("overlap %d, want 6: the full-attention group still holds every block", got)
	}
	if st := s.Stats(); len(st.Unsupported) != 0 {
		t.Fatalf("a sliding group beside a full one is not unsupported: %v", st.Unsupported)
	}
}

// An engine with only sliding-window groups has no reusable prefix beyond
// its window: nothing is indexed, and that is counted and warned.
func TestSlidingWindowOnlyEngineIsNotIndexed(t *testing.T) {
	p, r, s, logs := groupRig(t)
	a := toks(4, 24)
	p.publish(t, encode(t, &vllmevents.Batch{TS: 1, Events: []vllmevents.Event{
		groupStored(a, bs, 700, 0, 2, 0, "sliding_window", 32),
	}}), true)
	seq := p.publish(t, encode(t, &vllmevents.Batch{TS: 1, Events: []vllmevents.Event{
		groupStored(a, bs, 700, 2, 4, 0, "sliding_window", 32),
		&vllmevents.BlockRemoved{BlockHashes: []uint64{700}, GroupIdx: 0},
	}}), true)
	wait(t, s, seq)
	if got := overlap(t, r, kv.Worker{ID: 1}, a); got != 0 {
		t.Fatalf("overlap %d on a sliding-window-only engine, want 0", got)
	}
	st := s.Stats()
	if st.BlocksStored != 0 || st.Unsupported["kv_cache_spec_kind=sliding_window"] != 3 {
		t.Fatalf("stats %+v", st)
	}
	if n := logs.count("kv_cache_spec_kind=sliding_window"); n != 1 {
		t.Fatalf("warned %d times, want once", n)
	}
}

func TestGroupFilterChoice(t *testing.T) {
	type ev struct {
		removed bool
		idx     int
		kind    string // BlockStored's kv_cache_spec_kind; "" when absent
	}
	type want struct {
		indexed bool
		field   string
	}
	cases := []struct {
		name   string
		events []ev // learnt in one batch, then judged in order
		want   []want
	}{
		{"no kind: group 0 (older vLLM, SGLang)", []ev{{idx: 0}, {removed: true, idx: 0}}, []want{{true, ""}, {true, ""}}},
		{"no kind: other groups unsupported", []ev{{idx: 1}, {removed: true, idx: 2}}, []want{{false, "group_idx"}, {false, "group_idx"}}},
		{"full attention at 0", []ev{{idx: 0, kind: "full_attention"}, {removed: true, idx: 0}}, []want{{true, ""}, {true, ""}}},
		{"mla at 3", []ev{{idx: 3, kind: "mla_attention"}, {removed: true, idx: 3}, {removed: true, idx: 0}}, []want{{true, ""}, {true, ""}, {false, ""}}},
		{"sink full attention", []ev{{idx: 0, kind: "sink_full_attention"}}, []want{{true, ""}}},
		{"sliding at 0, full at 1", []ev{{idx: 0, kind: "sliding_window"}, {idx: 1, kind: "full_attention"}, {removed: true, idx: 0}, {removed: true, idx: 1}},
			[]want{{false, ""}, {true, ""}, {false, ""}, {true, ""}}},
		{"sliding only", []ev{{idx: 0, kind: "sliding_window"}, {removed: true, idx: 0}},
			[]want{{false, "kv_cache_spec_kind=sliding_window"}, {false, "kv_cache_spec_kind=sliding_window"}}},
		{"sliding mla only", []ev{{idx: 0, kind: "sliding_window_mla"}}, []want{{false, "kv_cache_spec_kind=sliding_window_mla"}}},
		{"chunked local beside full", []ev{{idx: 0, kind: "chunked_local_attention"}, {idx: 1, kind: "full_attention"}}, []want{{false, ""}, {true, ""}}},
		{"mamba beside full", []ev{{idx: 0, kind: "mamba"}, {idx: 1, kind: "full_attention"}, {removed: true, idx: 0}},
			[]want{{false, "kv_cache_spec_kind=mamba"}, {true, ""}, {false, "kv_cache_spec_kind=mamba"}}},
		{"unknown kind", []ev{{idx: 0, kind: "linear_attention_v9"}, {idx: 1, kind: "full_attention"}},
			[]want{{false, "kv_cache_spec_kind=unknown"}, {true, ""}}},
		{"two full groups: the lowest", []ev{{idx: 2, kind: "full_attention"}, {idx: 1, kind: "full_attention"}, {removed: true, idx: 2}},
			[]want{{false, ""}, {true, ""}, {false, ""}}},
		{"kind absent on a group described before", []ev{{idx: 0, kind: "sliding_window"}, {idx: 1, kind: "full_attention"}, {idx: 0}, {idx: 1}},
			[]want{{false, ""}, {true, ""}, {false, ""}, {true, ""}}},
		{"undescribed group beside a chosen one", []ev{{idx: 1, kind: "full_attention"}, {removed: true, idx: 0}, {idx: 4}},
			[]want{{true, ""}, {false, ""}, {false, ""}}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var f GroupFilter
			var batch []vllmevents.Event
			for _, e := range c.events {
				if e.removed {
					batch = append(batch, &vllmevents.BlockRemoved{GroupIdx: e.idx})
				} else {
					batch = append(batch, &vllmevents.BlockStored{GroupIdx: e.idx, KVCacheSpecKind: e.kind})
				}
			}
			f.Learn(batch)
			for i, e := range c.events {
				var v GroupVerdict
				var field string
				if e.removed {
					v, field = f.Removed(e.idx)
				} else {
					v, field = f.Stored(e.idx, e.kind)
				}
				if got := (want{v == GroupIndexed, field}); got != c.want[i] {
					t.Errorf("event %d %+v: indexed %v field %q, want %+v", i, e, got.indexed, got.field, c.want[i])
				}
			}
		})
	}
}

// The choice survives across batches and is forgotten on Reset.
func TestGroupFilterAcrossBatches(t *testing.T) {
	var f GroupFilter
	f.Learn([]vllmevents.Event{&vllmevents.BlockStored{GroupIdx: 1, KVCacheSpecKind: "full_attention"}})
	f.Learn([]vllmevents.Event{&vllmevents.BlockStored{GroupIdx: 0, KVCacheSpecKind: "full_attention"}})
	if v, _ := f.Stored(0, "full_attention"); v == GroupIndexed {
		t.Fatal("the indexed group changed after blocks were indexed")
	}
	if v, _ := f.Removed(1); v != GroupIndexed {
		t.Fatal("removals of the indexed group must be applied")
	}
	f.Reset()
	if v, _ := f.Removed(1); v == GroupIndexed {
		t.Fatal("Reset must forget the chosen group")
	}
	if v, _ := f.Removed(0); v != GroupIndexed {
		t.Fatal("after Reset, group 0 by default")
	}
	for i := range 2 * maxGroups {
		f.Learn([]vllmevents.Event{&vllmevents.BlockStored{GroupIdx: i, KVCacheSpecKind: "sliding_window"}})
	}
	if len(f.kinds) != maxGroups {
		t.Fatalf("%d groups remembered, want at most %d", len(f.kinds), maxGroups)
	}
}
