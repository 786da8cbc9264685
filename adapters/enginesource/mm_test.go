package enginesource

import (
	"slices"
	"strings"
	"testing"

	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvrouter/kvrouter/adapters/vllmevents"
	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/kv"
)

func TestMMIdentifiersFromExtraKeys(t *testing.T) {
	digest := strings.Repeat("ab", 32)
	lora := strings.Repeat("cd", 32)
	raw, err := msgpack.Marshal([][]any{
		nil,
		{lora, []any{"img-uuid", 5}, []any{digest, -3}},
		{digest, "tenant-salt", lora},
		{strings.Repeat("z", 64)}, // 64 characters but no digest: a salt
	})
	if err != nil {
		t.Fatal(err)
	}
	keys, err := vllmevents.ParseExtraKeys(raw)
	if err != nil {
		t.Fatal(err)
	}
	got := mmIdentifiers(keys, lora)
	uuid, _ := blockhash.HashMMIdentifier("img-uuid")
	dig, _ := blockhash.HashMMIdentifier(digest)
	want := [][]uint64{nil, {uuid, dig}, {dig}, nil}
	if len(got) != len(want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	for i := range want {
		if !slices.Equal(got[i], want[i]) {
			t.Fatalf("block %d: got %v, want %v", i, got[i], want[i])
		}
	}
	if got := mmIdentifiers([][]vllmevents.ExtraKey{{{Kind: vllmevents.ExtraString, Str: "adapter"}}}, "adapter"); got != nil {
		t.Fatalf("a LoRA name read as an item: %v", got)
	}
}

// A stored event's items reach the router with its blocks; one whose
// extra_keys cannot be read is indexed apart and counted, never by its
// tokens alone.
func TestStoredEventsCarryTheirItems(t *testing.T) {
	p := newTestPub(t, pubOpts{})
	sink := &recSink{}
	s := start(t, Config{Worker: kv.Worker{ID: 9}, Events: p.events(), Replay: p.replay(), HashBytes: vllmevents.HashFirst8}, sink)
	warmUp(t, p, s)
	a := toks(2, 3)
	keys, err := msgpack.Marshal([][]any{nil, {[]any{"img", 4}}})
	if err != nil {
		t.Fatal(err)
	}
	seq := p.publish(t, encode(t, &vllmevents.Batch{TS: 1, Events: []vllmevents.Event{
		&vllmevents.BlockStored{BlockHashes: []uint64{1, 2}, TokenIDs: a, BlockSize: bs, ExtraKeys: keys},
		&vllmevents.BlockStored{BlockHashes: []uint64{3}, TokenIDs: a[:bs], BlockSize: bs, ExtraKeys: []byte{0x92, 0xc0, 0xc0}},
	}}), true)
	wait(t, s, seq)
	sink.mu.Lock()
	defer sink.mu.Unlock()
	img, _ := blockhash.HashMMIdentifier("img")
	if len(sink.stored) != 2 || len(sink.stored[0].MM) != 2 || sink.stored[0].MM[0] != nil || !slices.Equal(sink.stored[0].MM[1], []uint64{img}) {
		t.Fatalf("stored %+v", sink.stored)
	}
	// Misaligned extra_keys: indexed apart, matching nothing.
	if apart := sink.stored[1].MM; len(apart) != 1 || len(apart[0]) != 1 {
		t.Fatalf("misaligned event's blocks not marked apart: %+v", sink.stored[1])
	}
	if n := s.Stats().Unsupported["extra_keys=malformed"]; n != 1 {
		t.Fatalf("unreadable extra_keys counted %d times, want 1", n)
	}
}
