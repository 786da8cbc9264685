package router

import (
	"fmt"
	"testing"

	"github.com/kvrouter/kvrouter/core/kv"
)

// storeSalted feeds the router what an engine emits after caching toks for
// a request salted with salt: its blocks, hashed by the engine under the
// salt (distinct engine ids per salt), with the salt the event source read
// from the blocks' extra keys.
func storeSalted(t *testing.T, r *Router, w kv.Worker, size int, salt string, toks []uint32) {
	t.Helper()
	n := len(toks) / size
	es := EngineStored{Worker: w, Tokens: toks[:n*size], BlockSize: size, Salt: salt}
	for i := range n {
		es.EngineHashes = append(es.EngineHashes, w.ID<<48|uint64(len(salt))<<32|uint64(i+1))
	}
	if err := r.ApplyEngineStored(&es); err != nil {
		t.Fatal(err)
	}
}

// Two tenants whose requests carry different cache salts share no cache on
// the engine (vLLM keys the first block by the salt), so the router must
// credit neither with the other's blocks, whatever their tokens; the same
// salt, and no salt on both sides, are credited as before. Engines of the
// router's block size and of another one are both checked.
func TestCacheSaltIsolatesTenantsInTheIndex(t *testing.T) {
	for _, size := range []int{bs, 2 * bs} {
		t.Run(fmt.Sprint("engine block size ", size), func(t *testing.T) {
			r, _ := newRouter(t, 0, nil)
			r.AddWorker(WorkerInfo{ID: 1, BlockSize: size})
			prompt := tokens(3, 32, 3, 32)
			storeSalted(t, r, w(1), size, "tenant-a", prompt)
			for _, tc := range []struct {
				salt string
				want int
			}{{"tenant-a", 32}, {"tenant-b", 0}, {"", 0}} {
				d, err := r.BestWorker(ctx(), &Request{Tokens: prompt, CacheSalt: tc.salt})
				if err != nil {
					t.Fatal(err)
				}
				if d.OverlapBlocks != tc.want {
					t.Errorf("salt %q credited %d blocks of tenant-a's, want %d", tc.salt, d.OverlapBlocks, tc.want)
				}
			}
			r2, _ := newRouter(t, 0, nil)
			r2.AddWorker(WorkerInfo{ID: 1, BlockSize: size})
			storeSalted(t, r2, w(1), size, "", prompt)
			for _, tc := range []struct {
				salt string
				want int
			}{{"", 32}, {"tenant-a", 0}} {
				if l := r2.PotentialLoads(prompt, ""); tc.salt == "" && l[0].OverlapBlocks != tc.want {
					t.Errorf("unsalted potential load credits %d blocks, want %d", l[0].OverlapBlocks, tc.want)
				}
				d, err := r2.BestWorker(ctx(), &Request{Tokens: prompt, CacheSalt: tc.salt})
				if err != nil {
					t.Fatal(err)
				}
				if d.OverlapBlocks != tc.want {
					t.Errorf("salt %q credited %d unsalted blocks, want %d", tc.salt, d.OverlapBlocks, tc.want)
				}
			}
		})
	}
}

// A continuation of a salted prefix arrives as its own event whose blocks
// carry no salt of their own (the engine puts it in the request's first
// block only): with the salt its source inherited from the parent, the
// whole chain matches the salted request and nothing else.
func TestSaltedChainAcrossEventsMatchesOnlyItsSalt(t *testing.T) {
	r, _ := newRouter(t, 1, nil)
	prompt := tokens(4, 8, 4, 8)
	first := EngineStored{Worker: w(0), EngineHashes: []uint64{1, 2, 3, 4}, Tokens: prompt[:4*bs], BlockSize: bs, Salt: "s"}
	next := EngineStored{Worker: w(0), Parent: kv.Ptr(uint64(4)), EngineHashes: []uint64{5, 6, 7, 8}, Tokens: prompt[4*bs:], BlockSize: bs, Salt: "s"}
	for _, es := range []*EngineStored{&first, &next} {
		if err := r.ApplyEngineStored(es); err != nil {
			t.Fatal(err)
		}
	}
	for salt, want := range map[string]int{"s": 8, "": 0, "t": 0} {
		d, err := r.BestWorker(ctx(), &Request{Tokens: prompt, CacheSalt: salt})
		if err != nil {
			t.Fatal(err)
		}
		if d.OverlapBlocks != want {
			t.Errorf("salt %q: %d blocks credited, want %d", salt, d.OverlapBlocks, want)
		}
	}
}
