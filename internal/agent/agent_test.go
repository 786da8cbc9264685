package agent

import (
	"testing"

	"github.com/kvrouter/kvrouter/adapters/natsplane"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
)

// vLLM's offloading connector names its host blocks by id alone (medium
// CPU, no parent, no tokens). The agent forwards them placed below their
// device copies' parents, with the same hashes: a router behind the plane
// never sees the engine's own events, so it could not place them itself.
func TestTokenlessHostBlocksAreForwarded(t *testing.T) {
	var out []kv.Event
	a := &Agent{cfg: Config{Instance: natsplane.Instance{BlockSize: 16}}, announced: 16, publish: func(ev kv.Event) error {
		out = append(out, ev)
		return nil
	}}
	w := kv.Worker{ID: 7}
	toks := make([]uint32, 3*16)
	for i := range toks {
		toks[i] = uint32(100 + i)
	}
	ids := []uint64{41, 42, 43}
	if err := a.ApplyEngineStored(&router.EngineStored{Worker: w, EngineHashes: ids[:1], Tokens: toks[:16], BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	// The first host block comes before any device block was booked (as
	// in a router): it cannot be placed, and says so.
	if err := a.ApplyEngineStored(&router.EngineStored{Worker: w, Tier: kv.TierHostPinned, EngineHashes: ids[:1], Tokens: []uint32{}, BlockSize: 16}); err == nil {
		t.Fatal("a host block never booked on the device was accepted")
	}
	if err := a.ApplyEngineStored(&router.EngineStored{Worker: w, Parent: kv.Ptr(ids[0]), EngineHashes: ids[1:], Tokens: toks[16:], BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	device := out[len(out)-1]
	n := len(out)
	// Written through to the host, then evicted from the GPU.
	if err := a.ApplyEngineStored(&router.EngineStored{Worker: w, Tier: kv.TierHostPinned, EngineHashes: ids[1:], Tokens: []uint32{}, BlockSize: 16}); err != nil {
		t.Fatal(err)
	}
	rm := kv.RemovedEvent(w, 0, ids[1:]...)
	if err := a.ApplyEvent(&rm); err != nil {
		t.Fatal(err)
	}
	if len(out) != n+2 {
		t.Fatalf("the host blocks and the removal made %d events, want 2", len(out)-n)
	}
	host := out[n]
	if host.Kind != kv.KindStored || host.Tier != kv.TierHostPinned || host.Stored.Parent == nil || *host.Stored.Parent != ids[0] ||
		len(host.Stored.Blocks) != 2 || host.Stored.Blocks[0] != device.Stored.Blocks[0] || host.Stored.Blocks[1] != device.Stored.Blocks[1] {
		t.Fatalf("forwarded %+v, want the device's blocks %+v on the host tier below block %d", host, device.Stored, ids[0])
	}
}
