package index

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/kv"
)

// fleet fills an index as a KV-routed fleet looks: every worker holds a
// shared system prompt, then private conversations branching off it.
func fleet(ix *Index, workers, convs, convBlocks, sysBlocks int, rng *rand.Rand) [][]uint64 {
	return offloadedFleet(ix, workers, convs, convBlocks, sysBlocks, 0, rng)
}

// offloadedFleet is fleet with the last offload blocks of every
// conversation moved from the device to the host tier, as an offloading
// engine publishes it: stored on the host, then removed from the GPU.
func offloadedFleet(ix *Index, workers, convs, convBlocks, sysBlocks, offload int, rng *rand.Rand) [][]uint64 {
	var queries [][]uint64
	id := uint64(1)
	for w := range workers {
		wk := kv.Worker{ID: uint64(w)}
		for c := range convs {
			local := make([]uint64, sysBlocks+convBlocks)
			for i := range local {
				if i < sysBlocks {
					local[i] = uint64(i) + 1
				} else {
					local[i] = rng.Uint64()
				}
			}
			blocks := make([]kv.Block, len(local))
			for i := range blocks {
				blocks[i] = kv.Block{EngineHash: id, LocalHash: local[i]}
				id++
			}
			if c > 0 {
				// Hang the conversation below the worker's system prompt.
				blocks = blocks[sysBlocks:]
				ev := kv.StoredEvent(wk, 0, kv.Ptr(uint64(w)<<40|uint64(sysBlocks)), blocks...)
				_ = ix.Apply(&ev)
			} else {
				for i := range sysBlocks {
					blocks[i].EngineHash = uint64(w)<<40 | uint64(i+1)
				}
				ev := kv.StoredEvent(wk, 0, nil, blocks...)
				_ = ix.Apply(&ev)
			}
			if offload > 0 {
				tail := blocks[len(blocks)-offload:]
				st := kv.StoredEvent(wk, 0, kv.Ptr(tail[0].EngineHash-1), tail...)
				st.Tier = kv.TierHostPinned
				_ = ix.Apply(&st)
				// Leaves first, as engines evict: the device tier stays
				// prefix-closed.
				rm := kv.RemovedEvent(wk, 0)
				for _, b := range slices.Backward(tail) {
					rm.Removed.EngineHashes = append(rm.Removed.EngineHashes, b.EngineHash)
				}
				_ = ix.Apply(&rm)
			}
			queries = append(queries, blockhash.SequenceHashes(local))
		}
	}
	return queries
}

func BenchmarkFindMatches(b *testing.B) {
	for _, tc := range []struct{ workers, shards int }{{64, 1}, {64, 4}, {1000, 4}} {
		workers := tc.workers
		b.Run(fmt.Sprintf("workers=%d/shards=%d/blocks=512", workers, tc.shards), func(b *testing.B) {
			ix := New(Config{Shards: tc.shards})
			qs := fleet(ix, workers, 4, 512-64, 64, rand.New(rand.NewPCG(1, 2)))
			var m Matcher
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				ix.FindMatches(&m, qs[i%len(qs)])
				i++
			}
		})
	}
}

// BenchmarkFindMatchesTiered is BenchmarkFindMatches on an index whose
// workers offloaded the last quarter of every conversation to the host:
// the lookups continue on the host tier.
func BenchmarkFindMatchesTiered(b *testing.B) {
	for _, tc := range []struct{ workers, shards int }{{64, 4}, {1000, 4}} {
		b.Run(fmt.Sprintf("workers=%d/shards=%d/blocks=512", tc.workers, tc.shards), func(b *testing.B) {
			ix := New(Config{Shards: tc.shards})
			qs := offloadedFleet(ix, tc.workers, 4, 512-64, 64, 112, rand.New(rand.NewPCG(1, 2)))
			var m Matcher
			ix.FindMatches(&m, qs[0])
			if i := slices.IndexFunc(m.Tiers(), func(o TierOverlap) bool { return o.Worker == kv.Worker{} }); i < 0 || m.Tiers()[i].Device != 512-112 || m.Tiers()[i].Host != 512 {
				b.Fatalf("tiers %v: want the host tier to continue the match", m.Tiers())
			}
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				ix.FindMatches(&m, qs[i%len(qs)])
				i++
			}
		})
	}
}

func BenchmarkApplyStoredRemoved(b *testing.B) {
	ix := New(Config{})
	w := kv.Worker{ID: 1}
	blocks := make([]kv.Block, 32)
	hashes := make([]uint64, 32)
	b.ReportAllocs()
	i := uint64(0)
	for b.Loop() {
		for j := range blocks {
			blocks[j] = kv.Block{EngineHash: i<<8 | uint64(j), LocalHash: i*31 + uint64(j)}
			hashes[j] = blocks[j].EngineHash
		}
		st := kv.StoredEvent(w, i, nil, blocks...)
		_ = ix.Apply(&st)
		if i >= 64 {
			for j := range hashes {
				hashes[j] = (i-64)<<8 | uint64(j)
			}
			rm := kv.RemovedEvent(w, i, hashes...)
			_ = ix.Apply(&rm)
		}
		i++
	}
	b.ReportMetric(float64(b.N*64)/b.Elapsed().Seconds(), "blockops/s")
}

// BenchmarkBytesPerPair reports the heap the index holds per (block,
// worker) pair on a fleet-shaped index.
func BenchmarkBytesPerPair(b *testing.B) {
	for b.Loop() {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		ix := New(Config{})
		fleet(ix, 256, 8, 400, 32, rand.New(rand.NewPCG(3, 4)))
		runtime.GC()
		runtime.ReadMemStats(&after)
		b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/float64(ix.Pairs()), "bytes/pair")
		runtime.KeepAlive(ix)
	}
}

// BenchmarkApproxInsert records 32-block decisions, conversations sharing
// a system prompt, spread over 16 workers on the real clock: the work of
// approximate mode and of the predicted index on every booking.
func BenchmarkApproxInsert(b *testing.B) {
	a := NewApprox(ApproxConfig{})
	rng := rand.New(rand.NewPCG(1, 2))
	prompts := make([][2][]uint64, 256)
	for p := range prompts {
		local := make([]uint64, 32)
		for i := range local {
			local[i] = uint64(i) + 1
			if i >= 8 {
				local[i] = rng.Uint64()
			}
		}
		prompts[p] = [2][]uint64{local, blockhash.SequenceHashes(local)}
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		p := prompts[i%len(prompts)]
		a.Insert(kv.Worker{ID: uint64(i % 16)}, p[0], p[1])
	}
}

// BenchmarkApplyChurn measures the write path on an index far larger than
// the CPU's caches, where each block costs memory latency rather than
// instructions: 256 workers at 8,192 blocks each (2 M pairs), every
// operation storing a 64-block chain below the shared system prompt on one
// worker and evicting that worker's oldest 64 blocks, as a full engine does.
func BenchmarkApplyChurn(b *testing.B) { applyChurn(b, New(Config{}), 256, 8192, false, false) }

// BenchmarkApplyChurnBounded is BenchmarkApplyChurn with every worker's
// capacity announced, so that each chunk stored is checked against the
// worker's bound (RankBound).
func BenchmarkApplyChurnBounded(b *testing.B) { applyChurn(b, New(Config{}), 256, 8192, true, false) }

// BenchmarkSingleApplyChurn is the churn on the simulator's one-goroutine
// index at the simulator's size: 8 engines of 131,072 blocks (1 M pairs),
// each announced, whose engines name blocks by ids of their own (opaque)
// or by their sequence hashes, as the simulator's do (seqids); and the
// same pairs over 16 engines (seqids-16), past the ranks whose sets fit
// the 8-byte table.
func BenchmarkSingleApplyChurn(b *testing.B) {
	b.Run("opaque", func(b *testing.B) { applyChurn(b, NewSingle(), 8, 131072, true, false) })
	b.Run("seqids", func(b *testing.B) { applyChurn(b, NewSingle(), 8, 131072, true, true) })
	b.Run("seqids-16", func(b *testing.B) { applyChurn(b, NewSingle(), 16, 65536, true, true) })
}

type churnIndex interface {
	Apply(*kv.Event) error
	Reserve(kv.Worker, int)
}

func applyChurn(b *testing.B, ix churnIndex, workers, capacity int, bounded, seqIDs bool) {
	const (
		chain = 64
		sys   = 8
	)
	rng := rand.New(rand.NewPCG(5, 6))
	type fifo struct {
		hashes []uint64
		next   uint64
	}
	fifos := make([]fifo, workers)
	blocks := make([]kv.Block, chain)
	// sysID is the id of a worker's last system prompt block.
	sysID := func(w int) uint64 { return uint64(w)<<40 | sys }
	if seqIDs {
		seq := blockhash.SequenceHashes([]uint64{1, 2, 3, 4, 5, 6, 7, 8})
		sysID = func(int) uint64 { return seq[sys-1] }
	}
	store := func(w int) {
		f := &fifos[w]
		wk := kv.Worker{ID: uint64(w)}
		parent := sysID(w)
		for i := range blocks {
			f.next++
			blocks[i] = kv.Block{EngineHash: uint64(w)<<40 | f.next, LocalHash: rng.Uint64()}
			if seqIDs {
				parent = blockhash.Chain(parent, blocks[i].LocalHash)
				blocks[i].EngineHash = parent
			}
			f.hashes = append(f.hashes, blocks[i].EngineHash)
		}
		ev := kv.StoredEvent(wk, 0, kv.Ptr(sysID(w)), blocks...)
		if err := ix.Apply(&ev); err != nil {
			b.Fatal(err)
		}
	}
	for w := range workers {
		if bounded {
			ix.Reserve(kv.Worker{ID: uint64(w)}, capacity)
		}
		sysBlocks := make([]kv.Block, sys)
		for i := range sysBlocks {
			sysBlocks[i] = kv.Block{EngineHash: uint64(w)<<40 | uint64(i+1), LocalHash: uint64(i) + 1}
			if seqIDs {
				sysBlocks[i].EngineHash = blockhash.SequenceHashes([]uint64{1, 2, 3, 4, 5, 6, 7, 8})[i]
			}
		}
		fifos[w].next = sys
		ev := kv.StoredEvent(kv.Worker{ID: uint64(w)}, 0, nil, sysBlocks...)
		_ = ix.Apply(&ev)
		for len(fifos[w].hashes) < capacity-sys-chain {
			store(w)
		}
	}
	b.ResetTimer()
	for i := 0; b.Loop(); i++ {
		w := int(rng.Uint64() % uint64(workers))
		store(w)
		f := &fifos[w]
		rm := kv.RemovedEvent(kv.Worker{ID: uint64(w)}, 0, f.hashes[:chain]...)
		if err := ix.Apply(&rm); err != nil {
			b.Fatal(err)
		}
		f.hashes = f.hashes[chain:]
	}
	b.ReportMetric(float64(b.N*2*chain)/b.Elapsed().Seconds(), "blockops/s")
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*2*chain), "ns/blockop")
}

// BenchmarkFindMatchesDuringChurn is BenchmarkFindMatches while one
// goroutine per shard stores and removes 64-block chains below random
// workers' system prompts as fast as it can: what a lookup pays for the
// writers it meets. It reports the lookups' p99 and the share of shard
// reads that waited for a writer.
func BenchmarkFindMatchesDuringChurn(b *testing.B) {
	for _, workers := range []int{64, 1000} {
		b.Run(fmt.Sprintf("workers=%d/shards=4/blocks=512", workers), func(b *testing.B) {
			const shards, chain, sys = 4, 64, 64
			ix := New(Config{Shards: shards})
			qs := fleet(ix, workers, 4, 512-sys, sys, rand.New(rand.NewPCG(1, 2)))
			var stop atomic.Bool
			var wg sync.WaitGroup
			for g := range shards {
				wg.Add(1)
				go func() {
					defer wg.Done()
					rng := rand.New(rand.NewPCG(7, uint64(g)))
					blocks := make([]kv.Block, chain)
					hashes := make([]uint64, chain)
					for n := uint64(1); !stop.Load(); n++ {
						w := kv.Worker{ID: uint64(rng.IntN(workers))}
						if ix.ShardOf(w) != g {
							continue
						}
						for i := range blocks {
							hashes[i] = 1<<62 | uint64(g)<<56 | n<<8 | uint64(i)
							blocks[i] = kv.Block{EngineHash: hashes[i], LocalHash: rng.Uint64()}
						}
						st := kv.StoredEvent(w, 0, kv.Ptr(w.ID<<40|sys), blocks...)
						_ = ix.Apply(&st)
						slices.Reverse(hashes)
						rm := kv.RemovedEvent(w, 0, hashes...)
						_ = ix.Apply(&rm)
					}
				}()
			}
			var m Matcher
			lat := make([]time.Duration, 0, 1<<16)
			before := ix.Stats().LookupWaits
			i := 0
			for b.Loop() {
				t0 := time.Now()
				ix.FindMatches(&m, qs[i%len(qs)])
				if len(lat) < cap(lat) {
					lat = append(lat, time.Since(t0))
				}
				i++
			}
			stop.Store(true)
			wg.Wait()
			slices.Sort(lat)
			b.ReportMetric(float64(lat[len(lat)*99/100].Nanoseconds())/1e3, "p99-µs")
			b.ReportMetric(float64(ix.Stats().LookupWaits-before)/float64(i*shards), "waits/shard-read")
		})
	}
}
