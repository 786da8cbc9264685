package bench

import (
	"testing"

	"github.com/kvrouter/kvrouter/core/kv"
)

// A recovered router must hold every block on the engine's tiers: a
// block offloaded to the host and rebuilt on the device only is missing
// there, and one the router keeps on a tier the engine dropped is extra.
func TestRecoverySampleComparesTiers(t *testing.T) {
	engine := map[kv.StorageTier]map[uint64]bool{kv.TierDevice: {1: true, 2: true}, kv.TierHostPinned: {2: true, 3: true}}
	for _, tc := range []struct {
		name           string
		router         map[kv.StorageTier][]uint64
		missing, extra int
	}{
		{"exact", map[kv.StorageTier][]uint64{kv.TierDevice: {1, 2}, kv.TierHostPinned: {3, 2}}, 0, 0},
		{"tier dropped", map[kv.StorageTier][]uint64{kv.TierDevice: {1, 2, 3}}, 2, 1},
		{"stale disk block", map[kv.StorageTier][]uint64{kv.TierDevice: {1, 2}, kv.TierHostPinned: {2, 3}, kv.TierDisk: {1}}, 0, 1},
	} {
		var smp RecoverySample
		smp.compare(engine, func(tier kv.StorageTier) []uint64 { return tc.router[tier] })
		lower := len(tc.router[kv.TierHostPinned]) + len(tc.router[kv.TierDisk])
		if smp.Missing != tc.missing || smp.Extra != tc.extra || smp.EngineBlocks != 4 || smp.EngineLowerBlocks != 2 || smp.RouterLowerBlocks != lower {
			t.Errorf("%s: %+v, want missing %d extra %d", tc.name, smp, tc.missing, tc.extra)
		}
	}
}
