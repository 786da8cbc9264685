package router

import (
	"sync"
	"testing"
)

type recTap struct {
	mu     sync.Mutex
	budget int
	got    []DecisionRecord
}

func (t *recTap) Want() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.budget == 0 {
		return false
	}
	t.budget--
	return true
}

func (t *recTap) Record(d DecisionRecord) {
	t.mu.Lock()
	t.got = append(t.got, d)
	t.mu.Unlock()
}

func TestDecisionTapExplainsTheChoiceAndHonoursWant(t *testing.T) {
	r, _ := newRouter(t, 4, nil)
	store(t, r, w(2), tokens(7, 40, 7, 40))
	r.AddWorker(WorkerInfo{ID: 9, TotalKVBlocks: 16})
	if r.WorkerEvents(2) != 1 || r.WorkerEvents(1) != 0 || r.WorkerEvents(42) != 0 {
		t.Fatalf("events counted %d, %d, %d: want 1 for the engine that sent one, and kept across fleet changes", r.WorkerEvents(2), r.WorkerEvents(1), r.WorkerEvents(42))
	}
	r.RemoveWorker(9)
	tap := &recTap{budget: 1}
	r.SetDecisionTap(tap)
	if _, err := route(r, "a", tokens(7, 40, 99, 50)); err != nil {
		t.Fatal(err)
	}
	if _, err := route(r, "b", tokens(7, 40, 98, 50)); err != nil {
		t.Fatal(err)
	}
	if len(tap.got) != 1 {
		t.Fatalf("recorded %d decisions, want 1: Want said no to the second", len(tap.got))
	}
	d := tap.got[0]
	if d.ID != "a" || d.Worker != w(2) || d.OverlapBlocks != 40 || d.PromptBlocks != 50 || d.ISL != 50*bs {
		t.Fatalf("record %+v", d)
	}
	if len(d.Top) != TopCandidates || d.Top[0].Worker != w(2) {
		t.Fatalf("top candidates %+v, want %d with worker 2 first", d.Top, TopCandidates)
	}
	for i, c := range d.Top {
		if i > 0 && c.Total < d.Top[i-1].Total {
			t.Fatalf("top not sorted by cost: %+v", d.Top)
		}
	}
	if d.Top[0].CacheCredit <= 0 || d.Top[1].CacheCredit != 0 {
		t.Fatalf("only the cached worker earns cache credit: %+v", d.Top)
	}

	r.SetDecisionTap(nil)
	tap.budget = 10
	if _, err := route(r, "c", tokens(7, 40, 97, 50)); err != nil {
		t.Fatal(err)
	}
	if len(tap.got) != 1 {
		t.Fatal("a removed tap still records")
	}
}

// Among workers of equal cost the chosen one is listed, whichever wins the
// tie: a person reading the decision sees where it went.
func TestDecisionTapShowsTheChosenWorker(t *testing.T) {
	r, _ := newRouter(t, 6, nil)
	tap := &recTap{budget: 100}
	r.SetDecisionTap(tap)
	for i := range 30 {
		if _, err := route(r, "", tokens(i, 0, i, 3)); err != nil {
			t.Fatal(err)
		}
	}
	if len(tap.got) != 30 {
		t.Fatalf("recorded %d decisions", len(tap.got))
	}
	for _, d := range tap.got {
		shown := false
		for _, c := range d.Top {
			shown = shown || c.Worker == d.Worker
		}
		if !shown || len(d.Top) != TopCandidates {
			t.Fatalf("decision to %v lists %+v", d.Worker, d.Top)
		}
	}
}
