package vllmevents

import (
	"reflect"
	"testing"

	"github.com/vmihailenco/msgpack/v5"
)

// The shapes below are what vLLM's msgspec encoder writes for extra_keys:
// a list with one entry per block, each nil or a tuple (msgpack array).
func TestParseExtraKeys(t *testing.T) {
	raw, err := msgpack.Marshal([]any{
		[]any{"sql-lora", []any{"3f", -3}, "tenant-a"},
		nil,
		[]any{[]byte{1, 2}, []any{"img", 5}, 7, true, 1.5, map[string]int{"x": 1}},
	})
	if err != nil {
		t.Fatal(err)
	}
	got, err := ParseExtraKeys(raw)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 3 || got[1] != nil {
		t.Fatalf("blocks: %+v", got)
	}
	b0 := got[0]
	if len(b0) != 3 || !reflect.DeepEqual(b0, []ExtraKey{{Kind: ExtraString, Str: "sql-lora"},
		{Kind: ExtraIdentifierOffset, Str: "3f", Offset: -3}, {Kind: ExtraString, Str: "tenant-a"}}) {
		t.Fatalf("block 0: %+v", b0)
	}
	b2 := got[2]
	kinds := []ExtraKeyKind{ExtraBytes, ExtraIdentifierOffset, ExtraInt, ExtraBool, ExtraFloat, ExtraOther}
	if len(b2) != len(kinds) {
		t.Fatalf("block 2: %+v", b2)
	}
	for i, k := range kinds {
		if b2[i].Kind != k {
			t.Errorf("block 2 key %d: kind %d, want %d", i, b2[i].Kind, k)
		}
	}
	if string(b2[0].Bytes) != "\x01\x02" || b2[1].Offset != 5 || b2[2].Offset != 7 {
		t.Errorf("block 2 values: %+v", b2)
	}
	if got, err := ParseExtraKeys(nil); got != nil || err != nil {
		t.Errorf("nil: %v %v", got, err)
	}
	for _, bad := range [][]byte{{0x91}, {0xa1}, {0x91, 0x91, 0xc1}, append(raw, 0)} {
		if _, err := ParseExtraKeys(bad); err == nil {
			t.Errorf("%x: no error", bad)
		}
	}
}
