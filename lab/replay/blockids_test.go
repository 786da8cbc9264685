package replay

import (
	"math/rand/v2"
	"slices"
	"testing"
)

// BlockIDs against a Go map numbering keys in first-seen order, over key
// sets narrow (many repeats, 0 among them) and wide, through growth.
func TestBlockIDsMatchesMap(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, span := range []uint64{1, 7, 1000, 1 << 62} {
		b, want := NewBlockIDs(int(rng.IntN(40))), map[uint64]int32{}
		for range 20000 {
			k := rng.Uint64N(span) * 0x9e3779b97f4a7c15 // spread, with 0 kept
			id, ok := want[k]
			if !ok {
				id = int32(len(want))
				want[k] = id
			}
			if got := b.ID(k); got != id {
				t.Fatalf("span %d: ID(%#x) = %d, want %d", span, k, got, id)
			}
		}
		if int(b.Len()) != len(want) {
			t.Fatalf("span %d: Len %d, want %d", span, b.Len(), len(want))
		}
	}
}

// naiveCeiling is the reference model: a set of hashes for the infinite
// cache, a recency-ordered slice (most recent first) for the pooled one.
type naiveCeiling struct {
	bs, capacity int // capacity < 0: infinite
	seen         map[uint64]bool
	order        []uint64
	hits, total  int
}

func (n *naiveCeiling) cached(h uint64) bool {
	if n.capacity < 0 {
		return n.seen[h]
	}
	return slices.Contains(n.order, h)
}

func (n *naiveCeiling) add(seq []uint64, toks int) {
	hit := 0
	for hit < len(seq) && n.cached(seq[hit]) {
		hit++
	}
	n.hits += min(hit*n.bs, (toks-1)/n.bs*n.bs)
	n.total += toks
	if n.capacity < 0 {
		for _, h := range seq {
			n.seen[h] = true
		}
		return
	}
	for i := len(seq) - 1; i >= 0; i-- {
		if n.capacity == 0 {
			return
		}
		if j := slices.Index(n.order, seq[i]); j >= 0 {
			n.order = slices.Delete(n.order, j, j+1)
		} else if len(n.order) == n.capacity {
			n.order = n.order[:len(n.order)-1]
		}
		n.order = slices.Insert(n.order, 0, seq[i])
	}
}

// The ceilings, by hashes and by shared block numbers, against the
// reference model on random prompts: prefixes drawn from a few shared
// stems, so that hits, evictions of tails and re-touches all happen.
func TestCeilingsMatchNaiveModel(t *testing.T) {
	const bs = 4
	for _, capacity := range []int{-1, 0, 1, 3, 17, 200} {
		rng := rand.New(rand.NewPCG(uint64(capacity+5), 9))
		newCeiling := func() *Ceiling {
			if capacity < 0 {
				return NewCeiling(bs)
			}
			return NewPooledCeiling(bs, capacity)
		}
		byHash, byID := newCeiling(), newCeiling()
		numbers := NewBlockIDs(0)
		ref := &naiveCeiling{bs: bs, capacity: capacity, seen: map[uint64]bool{}}
		var ids []int32
		for range 3000 {
			// A stem of up to 6 blocks out of 5, then private blocks.
			stem, seq := uint64(rng.IntN(5)), []uint64{}
			for j := range rng.IntN(7) {
				seq = append(seq, stem<<32|uint64(j))
			}
			for range rng.IntN(4) {
				seq = append(seq, rng.Uint64N(50)<<40|1<<63)
			}
			toks := len(seq)*bs + rng.IntN(bs)
			if toks == 0 {
				toks = 1
			}
			ref.add(seq, toks)
			byHash.AddHashes(seq, toks)
			ids = numbers.AppendIDs(ids[:0], seq)
			byID.AddBlocks(ids, toks)
			for _, c := range []*Ceiling{byHash, byID} {
				if h, tot := c.Tokens(); h != ref.hits || tot != ref.total {
					t.Fatalf("capacity %d: %d of %d tokens hit, want %d of %d", capacity, h, tot, ref.hits, ref.total)
				}
			}
		}
		if ref.hits == 0 && capacity != 0 {
			t.Fatalf("capacity %d: no hits: the test exercises nothing", capacity)
		}
	}
}
