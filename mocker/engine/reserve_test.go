package engine

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"
	"unsafe"
)

// An engine told how many blocks to expect steps exactly as one that grows
// its tables from nothing, whether the hint is short of what it caches,
// right, or past its capacity.
func TestExpectedBlocksChangesNothing(t *testing.T) {
	for _, expected := range []int{8, 64, 1000} {
		cfg := Config{BlockSize: 4, NumGPUBlocks: 64, MaxNumSeqs: 8, MaxNumBatchedTokens: 64, EnablePrefixCaching: true, Seed: 3}
		hinted := cfg
		hinted.ExpectedBlocks = expected
		a, b := mustNew(t, cfg), mustNew(t, hinted)
		stored := 0
		stepTwins(t, a, b, uint64(expected), func(step int, ra, _ StepResult) {
			for _, ev := range ra.Events {
				if ev.Kind == Stored {
					stored += len(ev.BlockHashes)
				}
			}
			if step%53 == 0 && !sameBlocks(a.CachedBlocks(), b.CachedBlocks()) {
				t.Fatalf("expected %d, step %d: cached blocks differ", expected, step)
			}
		})
		if stored < 2*cfg.NumGPUBlocks {
			t.Fatalf("expected %d: only %d blocks stored, the cache never churned", expected, stored)
		}
	}
}

func sameBlocks(a, b []CachedBlock) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i].Hash != b[i].Hash || (a[i].Parent == nil) != (b[i].Parent == nil) || a[i].Parent != nil && *a[i].Parent != *b[i].Parent {
			return false
		}
	}
	return true
}

func TestNegativeExpectedBlocksIsInvalid(t *testing.T) {
	cfg := DefaultConfig()
	cfg.ExpectedBlocks = -1
	if _, err := New(cfg); !errors.Is(err, ErrInvalid) {
		t.Fatalf("New with %d expected blocks: %v, want ErrInvalid", cfg.ExpectedBlocks, err)
	}
}

// Tables reserved for the whole capacity never move: not the block array,
// not the map, and not the inactive queue however many stale entries
// revivals leave in it (lruRoom is its bound), through a churn that fills
// the cache and evicts it many times over.
func TestReservedTablesNeverMove(t *testing.T) {
	const bs, capacity = 4, 1024
	m := newBlockManager(bs, capacity, true, 1)
	m.noTokens = true
	m.reserve(capacity)
	blocks, slots, lru := unsafe.SliceData(m.blocks), unsafe.SliceData(m.byHash.slots), unsafe.SliceData(m.lru)
	rng := rand.New(rand.NewPCG(5, 6))
	var seqs []*seqBlocks
	stored := 0
	for range 20000 {
		var s *seqBlocks
		if len(seqs) > 0 && rng.IntN(4) != 0 {
			s = seqs[rng.IntN(len(seqs))] // revived: a stale queue entry
		} else {
			s = &seqBlocks{tokens: randTokens(rng, bs*(1+rng.IntN(40)), 1<<30)}
			seqs = append(seqs, s)
			stored += len(s.tokens) / bs
		}
		if !m.allocate(s, len(s.tokens)) {
			t.Fatal("allocation failed on an idle cache")
		}
		m.release(s)
		m.events = m.events[:0]
		if unsafe.SliceData(m.blocks) != blocks || unsafe.SliceData(m.byHash.slots) != slots || unsafe.SliceData(m.lru) != lru {
			t.Fatalf("after %d blocks stored: a reserved table moved (block array %v, map %v, queue %v)", stored,
				unsafe.SliceData(m.blocks) != blocks, unsafe.SliceData(m.byHash.slots) != slots, unsafe.SliceData(m.lru) != lru)
		}
	}
	if stored < 10*capacity {
		t.Fatalf("only %d blocks stored: the cache never churned", stored)
	}
}

// A reservation is capped at the capacity: a hint of a workload's every
// block does not size the tables of an engine that cannot hold them.
func TestReserveStopsAtCapacity(t *testing.T) {
	m := newBlockManager(16, 1000, true, 1)
	m.noTokens = true
	m.reserve(1 << 20)
	if cap(m.blocks) != 1000 || len(m.byHash.slots) != 2048 || cap(m.lru) != lruRoom(1000) {
		t.Fatalf("reserved %d blocks, %d map slots, a queue of %d; want 1000, 2048, %d", cap(m.blocks), len(m.byHash.slots), cap(m.lru), lruRoom(1000))
	}
}

// BenchmarkFill: a fresh block manager of 131,072 16-token blocks filled
// to capacity by prompts of 64 new blocks, as each engine of a simulated
// fleet fills at the start of a run: its tables grown from a few slots
// (expected=0) or reserved for the whole cache (Config.ExpectedBlocks).
func BenchmarkFill(b *testing.B) {
	const bs, capacity, prompt = 16, 131072, 64
	for _, expected := range []int{0, capacity} {
		b.Run(fmt.Sprintf("expected=%d", expected), func(b *testing.B) {
			rng := rand.New(rand.NewPCG(1, 2))
			tokens := make([]uint32, bs*prompt)
			hashes := make([]uint64, prompt)
			held := make([]int32, 0, prompt)
			b.ReportAllocs()
			for range b.N {
				m := newBlockManager(bs, capacity, true, 1)
				m.noTokens = true
				m.reserve(expected)
				for m.numInactive < capacity {
					for i := range hashes {
						hashes[i] = rng.Uint64()
					}
					s := &seqBlocks{tokens: tokens, hashes: hashes, blocks: held[:0]}
					if !m.allocate(s, len(tokens)) {
						b.Fatal("allocation failed on an idle cache")
					}
					m.release(s)
					m.events = m.events[:0]
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*capacity), "ns/block")
		})
	}
}

// An allocation takes the slots countPrefix found for its request only
// while no block was mapped or unmapped since: here another request's
// allocation in between evicts the counted blocks, and the request must
// then hold blocks of its own content, not the slots its count found.
func TestCountedPrefixGoesStale(t *testing.T) {
	const bs, capacity = 4, 16
	rng := rand.New(rand.NewPCG(9, 9))
	for _, evictBetween := range []bool{false, true} {
		m := newBlockManager(bs, capacity, true, 1)
		old := &seqBlocks{tokens: randTokens(rng, 8*bs, 1<<30)}
		if !m.allocate(old, len(old.tokens)) {
			t.Fatal("allocation failed")
		}
		m.release(old)
		s := &seqBlocks{tokens: append(old.tokens[:8*bs:8*bs], randTokens(rng, 4*bs, 1<<30)...)}
		if hits := m.countPrefix(s, len(s.tokens)/bs); hits != 8 {
			t.Fatalf("%d blocks counted, want 8", hits)
		}
		if evictBetween {
			other := &seqBlocks{tokens: randTokens(rng, capacity*bs, 1<<30)}
			if !m.allocate(other, len(other.tokens)) {
				t.Fatal("allocation failed")
			}
			m.release(other)
		}
		if !m.allocate(s, len(s.tokens)) {
			t.Fatal("allocation failed")
		}
		for i, idx := range s.blocks {
			if m.blocks[idx].hash != s.hashes[i] {
				t.Fatalf("evicted between: %v: block %d holds slot %d of another block", evictBetween, i, idx)
			}
		}
		if found := len(m.found) - countNew(m.found); evictBetween == (found != 0) {
			t.Fatalf("evicted between: %v: %d blocks found cached", evictBetween, found)
		}
	}
}

func countNew(found []int32) int {
	n := 0
	for _, idx := range found {
		if idx == noBlock {
			n++
		}
	}
	return n
}
