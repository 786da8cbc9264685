package router

import (
	"math/rand/v2"
	"testing"
)

// The table answers as a map does, for fleets of every size, ids that
// collide in their slots included.
func TestIDTableMatchesMap(t *testing.T) {
	for _, n := range []int{0, 1, 3, 64, 1000} {
		rng := rand.New(rand.NewPCG(uint64(n), 7))
		tab := newIDTable(n)
		want := map[uint64][2]int32{}
		for len(want) < n {
			id := rng.Uint64()
			if len(want)%5 == 0 && len(want) < 250 {
				id = uint64(rng.IntN(64)) << 58 // high bits only: neighbours in the table
			}
			if _, dup := want[id]; dup {
				continue
			}
			v, ranks := int32(len(want)), int32(1+rng.IntN(8))
			tab.put(id, v, ranks)
			want[id] = [2]int32{v, ranks}
		}
		for id, w := range want {
			if v, ranks, ok := tab.get(id); !ok || v != w[0] || ranks != w[1] {
				t.Fatalf("n=%d: get(%d) = %d, %d, %v; want %v", n, id, v, ranks, ok, w)
			}
		}
		for range 1000 {
			id := rng.Uint64()
			if _, in := want[id]; in {
				continue
			}
			if _, _, ok := tab.get(id); ok {
				t.Fatalf("n=%d: get(%d) found an id never put", n, id)
			}
		}
	}
}

// BenchmarkIDTableGet looks up every engine of a thousand-engine fleet in
// a random order, as a decision maps the overlaps it found to ranks.
func BenchmarkIDTableGet(b *testing.B) {
	const n = 1000
	rng := rand.New(rand.NewPCG(1, 2))
	tab := newIDTable(n)
	ids := make([]uint64, n)
	for i := range ids {
		ids[i] = rng.Uint64()
		tab.put(ids[i], int32(i), 1)
	}
	rng.Shuffle(n, func(i, j int) { ids[i], ids[j] = ids[j], ids[i] })
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		if _, _, ok := tab.get(ids[i%n]); !ok {
			b.Fatal("missing id")
		}
		i++
	}
}
