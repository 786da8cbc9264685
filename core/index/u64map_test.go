package index

import (
	"math/rand/v2"
	"testing"
)

func TestU64MapAgainstBuiltinMap(t *testing.T) {
	for _, keyRange := range []uint64{8, 300, 1 << 62, 301} {
		rng := rand.New(rand.NewPCG(keyRange, 1))
		m := u64map{keep: keyRange == 301} // a table that never shrinks
		ref := map[uint64]uint32{}
		for step := range 60000 {
			k := rng.Uint64N(keyRange)
			if keyRange == 8 {
				k = k << 61 // collide in the low bits, differ in the high
			}
			switch rng.IntN(3) {
			case 0:
				v := uint32(step)
				m.Put(k, v)
				ref[k] = v
			case 1:
				v := uint32(step)
				old, had := m.Insert(k, v)
				if had != hasKey(ref, k) || old != ref[k] {
					t.Fatalf("Insert(%d) = %d,%v; want %d,%v", k, old, had, ref[k], hasKey(ref, k))
				}
				if !had {
					ref[k] = v
				}
			case 2:
				if step%2 == 0 {
					m.Delete(k)
				} else if v, ok := m.Take(k); v != ref[k] || ok != hasKey(ref, k) {
					t.Fatalf("Take(%d) = %d,%v; want %d", k, v, ok, ref[k])
				}
				delete(ref, k)
			}
			if step%997 == 0 {
				if m.Len() != len(ref) {
					t.Fatalf("len %d want %d", m.Len(), len(ref))
				}
				for rk, rv := range ref {
					if v, ok := m.Get(rk); !ok || v != rv {
						t.Fatalf("Get(%d) = %d,%v want %d", rk, v, ok, rv)
					}
				}
				seen := 0
				m.Range(func(k uint64, v uint32) bool {
					if ref[k] != v {
						t.Fatalf("Range gave %d=%d, want %d", k, v, ref[k])
					}
					seen++
					return true
				})
				if seen != len(ref) {
					t.Fatalf("Range saw %d of %d", seen, len(ref))
				}
			}
		}
		for k := range ref {
			m.Delete(k)
		}
		if m.Len() != 0 {
			t.Fatalf("%d entries left", m.Len())
		}
		if _, ok := m.Get(5); ok {
			t.Fatal("found a key in an empty map")
		}
	}
}

func BenchmarkU64MapGet(b *testing.B) {
	var m u64map
	keys := make([]uint64, 1<<20)
	rng := rand.New(rand.NewPCG(1, 1))
	for i := range keys {
		keys[i] = rng.Uint64()
		m.Put(keys[i], uint32(i))
	}
	i := 0
	for b.Loop() {
		m.Get(keys[i&(len(keys)-1)])
		i++
	}
}

func BenchmarkBuiltinMapGet(b *testing.B) {
	m := map[uint64]uint32{}
	keys := make([]uint64, 1<<20)
	rng := rand.New(rand.NewPCG(1, 1))
	for i := range keys {
		keys[i] = rng.Uint64()
		m[keys[i]] = uint32(i)
	}
	i := 0
	for b.Loop() {
		_ = m[keys[i&(len(keys)-1)]]
		i++
	}
}

// A reserved table takes its n entries without growing, and holds them at
// most seven tenths full: the load reserve is sized for (see reserve).
func TestU64MapReserve(t *testing.T) {
	for _, n := range []int{1, 100, 16384} {
		var m u64map
		m.reserve(n)
		size := len(m.slots)
		if size*7 < n*10 {
			t.Fatalf("reserve(%d): %d slots, more than seven tenths full when filled", n, size)
		}
		rng := rand.New(rand.NewPCG(uint64(n), 2))
		for i := range n {
			m.Put(rng.Uint64()|1, uint32(i))
		}
		if len(m.slots) != size || m.Len() != n {
			t.Fatalf("reserve(%d): %d slots after filling (reserved %d), %d entries", n, len(m.slots), size, m.Len())
		}
	}
}

func hasKey(m map[uint64]uint32, k uint64) bool {
	_, ok := m[k]
	return ok
}
