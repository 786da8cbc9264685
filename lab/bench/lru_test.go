package bench

import (
	"math/rand/v2"
	"slices"
	"testing"
	"unsafe"
)

// model is the obvious engine cache: a recency list of keys, most recent
// first, and each key's engine id.
type model struct {
	cap    int
	order  []uint64
	engine map[uint64]uint64
}

// serve returns the hit count, the new keys and the engine ids evicted,
// tail (least recent) first.
func (m *model) serve(keys []uint64) (hit int, newKeys, evicted []uint64) {
	n := min(len(keys), m.cap)
	for hit < n {
		if _, ok := m.engine[keys[hit]]; !ok {
			break
		}
		hit++
	}
	prefix := keys[:hit]
	rest := slices.DeleteFunc(slices.Clone(m.order), func(k uint64) bool { return slices.Contains(prefix, k) })
	for need := len(m.order) + (n - hit) - m.cap; need > 0; need-- {
		k := rest[len(rest)-1]
		rest = rest[:len(rest)-1]
		evicted = append(evicted, m.engine[k])
		delete(m.engine, k)
	}
	newKeys = keys[hit:n]
	m.order = slices.Concat(prefix, newKeys, rest)
	return hit, newKeys, evicted
}

// cacheOrder walks the recency list head to tail.
func cacheOrder(c *engineCache) []uint64 {
	var out []uint64
	for e := c.ent[0].next; e != 0; e = c.ent[e].next {
		out = append(out, c.ent[e].key())
	}
	return out
}

// chain makes the keys of a request: a path in a small random prefix tree,
// so requests share prefixes the way conversations do.
func chain(rng *rand.Rand, maxLen int) []uint64 {
	n := 1 + rng.IntN(maxLen)
	keys := make([]uint64, n)
	k := uint64(1)
	for i := range keys {
		// Few choices near the root, many deeper: lots of shared prefixes.
		k = mix64(k*31 + uint64(rng.IntN(1+i)) + 1)
		keys[i] = k
	}
	return keys
}

func TestEngineCacheAgainstModel(t *testing.T) {
	for _, tc := range []struct {
		name          string
		capacity, max int
	}{
		{"tiny", 4, 6},
		{"small", 16, 10},
		{"request longer than cache", 8, 20},
		{"large", 512, 64},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rng := rand.New(rand.NewPCG(7, uint64(tc.capacity)))
			c := newEngineCache(tc.capacity, 99)
			m := &model{cap: tc.capacity, engine: map[uint64]uint64{}}
			var sc serveScratch
			seen := map[uint64]bool{}
			for step := range 3000 {
				keys := chain(rng, tc.max)
				wantHit, wantNew, wantEvicted := m.serve(keys)
				hit, parent, hasParent := c.serve(keys, keys, &sc)
				if hit != wantHit {
					t.Fatalf("step %d: hit %d, want %d", step, hit, wantHit)
				}
				if hasParent != (hit > 0) {
					t.Fatalf("step %d: hasParent %v with hit %d", step, hasParent, hit)
				}
				if hit > 0 && parent != m.engine[keys[hit-1]] {
					t.Fatalf("step %d: parent %x, want engine id of block %d", step, parent, hit-1)
				}
				if len(sc.blocks) != len(wantNew) {
					t.Fatalf("step %d: %d new blocks, want %d", step, len(sc.blocks), len(wantNew))
				}
				for i, b := range sc.blocks {
					if b.LocalHash != wantNew[i] {
						t.Fatalf("step %d: new block %d has local %x, want %x", step, i, b.LocalHash, wantNew[i])
					}
					if seen[b.EngineHash] || b.EngineHash == 0 || b.EngineHash == b.LocalHash {
						t.Fatalf("step %d: engine id %x is not fresh", step, b.EngineHash)
					}
					seen[b.EngineHash] = true
					m.engine[b.LocalHash] = b.EngineHash
				}
				// Evictions name the evicted blocks' engine ids, least recent first.
				if !slices.Equal(sc.removed, wantEvicted) {
					t.Fatalf("step %d: evicted %x, want %x", step, sc.removed, wantEvicted)
				}
				if got := cacheOrder(c); !slices.Equal(got, m.order) {
					t.Fatalf("step %d: recency order\n got %v\nwant %v", step, got, m.order)
				}
				if c.size != len(m.order) || c.size > tc.capacity {
					t.Fatalf("step %d: size %d, model %d, cap %d", step, c.size, len(m.order), tc.capacity)
				}
			}
		})
	}
}

func TestEngineCachePrefixClosed(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	c := newEngineCache(64, 5)
	var sc serveScratch
	parentOf := map[uint64]uint64{}
	for range 5000 {
		keys := chain(rng, 24)
		for i := 1; i < len(keys); i++ {
			parentOf[keys[i]] = keys[i-1]
		}
		c.serve(keys, keys, &sc)
		for _, k := range cacheOrder(c) {
			if p, ok := parentOf[k]; ok && c.lookup(p) == 0 {
				t.Fatalf("block %x cached without its parent %x", k, p)
			}
		}
	}
}

func TestEngineCacheTableDeletion(t *testing.T) {
	// Keys that share their home slot exercise backward-shift deletion.
	c := newEngineCache(8, 1)
	var sc serveScratch
	for r := range 200 {
		keys := []uint64{uint64(r%5+1)<<32 | uint64(r) + 1<<60}
		c.serve(keys, keys, &sc)
		for _, k := range cacheOrder(c) {
			if c.lookup(k) == 0 {
				t.Fatalf("round %d: key %x lost from the table", r, k)
			}
		}
		n := 0
		for _, s := range c.table {
			if s != 0 {
				n++
			}
		}
		if n != c.size {
			t.Fatalf("round %d: %d table slots for %d entries", r, n, c.size)
		}
	}
}

// An entry is 20 bytes: the caches of 10,000 simulated engines are most of
// bench index's memory at that scale.
func TestEngineCacheEntrySize(t *testing.T) {
	if size := unsafe.Sizeof(entry{}); size != 20 {
		t.Fatalf("entry is %d bytes", size)
	}
}
