package engine

import (
	"math/rand/v2"
	"slices"
	"testing"
)

// expectedSlots is the slot each of s's blocks [have, full) takes when s
// allocates them, worked out from the manager's state before: a cached
// block keeps its slot; the new ones take the free slots first (the last
// freed first, then slots never used, in order), then each the slot of
// the block it evicts, the least recently released first, skipping the
// blocks s revives. That is what evicting each victim just before taking
// its slot gives.
func expectedSlots(m *blockManager, s *seqBlocks, have, full int) []int32 {
	m.ensureHashes(s, full)
	out := make([]int32, 0, full-have)
	revived := map[int32]bool{}
	newCnt := 0
	for i := have; i < full; i++ {
		idx, ok := m.byHash.get(s.hashes[i])
		if ok {
			revived[idx] = true
		} else {
			newCnt++
		}
		out = append(out, idx)
	}
	var victims []int32
	for pos := m.lruOff; pos < len(m.lru); pos++ {
		if idx := m.lru[pos]; m.blocks[idx].lruPos == int32(pos) && !revived[idx] {
			victims = append(victims, idx)
		}
	}
	free := m.free()
	if s.partial {
		free++
	}
	freeIdx := slices.Clone(m.freeIdx)
	next := int32(len(m.blocks))
	q := 0
	for i := range out {
		if out[i] != noBlock {
			continue
		}
		switch {
		case q < free && len(freeIdx) > 0:
			out[i], freeIdx = freeIdx[len(freeIdx)-1], freeIdx[:len(freeIdx)-1]
		case q < free:
			out[i], next = next, next+1
		case q-free < len(victims):
			out[i] = victims[q-free]
		default:
			return nil // the allocation does not fit
		}
		q++
	}
	return out
}

// TestNewBlocksTakeTheirVictimsSlots drives a small cache with random
// requests (shared prefixes, chunked growth, partial blocks, releases) and
// holds every allocation's slots to expectedSlots: the evictions run in
// one batch before the insertions, and the n-th new block must still take
// the n-th victim's slot, as HeldBlocks and the order of CachedBlocks
// show. Victims handed out last first, or the free slots taken after
// them, fail it.
func TestNewBlocksTakeTheirVictimsSlots(t *testing.T) {
	const bs, capacity = 4, 48
	rng := rand.New(rand.NewPCG(11, 12))
	m := newBlockManager(bs, capacity, true, 1)
	prefixes := make([][]uint32, 4)
	for i := range prefixes {
		prefixes[i] = randTokens(rng, bs*(1+rng.IntN(6)), 50)
	}
	type req struct {
		s    *seqBlocks
		upTo int
	}
	var live []*req
	allocate := func(r *req, upTo int) bool {
		have, full := len(r.s.blocks), upTo/bs
		want := expectedSlots(m, r.s, have, full)
		if !m.allocate(r.s, upTo) {
			return false
		}
		if got := r.s.blocks[have:full]; !slices.Equal(got, want) {
			t.Fatalf("blocks %d..%d took slots %v, want %v", have, full, got, want)
		}
		r.upTo = upTo
		m.events = m.events[:0]
		return true
	}
	evicting := 0
	for range 20000 {
		switch k := rng.IntN(10); {
		case k < 3 || len(live) == 0:
			pre := prefixes[rng.IntN(len(prefixes))]
			toks := slices.Clone(pre[:rng.IntN(len(pre)+1)])
			toks = append(toks, randTokens(rng, 1+rng.IntN(6*bs), 50)...)
			r := &req{s: &seqBlocks{tokens: toks}}
			if m.free() == 0 {
				evicting++
			}
			if allocate(r, 1+rng.IntN(len(toks))) {
				live = append(live, r)
			}
		case k < 8:
			r := live[rng.IntN(len(live))]
			if r.upTo == len(r.s.tokens) {
				r.s.tokens = append(r.s.tokens, randTokens(rng, 1+rng.IntN(3*bs), 50)...)
			}
			allocate(r, r.upTo+1+rng.IntN(len(r.s.tokens)-r.upTo))
		default:
			i := rng.IntN(len(live))
			m.release(live[i].s)
			live = slices.Delete(live, i, i+1)
		}
	}
	if evicting < 1000 {
		t.Fatalf("only %d allocations began on a full cache", evicting)
	}
}
