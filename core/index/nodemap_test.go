package index

import (
	"math/rand/v2"
	"testing"
)

// nodeMapHarness keeps nodes whose sequence hashes the map confirms
// against, and a plain map as the reference.
type nodeMapHarness struct {
	m     nodeMap
	nodes paged[node]
	ref   map[uint64]uint32
}

func newNodeMapHarness() *nodeMapHarness {
	h := &nodeMapHarness{ref: map[uint64]uint32{}}
	h.nodes.grow() // id 0 is never a node's
	return h
}

func (h *nodeMapHarness) put(t *testing.T, seq uint64) {
	t.Helper()
	id := h.nodes.grow()
	*h.nodes.at(id) = newNode(seq, 0, 0)
	if got, existed := h.m.getOrPut(seq, &h.nodes, id); existed || got != id {
		t.Fatalf("getOrPut(%#x) of a new hash = %d, %v", seq, got, existed)
	}
	if got, existed := h.m.getOrPut(seq, &h.nodes, id+1); !existed || got != id {
		t.Fatalf("getOrPut(%#x) again = %d, %v; want %d, true", seq, got, existed, id)
	}
	h.ref[seq] = id
}

func (h *nodeMapHarness) check(t *testing.T, probes []uint64) {
	t.Helper()
	for _, seq := range probes {
		got, ok := h.m.get(seq, &h.nodes)
		want, wok := h.ref[seq]
		if ok != wok || got != want {
			t.Fatalf("get(%#x) = %d, %v; want %d, %v", seq, got, ok, want, wok)
		}
	}
	if h.m.len() != len(h.ref) {
		t.Fatalf("len %d, want %d", h.m.len(), len(h.ref))
	}
}

// Two hashes with the same tag in the same part: each is told apart by
// its node, and removing one leaves the other.
func TestNodeMapTagCollision(t *testing.T) {
	const tag = uint64(0xdeadbeef) << 32
	var m nodeMap
	first := tag | 1
	var second uint64
	for lo := uint64(2); ; lo++ {
		if m.partOf(tag|lo) == m.partOf(first) {
			second = tag | lo
			break
		}
	}
	h := newNodeMapHarness()
	h.put(t, first)
	h.put(t, second)
	third := second + 1 // same tag, absent
	h.check(t, []uint64{first, second, third})
	h.m.remove(first, h.ref[first])
	delete(h.ref, first)
	h.check(t, []uint64{first, second, third})
	h.m.remove(second, h.ref[second])
	delete(h.ref, second)
	h.check(t, []uint64{first, second, third})
}

// Random puts and removes, with hashes drawn from few tags so that runs
// of equal tags are common, against a plain map; the tables grow and
// shrink along the way.
func TestNodeMapMatchesReference(t *testing.T) {
	for seed := range uint64(5) {
		rng := rand.New(rand.NewPCG(seed, 99))
		h := newNodeMapHarness()
		var live []uint64
		draw := func() uint64 { return uint64(rng.IntN(8))<<32 | uint64(rng.Uint32()) }
		for step := range 60000 {
			switch {
			case len(live) == 0 || rng.IntN(100) < 55 || (step > 30000 && step < 40000 && rng.IntN(3) > 0):
				seq := draw()
				if _, ok := h.ref[seq]; ok {
					continue
				}
				h.put(t, seq)
				live = append(live, seq)
			default:
				i := rng.IntN(len(live))
				seq := live[i]
				live[i] = live[len(live)-1]
				live = live[:len(live)-1]
				h.m.remove(seq, h.ref[seq])
				delete(h.ref, seq)
			}
			if step%997 == 0 {
				probes := []uint64{draw(), draw()}
				if len(live) > 0 {
					probes = append(probes, live[rng.IntN(len(live))])
				}
				h.check(t, probes)
			}
		}
		h.check(t, live)
		for _, seq := range live {
			h.m.remove(seq, h.ref[seq])
			delete(h.ref, seq)
		}
		h.check(t, live)
	}
}

func BenchmarkNodeMapGet(b *testing.B) {
	h := newNodeMapHarness()
	rng := rand.New(rand.NewPCG(1, 2))
	seqs := make([]uint64, 1<<20)
	for i := range seqs {
		seqs[i] = rng.Uint64()
		id := h.nodes.grow()
		*h.nodes.at(id) = newNode(seqs[i], 0, 0)
		h.m.getOrPut(seqs[i], &h.nodes, id)
	}
	i := 0
	for b.Loop() {
		h.m.get(seqs[i&(len(seqs)-1)], &h.nodes)
		i += 7919
	}
}

// A reservation sizes each part the first time it grows and keeps it from
// shrinking below that while removals empty it; lookups stay exact.
func TestNodeMapReserve(t *testing.T) {
	h := newNodeMapHarness()
	h.m.reserve(100 * len(h.m.parts))
	floor := h.m.floor
	if floor != 200 {
		t.Fatalf("floor %d, want 200 slots a part for 100 nodes", floor)
	}
	rng := rand.New(rand.NewPCG(7, 8))
	var live []uint64
	for range 20000 {
		seq := rng.Uint64()
		h.put(t, seq)
		live = append(live, seq)
	}
	h.check(t, live)
	for _, seq := range live {
		h.m.remove(seq, h.ref[seq])
		delete(h.ref, seq)
	}
	h.check(t, live)
	for i := range h.m.parts {
		if n := len(h.m.parts[i].slots); n != 0 && n < floor {
			t.Fatalf("part %d shrank to %d slots, below the reserved %d", i, n, floor)
		}
	}
}
