package enginesource

import (
	"slices"
	"sync/atomic"
	"testing"

	"github.com/kvrouter/kvrouter/adapters/vllmevents"
	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
)

// storedOn is stored on another medium.
func storedOn(t testing.TB, medium vllmevents.Medium, tokens []uint32, base uint64, from, to int) *vllmevents.BlockStored {
	t.Helper()
	b, err := vllmevents.DecodeBatch(stored(t, nil, tokens, base, from, to))
	if err != nil {
		t.Fatal(err)
	}
	st := b.Events[0].(*vllmevents.BlockStored)
	st.Medium = medium
	return st
}

func batchOf(t testing.TB, evs ...vllmevents.Event) []byte {
	t.Helper()
	return encode(t, &vllmevents.Batch{TS: 1, Events: evs})
}

// seqsOf are the sequence hashes of blocks [from, to) of tokens.
func seqsOf(tokens []uint32, from, to int) []uint64 {
	seqs := blockhash.SequenceHashes(blockhash.New(bs, "").LocalHashes(tokens))
	return slices.Sorted(slices.Values(seqs[from:to]))
}

func heldOn(r *router.Router, w kv.Worker, tier kv.StorageTier) []uint64 {
	return slices.Sorted(slices.Values(r.HeldBlocksOn(w, tier)))
}

// ringOfTwo is an engine keeping two batches for replay and a router
// knowing it as worker 1.
func ringOfTwo(t *testing.T) (*testPub, kv.Worker, *router.Router) {
	return newTestPub(t, pubOpts{keep: 2}), kv.Worker{ID: 1}, newRouter(t, router.WorkerInfo{ID: 1})
}

// After a gap the engine's dump replaces the rank on every tier: blocks
// offloaded to the host before the gap and dropped during it are gone,
// and the dump's host blocks are on the host tier, not the device.
func TestEnginesDumpRebuildsEveryTier(t *testing.T) {
	p, w, r := ringOfTwo(t)
	a, gone, x := toks(4, 5), toks(2, 7), toks(1, 6)
	var lost atomic.Bool
	dump := dumpServer(t, p, func() []byte {
		if !lost.Load() {
			return empty(t) // the engine at start-up
		}
		// a and x on the GPU, a's last two blocks also on the host.
		return batchOf(t, storedOn(t, "GPU", a, 500, 0, 4), storedOn(t, "CPU", a, 500, 2, 4), storedOn(t, "GPU", x, 600, 0, 1))
	})
	s := start(t, Config{Worker: w, Events: p.events(), Replay: p.replay(), Dump: dump}, r)
	warmUp(t, p, s)
	seq := p.publish(t, batchOf(t, storedOn(t, "GPU", gone, 700, 0, 2), storedOn(t, "CPU", gone, 700, 0, 2)), true)
	wait(t, s, seq)
	if got := heldOn(r, w, kv.TierHostPinned); !slices.Equal(got, seqsOf(gone, 0, 2)) {
		t.Fatalf("host tier before the gap: %v, want %v; device %v", got, seqsOf(gone, 0, 2), heldOn(r, w, kv.TierDevice))
	}
	// Lost: the offloaded blocks leave both tiers, a is stored; the ring
	// keeps two batches.
	lost.Store(true)
	dumps := s.Stats().Dumps
	p.publish(t, batchOf(t, &vllmevents.BlockRemoved{BlockHashes: []uint64{700, 701}, Medium: "GPU"}), false)
	p.publish(t, batchOf(t, &vllmevents.BlockRemoved{BlockHashes: []uint64{700, 701}, Medium: "CPU"}), false)
	for i := range 4 {
		p.publish(t, batchOf(t, storedOn(t, "GPU", a, 500, i, i+1)), false)
	}
	p.publish(t, batchOf(t, storedOn(t, "CPU", a, 500, 2, 4)), false)
	seq = p.publish(t, stored(t, nil, x, 600, 0, 1), true)
	wait(t, s, seq)
	if st := s.Stats(); st.Dumps != dumps+1 {
		t.Fatalf("stats %+v: want the dump loaded", st)
	}
	dev := slices.Sorted(slices.Values(append(seqsOf(a, 0, 4), seqsOf(x, 0, 1)...)))
	for tier, want := range map[kv.StorageTier][]uint64{kv.TierDevice: dev, kv.TierHostPinned: seqsOf(a, 2, 4), kv.TierDisk: nil, kv.TierExternal: nil} {
		if got := heldOn(r, w, tier); !slices.Equal(got, want) {
			t.Fatalf("%s tier after the dump: %d blocks %v, want %d %v", tier, len(got), got, len(want), want)
		}
	}
}
