package bench

import (
	"testing"

	"github.com/kvrouter/kvrouter/core/router"
)

// The generator's own account of a worker's blocks must be what an index
// fed its events holds, evictions included: the throughput measurement
// decides that the router caught up by comparing the two.
func TestEventGenMatchesTheIndex(t *testing.T) {
	r, err := router.New(router.DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	r.AddWorker(router.WorkerInfo{ID: 7, DPSize: 1})
	sink := &countingSink{Router: r, held: make([]heldSum, 8)}
	w := &benchWorker{gen: newEventGen(7, 4, 40, 1)}
	removals := 0
	for range 200 {
		ev := w.gen.event(w.gen.blocks)
		if len(ev.Removed.EngineHashes) > 0 {
			removals++
		}
		ev.EventID = 1
		if err := sink.ApplyEvent(&ev); err != nil {
			t.Fatal(err)
		}
		if w.gen.held > 40 {
			t.Fatalf("worker holds %d blocks, over its capacity", w.gen.held)
		}
	}
	if removals == 0 {
		t.Fatal("a full worker never evicted")
	}
	if got := r.Stats().IndexedPairs; got != uint64(w.gen.held) || !sink.caughtUp([]*benchWorker{w}) {
		t.Fatalf("index holds %d blocks, the worker %d", got, w.gen.held)
	}
}
