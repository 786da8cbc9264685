package router

import (
	"context"
	"errors"
	"testing"

	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/sched"
)

// A P/D fleet: 10 and 11 prefill, 20 decode, 30 aggregated.
func pdRouter(t *testing.T) *Router {
	t.Helper()
	r, _ := newRouter(t, 0, nil)
	for _, w := range []WorkerInfo{{ID: 10, Role: RolePrefill}, {ID: 11, Role: RolePrefill}, {ID: 20, Role: RoleDecode}, {ID: 30, Role: RoleBoth}} {
		w.TotalKVBlocks, w.MaxNumBatchedTokens = 16384, 8192
		r.AddWorker(w)
	}
	return r
}

func TestPoolsKeepTheirRequests(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name    string
		prefill bool
		cached  uint64 // worker holding the prompt's prefix
		target  *kv.Worker
		want    []uint64 // acceptable workers
		wantErr error
	}{
		{name: "prefill goes to the prefill worker holding the prefix", prefill: true, cached: 11, want: []uint64{11}},
		{name: "decode goes to the decode-capable worker holding it", cached: 30, want: []uint64{30}},
		{name: "a prefill worker's cache does not draw a decode request", cached: 10, want: []uint64{20, 30}},
		{name: "a decode worker's cache does not draw a prefill request", prefill: true, cached: 20, want: []uint64{10, 11}},
		{name: "a prefill pin to a prefill worker", prefill: true, target: &kv.Worker{ID: 10}, want: []uint64{10}},
		{name: "a prefill pin to a decode worker fails", prefill: true, target: &kv.Worker{ID: 20}, wantErr: sched.ErrUnknownWorker},
		{name: "a decode pin to a prefill worker fails", target: &kv.Worker{ID: 11}, wantErr: sched.ErrUnknownWorker},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := pdRouter(t)
			toks := tokens(1, 8, 2, 8)
			if tc.cached != 0 {
				store(t, r, kv.Worker{ID: tc.cached}, toks)
			}
			d, err := r.BestWorker(ctx, &Request{ID: "a", Tokens: toks, Prefill: tc.prefill, Target: tc.target})
			if tc.wantErr != nil {
				if !errors.Is(err, tc.wantErr) {
					t.Fatalf("err = %v, want %v", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !contains(tc.want, d.Worker.ID) {
				t.Fatalf("routed to %d, want one of %v", d.Worker.ID, tc.want)
			}
		})
	}
}

func contains(ids []uint64, id uint64) bool {
	for _, x := range ids {
		if x == id {
			return true
		}
	}
	return false
}

func TestPrefillBookingCountsPromptNotBlocks(t *testing.T) {
	r := pdRouter(t)
	toks := tokens(1, 0, 2, 8)
	d, err := r.BestWorker(context.Background(), &Request{ID: "p", Tokens: toks, Prefill: true})
	if err != nil {
		t.Fatal(err)
	}
	var got WorkerLoad
	for _, l := range r.Loads() {
		if l.Worker == d.Worker {
			got = l
		}
	}
	if got.ActivePrefillTokens != len(toks) || got.ActiveDecodeBlocks != 0 || got.ActiveRequests != 1 {
		t.Fatalf("prefill worker's load %+v: want %d prefill tokens, no decode blocks, 1 request", got, len(toks))
	}
	if !r.Free("p") {
		t.Fatal("prefill booking not found")
	}
	for _, l := range r.Loads() {
		if l.ActiveRequests != 0 || l.ActivePrefillTokens != 0 || l.ActiveDecodeBlocks != 0 {
			t.Fatalf("load left after free: %+v", l)
		}
	}
}

func TestPoolsFollowTheFleet(t *testing.T) {
	r := pdRouter(t)
	if p, d := r.Pools(""); p != 2 || d != 2 {
		t.Fatalf("pools = %d prefill, %d decode; want 2, 2", p, d)
	}
	r.RemoveWorker(10)
	r.RemoveWorker(11)
	if p, _ := r.Pools(""); p != 0 {
		t.Fatalf("%d prefill workers left", p)
	}
	if _, err := r.BestWorker(context.Background(), &Request{Tokens: tokens(1, 0, 2, 2), Prefill: true}); !errors.Is(err, ErrNoWorkers) {
		t.Fatalf("prefill with no prefill worker: %v, want ErrNoWorkers", err)
	}
	r.AddWorker(WorkerInfo{ID: 5, Model: "other", Role: RolePrefill})
	if p, d := r.Pools("m"); p != 0 || d != 2 {
		t.Fatalf("pools of m = %d, %d: another model's prefill worker counted", p, d)
	}
}

func TestParseRole(t *testing.T) {
	for in, want := range map[string]Role{"": RoleBoth, "both": RoleBoth, "prefill": RolePrefill, "decode": RoleDecode} {
		if got, err := ParseRole(in); err != nil || got != want || (in != "" && got.String() != in) {
			t.Errorf("ParseRole(%q) = %v, %v", in, got, err)
		}
	}
	if _, err := ParseRole("Prefill "); err == nil {
		t.Error("a malformed role was accepted")
	}
}

// A decode must not wait behind a prefill: the prefill engines may be full
// of KV held for exactly the decodes behind it.
func TestPoolsQueueApart(t *testing.T) {
	one := 1.0
	r, _ := newRouter(t, 0, func(c *Config) { c.QueueThreshold = &one })
	r.AddWorker(WorkerInfo{ID: 1, Role: RolePrefill, TotalKVBlocks: 1024, MaxNumBatchedTokens: 64})
	r.AddWorker(WorkerInfo{ID: 2, Role: RoleDecode, TotalKVBlocks: 1024, MaxNumBatchedTokens: 64})
	r.AddWorker(WorkerInfo{ID: 3, Model: "other", TotalKVBlocks: 1024, MaxNumBatchedTokens: 64})
	submit := func(id, model string, prefill bool, salt int) bool {
		t.Helper()
		_, queued, err := r.Submit(&Request{ID: id, Model: model, Tokens: tokens(salt, 0, salt, 8), Prefill: prefill}, func(Decision, error) {})
		if err != nil {
			t.Fatal(err)
		}
		return queued
	}
	if submit("p1", "m", true, 1) {
		t.Fatal("the first prefill waited")
	}
	if !submit("p2", "m", true, 2) {
		t.Fatal("a prefill past the saturated prefill pool did not wait")
	}
	if submit("d1", "m", false, 3) {
		t.Fatal("a decode waited behind a prefill for an idle decode pool")
	}
	// Likewise another model's requests do not wait for this one's engines.
	if submit("d2", "m", false, 4) && submit("o1", "other", false, 5) {
		t.Fatal("a request of another model waited behind this model's queue")
	}
	r.Free("p1")
	if st := r.Stats(); st.QueuePending != 0 && st.QueuePending != 1 {
		t.Fatalf("queue after the first prefill ended: %d", st.QueuePending)
	}
}
