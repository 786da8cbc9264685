package kv

import (
	"reflect"
	"testing"
)

var jsonSamples = []Event{
	StoredEvent(Worker{ID: 1<<64 - 1, DPRank: 1<<32 - 1}, 1<<64-1, nil, Block{EngineHash: 1, LocalHash: 2}, Block{EngineHash: 1<<64 - 1, LocalHash: 0}),
	StoredEvent(Worker{ID: 3}, 9, Ptr(77)),
	{Worker: Worker{ID: 4}, Tier: TierHostPinned, EventID: 2, Kind: KindStored, Stored: Stored{Parent: Ptr(0), StartPosition: func() *uint32 { v := uint32(32); return &v }(), Blocks: []Block{{5, 6}}}},
	RemovedEvent(Worker{ID: 5, DPRank: 2}, 3, 10, 11, 12),
	RemovedEvent(Worker{ID: 5}, 4),
	ClearedEvent(Worker{ID: 6, DPRank: 7}, 8),
	{Worker: Worker{ID: 7}, Tier: StorageTier(`we"ird<tier>`), Kind: KindCleared},
}

// The hand-written encoder and decoder must agree with encoding/json's
// reading of the same shape.
func TestJSONFastPathsAgreeWithEncodingJSON(t *testing.T) {
	for _, ev := range jsonSamples {
		b, err := ev.MarshalJSON()
		if err != nil {
			t.Fatal(err)
		}
		var slow, fast Event
		if err := slow.unmarshalSlow(b); err != nil {
			t.Fatalf("%s: encoding/json refuses it: %v", b, err)
		}
		if err := fast.UnmarshalJSON(b); err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(slow, fast) || !reflect.DeepEqual(normal(ev), fast) {
			t.Fatalf("%s:\nslow %+v\nfast %+v\nwant %+v", b, slow, fast, ev)
		}
		if _, ok := decodeFast(b); !ok && ev.Tier != StorageTier(`we"ird<tier>`) {
			t.Fatalf("fast path refused kvrouter's own encoding: %s", b)
		}
	}
}

// normal is ev as it reads back: empty slices stay empty, not nil.
func normal(ev Event) Event {
	if ev.Kind == KindStored && ev.Stored.Blocks == nil {
		ev.Stored.Blocks = []Block{}
	}
	if ev.Kind == KindRemoved && ev.Removed.EngineHashes == nil {
		ev.Removed.EngineHashes = []uint64{}
	}
	return ev
}

func TestJSONOtherSpellingsFallBack(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want Event
		bad  bool
	}{
		{in: `{"WORKER_ID":3,"event":{"event_id":1,"data":"cleared"}}`, want: ClearedEvent(Worker{ID: 3}, 1)},
		{in: ` { "worker_id" : 3 , "extra": [1,{"x":null}], "event" : { "data" : "cleared" , "event_id" : 1 } } `, want: ClearedEvent(Worker{ID: 3}, 1)},
		{in: `{"worker_id":3,"event":{"event_id":1,"data":{"stored":{"blocks":null}}}}`, want: Event{Worker: Worker{ID: 3}, Tier: TierDevice, EventID: 1, Kind: KindStored}},
		{in: `{"worker_id":-3,"event":{"data":"cleared"}}`, bad: true},
		{in: `{"worker_id":3,"event":{"data":"exploded"}}`, bad: true},
		{in: `{"worker_id":3,"event":{"data":{"stored":{},"removed":{}}}}`, bad: true},
		{in: `{"worker_id":03,"event":{"data":"cleared"}}`, bad: true},
		{in: `{"worker_id":3,"event":{"data":"cleared"}} x`, bad: true},
		{in: `{"worker_id":1.5,"event":{"data":"cleared"}}`, bad: true},
		{in: `{"worker_id":18446744073709551616,"event":{"data":"cleared"}}`, bad: true},
		{in: `{"worker_id":3,"event":{"dp_rank":4294967296,"data":"cleared"}}`, bad: true},
		{in: `{"worker_id":3}`, bad: true},
	} {
		var got Event
		err := got.UnmarshalJSON([]byte(tc.in))
		if tc.bad {
			if err == nil {
				t.Errorf("%s: accepted as %+v", tc.in, got)
			}
			continue
		}
		if err != nil || !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%s: %+v, %v; want %+v", tc.in, got, err, tc.want)
		}
	}
}

func FuzzEventJSON(f *testing.F) {
	for _, ev := range jsonSamples {
		b, _ := ev.MarshalJSON()
		f.Add(b)
	}
	f.Add([]byte(`{"worker_id":3,"event":{"data":{"removed":{"block_hashes":null}}}}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		fast, ok := decodeFast(b)
		var slow Event
		slowErr := slow.unmarshalSlow(b)
		if ok && (slowErr != nil || !reflect.DeepEqual(fast, slow)) {
			t.Fatalf("%q: fast %+v, encoding/json %+v (%v)", b, fast, slow, slowErr)
		}
		if slowErr == nil && slow.Kind != 0 {
			again, err := slow.MarshalJSON()
			if err != nil {
				t.Fatal(err)
			}
			var back Event
			if err := back.UnmarshalJSON(again); err != nil || !reflect.DeepEqual(normal(back), normal(slow)) {
				t.Fatalf("%q re-encoded as %s reads back as %+v (%v)", b, again, back, err)
			}
		}
	})
}

func BenchmarkEventJSON(b *testing.B) {
	blocks := make([]Block, 16)
	for i := range blocks {
		blocks[i] = Block{EngineHash: uint64(i) * 0x9e3779b97f4a7c15, LocalHash: uint64(i) * 0xbf58476d1ce4e5b9}
	}
	ev := StoredEvent(Worker{ID: 123456789, DPRank: 1}, 987654, Ptr(0xdeadbeefcafebabe), blocks...)
	data, _ := ev.MarshalJSON()
	b.Run("encode", func(b *testing.B) {
		buf := make([]byte, 0, 2048)
		for b.Loop() {
			buf, _ = ev.AppendJSON(buf[:0])
		}
	})
	b.Run("decode", func(b *testing.B) {
		b.SetBytes(int64(len(data)))
		var out Event
		for b.Loop() {
			if err := out.UnmarshalJSON(data); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("decode-encoding-json", func(b *testing.B) {
		var out Event
		for b.Loop() {
			if err := out.unmarshalSlow(data); err != nil {
				b.Fatal(err)
			}
		}
	})
}
