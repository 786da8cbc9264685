package natsplane

import (
	"errors"
	"reflect"
	"testing"

	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/load"
	"github.com/kvrouter/kvrouter/core/router"
)

// What a replica publishes decodes, on another, to the same change under
// the request id qualified with the sender's: the codec the simulator's
// replicas use is the one the NATS sync sends.
func TestLoadUpdateRoundTrip(t *testing.T) {
	yes, no := true, false
	add := router.LoadUpdate{Kind: router.LoadAdd, Request: load.Request{
		ID: "7", Worker: kv.Worker{ID: 3, DPRank: 1}, Blocks: []uint64{11, 12, 13}, ISL: 40, OverlapBlocks: 2, OSL: 9,
		TrackPrefill: &yes, AssumeReuse: &no,
	}, Predict: 2}
	for _, tc := range []struct {
		in, want router.LoadUpdate
	}{
		{add, func() router.LoadUpdate { w := add; w.Request.ID = "a/7"; return w }()},
		{router.LoadUpdate{Kind: router.LoadPrefillDone, ID: "7"}, router.LoadUpdate{Kind: router.LoadPrefillDone, ID: "a/7"}},
		{router.LoadUpdate{Kind: router.LoadFree, ID: "7"}, router.LoadUpdate{Kind: router.LoadFree, ID: "a/7"}},
	} {
		b, err := EncodeLoadUpdate("a", tc.in)
		if err != nil {
			t.Fatal(err)
		}
		from, got, err := DecodeLoadUpdate(b)
		if err != nil || from != "a" || !reflect.DeepEqual(got, tc.want) {
			t.Fatalf("%s: decoded %q %+v, %v; want %+v", b, from, got, err, tc.want)
		}
	}
	if _, _, err := DecodeLoadUpdate([]byte("{")); !errors.Is(err, ErrUndecodable) {
		t.Fatalf("a broken message: %v, want ErrUndecodable", err)
	}
	if from, _, err := DecodeLoadUpdate([]byte(`{"router_id":"b","kind":"add","request_id":"1"}`)); err == nil || from != "b" {
		t.Fatalf("an add without a worker: from %q, %v; want b and an error", from, err)
	}
}
