package router

import (
	"context"
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/core/kv"
)

// A replica learns that another replica's request has been prefilled from
// the engine's KV events, which reach every replica, before the relayed
// first token does; the first token that follows is then no error.
func TestRemotePrefillEndsWithTheEnginesEvents(t *testing.T) {
	a, b := newSyncRouter(t, nil), newSyncRouter(t, nil)
	var relayed []LoadUpdate // a's updates, delivered to b when the test says
	a.SetLoadObserver(func(u LoadUpdate) { relayed = append(relayed, u) })
	deliver := func() {
		t.Helper()
		for _, u := range relayed {
			if err := b.ApplyRemoteLoad(u); err != nil {
				t.Fatalf("B refused %v: %v", u.Kind, err)
			}
		}
		relayed = nil
	}
	prefilling := func(r *Router, w kv.Worker) int {
		for _, l := range r.Loads() {
			if l.Worker == w {
				return l.ActivePrefillTokens
			}
		}
		return 0
	}

	toks := syncPrompt(9, 0, 9, 8)
	d, err := a.BestWorker(context.Background(), &Request{ID: "r", Tokens: toks})
	if err != nil {
		t.Fatal(err)
	}
	deliver()
	if got := prefilling(b, d.Worker); got != len(toks) {
		t.Fatalf("B after the booking: %d prompt tokens awaiting prefill on %v, want %d", got, d.Worker, len(toks))
	}

	// Half the prompt stored (a chunk of a chunked prefill): not yet done.
	half := storedEvent(d.Worker, toks[:len(toks)/2])
	for _, r := range []*Router{a, b} {
		if err := r.ApplyEvent(&half); err != nil {
			t.Fatal(err)
		}
	}
	if got := prefilling(b, d.Worker); got != len(toks) {
		t.Fatalf("B after half the prompt was stored: %d prompt tokens awaiting prefill, want %d", got, len(toks))
	}

	// The step that ends the prefill stores the rest and yields the first
	// token; its relay to B is still on its way.
	rest := storedEvent(d.Worker, toks)
	for _, r := range []*Router{a, b} {
		if err := r.ApplyEvent(&rest); err != nil {
			t.Fatal(err)
		}
	}
	a.MarkPrefillCompleted("r")
	if got := prefilling(b, d.Worker); got != 0 {
		t.Errorf("B once the engine stored the whole prompt: %d prompt tokens awaiting prefill, want 0 as A", got)
	}
	if la, lb := a.Loads(), b.Loads(); !slices.Equal(la, lb) {
		t.Errorf("loads differ before the first token's relay:\nA %+v\nB %+v", la, lb)
	}

	deliver() // the first token: already applied
	a.Free("r")
	deliver()
	if na, nb := a.Stats().Load.Active, b.Stats().Load.Active; na != 0 || nb != 0 {
		t.Errorf("active requests after the end: A %d, B %d", na, nb)
	}
	if la, lb := a.Loads(), b.Loads(); !slices.Equal(la, lb) {
		t.Errorf("loads differ after the end:\nA %+v\nB %+v", la, lb)
	}
}
