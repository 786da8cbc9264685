package kv

import (
	"encoding/json"
	"errors"
	"reflect"
	"testing"
)

func TestEventJSONRoundTrip(t *testing.T) {
	w := Worker{ID: 7, DPRank: 2}
	tests := []Event{
		StoredEvent(w, 1, nil, Block{EngineHash: 10, LocalHash: 11}),
		StoredEvent(w, 2, Ptr(10), Block{EngineHash: 12, LocalHash: 13}, Block{EngineHash: 14, LocalHash: 15}),
		RemovedEvent(w, 3, 12, 14),
		ClearedEvent(w, 4),
	}
	for _, ev := range tests {
		b, err := json.Marshal(ev)
		if err != nil {
			t.Fatal(err)
		}
		var back Event
		if err := json.Unmarshal(b, &back); err != nil {
			t.Fatalf("%s: %v", b, err)
		}
		if !reflect.DeepEqual(back, ev) {
			t.Fatalf("round trip of %s:\n got %+v\nwant %+v", b, back, ev)
		}
	}
}

func TestEventJSONMatchesThePlaneShape(t *testing.T) {
	in := `{"worker_id": 3, "storage_tier": "host_pinned", "event": {"event_id": 9, "dp_rank": 1,
		"data": {"stored": {"parent_hash": null, "start_position": 0, "blocks": [{"block_hash": 5, "tokens_hash": 6}]}}}}`
	var ev Event
	if err := json.Unmarshal([]byte(in), &ev); err != nil {
		t.Fatal(err)
	}
	want := Event{Worker: Worker{ID: 3, DPRank: 1}, Tier: TierHostPinned, EventID: 9, Kind: KindStored,
		Stored: Stored{StartPosition: new(uint32), Blocks: []Block{{EngineHash: 5, LocalHash: 6}}}}
	if !reflect.DeepEqual(ev, want) {
		t.Fatalf("got %+v want %+v", ev, want)
	}
	var cleared Event
	if err := json.Unmarshal([]byte(`{"worker_id": 1, "event": {"event_id": 0, "dp_rank": 0, "data": "cleared"}}`), &cleared); err != nil || cleared.Kind != KindCleared || cleared.Tier != TierDevice {
		t.Fatalf("cleared without tier: %+v %v", cleared, err)
	}
}

func TestMalformedEventsAreErrorsNotPanics(t *testing.T) {
	for _, in := range []string{
		``, `{}`, `[]`, `{"worker_id": "x"}`,
		`{"worker_id": 1, "event": {"data": "exploded"}}`,
		`{"worker_id": 1, "event": {"data": {"stored": {}, "removed": {}}}}`,
		`{"worker_id": 1, "event": {"data": {"renamed": {}}}}`,
		`{"worker_id": 1, "event": {"data": {"stored": {"blocks": [{"block_hash": -1}]}}}}`,
		`{"worker_id": 1, "event": {"data": {"removed": {"block_hashes": "x"}}}}`,
	} {
		var ev Event
		if err := json.Unmarshal([]byte(in), &ev); err == nil {
			t.Fatalf("%q decoded to %+v", in, ev)
		} else if in != `` && !errors.Is(err, ErrMalformedEvent) {
			t.Fatalf("%q: error %v does not wrap ErrMalformedEvent", in, err)
		}
	}
}
