package engine

import (
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"slices"
	"strings"
	"testing"
	"unsafe"
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

// TestReservedBlocksNeverMove: an engine of a capacity worth reserving
// keeps its block array in one place from the first block to the last
// (no copy on the way), and one below it grows as before.
func TestReservedBlocksNeverMove(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("room is reserved on Linux only")
	}
	const bs = 4
	capacity := 2 * hugeBytes / int(unsafe.Sizeof(block{}))
	m := newBlockManager(bs, capacity, true, 1)
	if !m.reserved || cap(m.blocks) != capacity || cap(m.lru) != lruRoom*capacity {
		t.Fatalf("reserved %v, room for %d blocks and %d queue entries; want %d and %d", m.reserved, cap(m.blocks), cap(m.lru), capacity, lruRoom*capacity)
	}
	first := unsafe.SliceData(m.blocks)
	next := uint32(1)
	for m.numInactive < capacity {
		churnOne(t, m, 512, &next)
	}
	if len(m.blocks) != capacity || unsafe.SliceData(m.blocks) != first {
		t.Fatalf("%d blocks; array moved: %v", len(m.blocks), unsafe.SliceData(m.blocks) != first)
	}
	small := newBlockManager(bs, hugeBytes/2/int(unsafe.Sizeof(block{})), true, 1)
	if small.reserved || small.blocks != nil || small.lru != nil {
		t.Fatal("an engine under a huge page of blocks reserved room")
	}
}

// TestReservedRoomIsReleased: the room goes back to the system once its
// owner is collected (many simulated fleets run in one process).
func TestReservedRoomIsReleased(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("room is reserved on Linux only")
	}
	owner := new(int)
	room := reserve[uint64](owner, hugeBytes)
	if room == nil {
		t.Fatal("no room reserved")
	}
	room = append(room, 7)
	addr := uintptr(unsafe.Pointer(unsafe.SliceData(room)))
	if !mapped(t, addr) {
		t.Fatalf("%#x not mapped", addr)
	}
	room = nil
	runtime.KeepAlive(owner)
	owner = nil
	for range 100 {
		runtime.GC()
		if !mapped(t, addr) {
			return
		}
		runtime.Gosched()
	}
	t.Fatalf("%#x still mapped after its owner was collected", addr)
}

// TestReservationsAreBounded: with maxReservations rooms alive, reserve
// gives none (the arrays grow on the heap), and a released room is counted
// off, so that a fleet of many engines cannot run the process out of
// mappings.
func TestReservationsAreBounded(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("room is reserved on Linux only")
	}
	defer func(n int64) { maxReservations = n }(maxReservations)
	maxReservations = 0
	if reserve[uint64](new(int), hugeBytes/8) != nil {
		t.Fatal("room reserved past the bound")
	}
	maxReservations = 1 << 30
	owner := new(int)
	room := reserve[uint64](owner, hugeBytes/8)
	if room == nil {
		t.Fatal("no room reserved under the bound")
	}
	addr := uintptr(unsafe.Pointer(unsafe.SliceData(room)))
	alive := reservations.Load()
	room, owner = nil, nil
	for range 100 {
		runtime.GC()
		// Other rooms may be released meanwhile, never taken: no
		// test here runs in parallel.
		if !mapped(t, addr) && reservations.Load() < alive {
			return
		}
		runtime.Gosched()
	}
	t.Fatalf("room released: %v; %d rooms counted, %d with it", !mapped(t, addr), reservations.Load(), alive)
}

// mapped reports whether addr lies in one of the process's mappings.
func mapped(t *testing.T, addr uintptr) bool {
	t.Helper()
	maps, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(maps), "\n") {
		var lo, hi uintptr
		if f := strings.Fields(line); len(f) > 0 {
			if _, err := fmt.Sscanf(f[0], "%x-%x", &lo, &hi); err == nil && lo <= addr && addr < hi {
				return true
			}
		}
	}
	return false
}
