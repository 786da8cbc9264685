package sim

import (
	"testing"

	"github.com/kvrouter/kvrouter/mocker/engine"
)

// A hybrid model's extra groups (a sliding window whose blocks have the
// full group's ids, a Mamba group) reach the router no more than a live
// engine's do: the router routes on the full-attention group, exactly as
// for the same model without them.
func TestHybridEnginesRouteOnTheFullAttentionGroup(t *testing.T) {
	w := synthetic(t, 200)
	plain, err := Run(smallConfig(), "kv", w, 1)
	if err != nil {
		t.Fatal(err)
	}
	cfg := smallConfig()
	cfg.Engine.KVCacheGroups = []engine.KVCacheGroup{{Kind: "sliding_window", BlockSize: 16, SlidingWindow: 256}, {Kind: "full_attention"}, {Kind: "mamba", BlockSize: 64}}
	hybrid, err := Run(cfg, "kv", w, 1)
	if err != nil {
		t.Fatal(err)
	}
	if hybrid != plain {
		t.Fatalf("a hybrid model routes differently:\n%+v\n%+v", hybrid, plain)
	}
}
