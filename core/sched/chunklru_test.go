package sched

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
)

// refLRU is the reference: a slice from the oldest hash to the newest.
type refLRU struct {
	capacity int
	order    []uint64
}

func (r *refLRU) add(h uint64) {
	if i := slices.Index(r.order, h); i >= 0 {
		r.order = slices.Delete(r.order, i, i+1)
	}
	r.order = append(r.order, h)
	if len(r.order) > r.capacity {
		r.order = r.order[len(r.order)-r.capacity:]
	}
}

func (r *refLRU) leadingRun(chunks []uint64) int {
	for i, h := range chunks {
		if !slices.Contains(r.order, h) {
			return i
		}
	}
	return len(chunks)
}

// Adds, refreshes and evictions keep the set the reference keeps, and its
// recency list threads every slot once, in the reference's order.
func TestChunkLRUAgainstReference(t *testing.T) {
	for _, capacity := range []int{0, 1, 2, 7, 50} {
		t.Run(fmt.Sprint("capacity=", capacity), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(uint64(capacity), 1))
			l, ref := newChunkLRU(capacity), &refLRU{capacity: capacity}
			for step := range 5000 {
				h := rng.Uint64N(uint64(3*capacity + 3))
				l.add(h)
				ref.add(h)
				var order []uint64
				for i := l.oldest; i >= 0; i = l.slots[i].newer {
					order = append(order, l.slots[i].h)
				}
				if !slices.Equal(order, ref.order) || len(l.at) != len(ref.order) {
					t.Fatalf("step %d: order %v (%d mapped), reference %v", step, order, len(l.at), ref.order)
				}
				q := []uint64{h, rng.Uint64N(uint64(3*capacity + 3)), rng.Uint64N(uint64(3*capacity + 3))}
				if got, want := l.leadingRun(q), ref.leadingRun(q); got != want {
					t.Fatalf("step %d: leading run of %v %d, reference %d", step, q, got, want)
				}
			}
		})
	}
}

// A full LRU takes new hashes in the slots of the ones it evicts.
func TestChunkLRUFullAddsWithoutAllocating(t *testing.T) {
	l := newChunkLRU(1000)
	for h := range uint64(1000) {
		l.add(h)
	}
	next := uint64(1000)
	if a := testing.AllocsPerRun(1000, func() {
		l.add(next)
		next++
	}); a != 0 {
		t.Fatalf("adding to a full LRU allocated %.2f times per hash, want 0", a)
	}
}

// BenchmarkChunkLRU is a server's LRU at the default capacity, kept full:
// each op adds a prompt's 200 chunks, half of them already held.
func BenchmarkChunkLRU(b *testing.B) {
	l := newChunkLRU(GIELRUCapacityPerServer)
	rng := rand.New(rand.NewPCG(1, 2))
	for range GIELRUCapacityPerServer {
		l.add(rng.Uint64())
	}
	chunks := make([]uint64, 200)
	for i := range chunks {
		chunks[i] = rng.Uint64()
	}
	b.ReportAllocs()
	for b.Loop() {
		for i := range chunks {
			if i%2 == 1 {
				chunks[i] = rng.Uint64()
			}
		}
		_ = l.leadingRun(chunks)
		for _, h := range chunks {
			l.add(h)
		}
	}
}
