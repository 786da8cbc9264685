package router

import (
	"math/rand/v2"
	"testing"

	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/sched"
)

// candidatesFor is what the scheduler is given for a prompt.
func candidatesFor(t *testing.T, r *Router, tokens []uint32) map[kv.Worker]sched.Candidate {
	t.Helper()
	p, err := r.prepare(&Request{Tokens: tokens})
	if err != nil {
		t.Fatal(err)
	}
	defer release(p)
	sc := r.scratch.Get().(*scratch)
	defer r.scratch.Put(sc)
	r.match(p, sc, p.arrival)
	out := map[kv.Worker]sched.Candidate{}
	for _, c := range r.candidates(p, sc) {
		out[c.Worker] = c
	}
	return out
}

// A prompt whose blocks an engine moved from the GPU to its host cache is
// credited on the host tier, not as device blocks; the shared cache
// counts for every worker.
func TestCandidatesCarryTheLowerTiers(t *testing.T) {
	r, _ := newRouter(t, 0, func(c *Config) { c.BlockSize = 16 })
	rng := rand.New(rand.NewPCG(3, 4))
	toks := randomTokens(rng, 16*8)
	for id := uint64(1); id <= 3; id++ {
		r.AddWorker(WorkerInfo{ID: id})
	}
	hashes := func(id uint64, n int) []uint64 {
		out := make([]uint64, n)
		for i := range out {
			out[i] = id<<32 | uint64(i+1)
		}
		return out
	}
	store := func(id uint64, tier kv.StorageTier, from, to int) {
		t.Helper()
		es := EngineStored{Worker: w(id), Tokens: toks[from*16 : to*16], BlockSize: 16, EngineHashes: hashes(id, to)[from:], Tier: tier}
		if from > 0 {
			es.Parent = kv.Ptr(hashes(id, from)[from-1])
		}
		if err := r.ApplyEngineStored(&es); err != nil {
			t.Fatal(err)
		}
	}
	// Worker 1: 8 blocks on the GPU, then the last 5 evicted to the host.
	store(1, kv.TierDevice, 0, 8)
	store(1, kv.TierHostPinned, 3, 8)
	ev := kv.RemovedEvent(w(1), 0, hashes(1, 8)[3:]...)
	if err := r.ApplyEvent(&ev); err != nil {
		t.Fatal(err)
	}
	// Worker 2: 2 blocks on the GPU and the next 2 on disk.
	store(2, kv.TierDevice, 0, 2)
	store(2, kv.TierDisk, 2, 4)
	// Worker 3 published 6 blocks to the shared cache.
	store(3, kv.TierExternal, 0, 6)
	got := candidatesFor(t, r, toks)
	want := map[uint64][4]int{1: {3, 8, 8, 3}, 2: {2, 2, 4, 4}, 3: {0, 0, 0, 6}}
	for id, wv := range want {
		c := got[w(id)]
		if g := [4]int{c.OverlapBlocks, c.HostBlocks, c.DiskBlocks, c.SharedBlocks}; g != wv {
			t.Errorf("worker %d: device, host, disk, shared = %v, want %v", id, g, wv)
		}
	}
}
