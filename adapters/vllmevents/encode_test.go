package vllmevents

import (
	"bytes"
	"encoding/hex"
	"testing"
)

func smallBatch() *Batch {
	return &Batch{TS: 1.5, DPRank: iptr(1), Events: []Event{
		&BlockStored{BlockHashes: []uint64{1, 0xfffffffffffffffe}, TokenIDs: []uint32{1, 2}, BlockSize: 2, Medium: "GPU", GroupIdx: 1},
		&BlockRemoved{BlockHashes: []uint64{1}, Medium: "GPU"},
		&AllBlocksCleared{},
	}}
}

// The events of smallBatch as maps (EncodingMap, EncodingMapBatch).
const smallMapEvents = `
  93
    89 a4 'type' ab 'BlockStored'
       ac 'block_hashes' 92 01 cf ff ff ff ff ff ff ff fe
       b1 'parent_block_hash' c0
       a9 'token_ids' 92 01 02
       aa 'block_size' 02
       a7 'lora_id' c0
       a6 'medium' a3 'GPU'
       a9 'lora_name' c0
       a9 'group_idx' 01               # extra_keys (default) omitted, trailing defaults omitted
    83 a4 'type' ac 'BlockRemoved'
       ac 'block_hashes' 91 01
       a6 'medium' a3 'GPU'            # group_idx 0 is the default: omitted
    81 a4 'type' b0 'AllBlocksCleared'
`

func TestEncodeBatchExact(t *testing.T) {
	for _, tc := range []struct {
		enc  Encoding
		want string
	}{
		{EncodingArray, `
93 cb 3f f8 00 00 00 00 00 00
  93
    9a ab 'BlockStored'
       92 01 cf ff ff ff ff ff ff ff fe
       c0 92 01 02 02 c0 a3 'GPU' c0
       c0                              # extra_keys: defaulted but not trailing
       01                              # group_idx; kind and window trailing: omitted
    93 ac 'BlockRemoved' 91 01 a3 'GPU'
    91 b0 'AllBlocksCleared'
  01
`},
		{EncodingMap, `93 cb 3f f8 00 00 00 00 00 00` + smallMapEvents + `01`},
		{EncodingMapBatch, `83 a2 'ts' cb 3f f8 00 00 00 00 00 00 a6 'events'` + smallMapEvents + `b2 'data_parallel_rank' 01`},
	} {
		t.Run(tc.enc.String(), func(t *testing.T) {
			got, err := EncodeBatch(smallBatch(), tc.enc)
			if err != nil {
				t.Fatal(err)
			}
			want := hx(t, tc.want)
			if !bytes.Equal(got, want) {
				t.Fatalf("EncodeBatch(%v)\n got %s\nwant %s", tc.enc, hex.EncodeToString(got), hex.EncodeToString(want))
			}
		})
	}
}

func TestEncodeNoRankIsTwoElements(t *testing.T) {
	got, err := EncodeBatch(&Batch{TS: 1.5}, EncodingArray)
	if err != nil {
		t.Fatal(err)
	}
	if want := hx(t, `92 cb 3f f8 00 00 00 00 00 00 90`); !bytes.Equal(got, want) {
		t.Fatalf("got %x want %x", got, want)
	}
}

func fullBatch() *Batch {
	return &Batch{TS: 1723456789.123456, DPRank: iptr(7), Events: []Event{
		&BlockStored{BlockHashes: []uint64{0, 1, 127, 128, 1 << 32, 0xffffffffffffffff}, ParentBlockHash: u64(0x8000000000000000),
			TokenIDs: []uint32{0, 1, 65535, 65536, 0xffffffff}, BlockSize: 3, LoRAID: iptr(-2), Medium: "CPU",
			LoRAName: "adapter-with-a-name-longer-than-thirty-one-bytes", ExtraKeys: []byte{0x92, 0x91, 0xa1, 'm', 0xc0},
			GroupIdx: 2, KVCacheSpecKind: "sliding_window", KVCacheSpecSlidingWindow: iptr(1024)},
		&BlockStored{BlockHashes: []uint64{9}, BlockSize: 16},
		&BlockStored{BlockHashes: []uint64{10}, KVCacheSpecSlidingWindow: iptr(0)},
		&BlockRemoved{BlockHashes: []uint64{9, 10}, Medium: "DISK", GroupIdx: 5},
		&BlockRemoved{BlockHashes: []uint64{}},
		&AllBlocksCleared{},
	}}
}

func TestRoundTrip(t *testing.T) {
	for _, enc := range []Encoding{EncodingArray, EncodingMap, EncodingMapBatch} {
		for _, b := range []*Batch{fullBatch(), smallBatch(), {TS: 0}, {TS: -1, DPRank: iptr(0), Events: []Event{&AllBlocksCleared{}}}} {
			p, err := EncodeBatch(b, enc)
			if err != nil {
				t.Fatal(err)
			}
			got, err := DecodeBatch(p)
			if err != nil {
				t.Fatalf("%v: %v", enc, err)
			}
			checkBatch(t, got, b)
		}
	}
}

func TestEncodeErrors(t *testing.T) {
	for name, b := range map[string]*Batch{
		"bad extra_keys": {Events: []Event{&BlockStored{ExtraKeys: []byte{0x92, 0x01}}}},
		"nil stored":     {Events: []Event{(*BlockStored)(nil)}},
		"nil event":      {Events: []Event{nil}},
		"negative size":  {Events: []Event{&BlockStored{BlockSize: -1}}},
	} {
		if _, err := EncodeBatch(b, EncodingArray); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
	if _, err := EncodeBatch(smallBatch(), Encoding(9)); err == nil {
		t.Error("unknown encoding accepted")
	}
	if _, err := EncodeBatch(nil, EncodingArray); err == nil {
		t.Error("nil batch accepted")
	}
}
