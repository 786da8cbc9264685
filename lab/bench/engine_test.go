package bench

import (
	"testing"

	"github.com/kvrouter/kvrouter/core/kv"
)

func TestEngineEvents(t *testing.T) {
	w := kv.Worker{ID: 7}
	e := NewEngine(w, 4, 1)
	hit, evs := e.Serve([]uint64{1, 2, 3}, []uint64{11, 12, 13})
	if hit != 0 || len(evs) != 1 || evs[0].Kind != kv.KindStored || evs[0].Stored.Parent != nil ||
		len(evs[0].Stored.Blocks) != 3 || evs[0].Worker != w || evs[0].EventID != 1 {
		t.Fatalf("first prompt: hit %d, events %+v", hit, evs)
	}
	first := evs[0].Stored.Blocks
	if first[1].LocalHash != 12 || first[1].EngineHash == 0 || first[1].EngineHash == 2 {
		t.Fatalf("block ids: %+v", first)
	}
	// Two cached blocks, one new: the chain hangs below block 2's engine
	// id, and block 3 (least recent) is evicted to make room.
	hit, evs = e.Serve([]uint64{1, 2, 4, 5}, []uint64{11, 12, 14, 15})
	if hit != 2 || len(evs) != 2 || evs[0].Kind != kv.KindRemoved || evs[1].Kind != kv.KindStored {
		t.Fatalf("second prompt: hit %d, events %+v", hit, evs)
	}
	if got := evs[0].Removed.EngineHashes; len(got) != 1 || got[0] != first[2].EngineHash {
		t.Fatalf("removed %v, want [%d]", got, first[2].EngineHash)
	}
	if p := evs[1].Stored.Parent; p == nil || *p != first[1].EngineHash || len(evs[1].Stored.Blocks) != 2 {
		t.Fatalf("stored %+v", evs[1].Stored)
	}
	if e.Blocks() != 4 || e.Capacity() != 4 || evs[1].EventID != 3 {
		t.Fatalf("blocks %d, capacity %d, event id %d", e.Blocks(), e.Capacity(), evs[1].EventID)
	}
}
