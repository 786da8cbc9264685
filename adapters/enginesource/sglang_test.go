package enginesource

import (
	"maps"
	"testing"

	"github.com/kvrouter/kvrouter/adapters/vllmevents"
	"github.com/kvrouter/kvrouter/core/kv"
)

// TestSGLangEventsReachTheSink: SGLang's salt reaches the router with the
// blocks, its media map to tiers as Dynamo maps them, a medium nobody knows
// is neither guessed nor applied but counted under one label, and a
// session id is decoded and left alone (session affinity comes from
// requests, not events). Blocks stored away from the engine (vLLM's
// locality) are not credited to it, and counted.
func TestSGLangEventsReachTheSink(t *testing.T) {
	sink := &recSink{}
	w := kv.Worker{ID: 4}
	s := detached(Config{Worker: w, HashBytes: vllmevents.HashFirst8}, sink)
	a := toks(1, 13)
	for _, enc := range []vllmevents.Encoding{vllmevents.EncodingArray, vllmevents.EncodingMap} {
		s.apply(uint64(enc), encodeWith(t, &vllmevents.Batch{TS: 1, Events: []vllmevents.Event{
			&vllmevents.BlockStored{BlockHashes: []uint64{1}, TokenIDs: a, BlockSize: bs, Medium: "GPU", CacheSalt: "tenant-a", SessionID: "sess-1"},
			&vllmevents.BlockStored{BlockHashes: []uint64{2}, TokenIDs: a, BlockSize: bs, Medium: "CPU_TIER2"},
			&vllmevents.BlockStored{BlockHashes: []uint64{3}, TokenIDs: a, BlockSize: bs, Medium: "GPU_HBM"},
			&vllmevents.BlockRemoved{BlockHashes: []uint64{2}, Medium: "CPU_TIER1"},
			&vllmevents.BlockRemoved{BlockHashes: []uint64{3}, Medium: "s3://bucket"},
			&vllmevents.BlockStored{BlockHashes: []uint64{4}, TokenIDs: a, BlockSize: bs, Medium: "STORAGE", Locality: "REMOTE"},
			&vllmevents.BlockStored{BlockHashes: []uint64{5}, TokenIDs: a, BlockSize: bs, Medium: "STORAGE", Locality: "NEARBY"},
		}}, enc), false)
	}
	sink.mu.Lock()
	defer sink.mu.Unlock()
	if len(sink.stored) != 4 || len(sink.events) != 2 {
		t.Fatalf("stored %+v events %+v", sink.stored, sink.events)
	}
	for i := 0; i < 4; i += 2 {
		salted, disk := sink.stored[i], sink.stored[i+1]
		if salted.Salt != "tenant-a" || salted.Tier != kv.TierDevice || disk.Salt != "" || disk.Tier != kv.TierDisk {
			t.Fatalf("stored %+v", sink.stored)
		}
	}
	for _, ev := range sink.events {
		if ev.Kind != kv.KindRemoved || ev.Tier != kv.TierHostPinned || ev.Removed.EngineHashes[0] != 2 {
			t.Fatalf("events %+v", sink.events)
		}
	}
	if got, want := s.unsup.snapshot(), map[string]uint64{"medium=unknown": 4, "locality=remote": 2, "locality=unknown": 2}; !maps.Equal(got, want) {
		t.Fatalf("unsupported %v, want %v", got, want)
	}
	if n := s.st.skipped.Load(); n != 8 {
		t.Fatalf("skipped %d, want 8", n)
	}
}

// TestInspectorCountsWhatServeCounts: the Inspector doctor uses counts
// what a Source would.
func TestInspectorCountsWhatServeCounts(t *testing.T) {
	in := NewInspector(Config{Worker: kv.Worker{ID: 1}})
	if in.Unsupported() != nil {
		t.Fatal("counts before any payload")
	}
	in.Apply([]byte{0xc1}) // not msgpack: nothing to count
	in.Apply(encode(t, &vllmevents.Batch{TS: 1, Events: []vllmevents.Event{
		&vllmevents.BlockStored{BlockHashes: []uint64{1}, TokenIDs: toks(1, 2), BlockSize: bs, Medium: "TAPE"},
		&vllmevents.BlockStored{BlockHashes: []uint64{2}, TokenIDs: toks(1, 3), BlockSize: bs},
	}}))
	if got, want := in.Unsupported(), map[string]uint64{"medium=unknown": 1}; !maps.Equal(got, want) {
		t.Fatalf("unsupported %v, want %v", got, want)
	}
}

func encodeWith(t testing.TB, b *vllmevents.Batch, enc vllmevents.Encoding) []byte {
	t.Helper()
	p, err := vllmevents.EncodeBatch(b, enc)
	if err != nil {
		t.Fatal(err)
	}
	return p
}
