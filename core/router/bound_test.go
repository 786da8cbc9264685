package router

import (
	"testing"

	"github.com/kvrouter/kvrouter/core/index"
	"github.com/kvrouter/kvrouter/core/kv"
)

// An engine registered without a capacity is bounded by the one it
// reports; one registered with a capacity keeps it.
func TestEngineReportedCapacityBoundsItsIndex(t *testing.T) {
	r, err := New(DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	r.AddWorker(WorkerInfo{ID: 1})
	r.AddWorker(WorkerInfo{ID: 2, TotalKVBlocks: 5000})
	for _, id := range []uint64{1, 2} {
		r.EngineCapacity(kv.Worker{ID: id}, 100)
		blocks := make([]kv.Block, 10*index.RankBound(100))
		for i := range blocks {
			blocks[i] = kv.Block{EngineHash: uint64(i + 1), LocalHash: uint64(i + 1)}
		}
		ev := kv.StoredEvent(kv.Worker{ID: id}, 0, nil, blocks...)
		if err := r.ApplyEvent(&ev); err != nil {
			t.Fatal(err)
		}
	}
	if got, want := len(r.HeldBlocks(kv.Worker{ID: 1})), index.RankBound(100); got != want {
		t.Fatalf("engine 1 holds %d blocks, want its reported bound %d", got, want)
	}
	if got, want := len(r.HeldBlocks(kv.Worker{ID: 2})), index.RankBound(5000); got != want {
		t.Fatalf("engine 2 holds %d blocks, want its registered bound %d", got, want)
	}
	if ob := r.OverBound(); len(ob) != 2 {
		t.Fatalf("OverBound = %+v", ob)
	}
}
