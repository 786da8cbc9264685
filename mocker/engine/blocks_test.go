package engine

import (
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"testing"
	"unsafe"
)

// refManager is a deliberately naive block manager: a map of refcounts and
// an LRU slice, scanned linearly. The real manager must behave exactly like
// it, events included.
type refManager struct {
	bs, capacity int
	seed         uint64
	cached       map[uint64]int // engine id → refcount (0 = inactive)
	lru          []uint64       // inactive ids, evicted from the front
	partial      int
	events       []BlockEvent
}

type refSeq struct {
	tokens  []uint32
	held    []uint64
	partial bool
}

func (r *refManager) free() int { return r.capacity - len(r.cached) - r.partial }

func (r *refManager) chain(s *refSeq, n int) []uint64 {
	out := make([]uint64, n)
	var parent uint64
	for i := range n {
		parent = hashBlock(r.seed, parent, s.tokens[i*r.bs:(i+1)*r.bs])
		out[i] = parent
	}
	return out
}

func (r *refManager) countPrefix(s *refSeq, max int) int {
	h := r.chain(s, max)
	n := 0
	for n < max {
		if _, ok := r.cached[h[n]]; !ok {
			break
		}
		n++
	}
	return n
}

func (r *refManager) evict() uint64 {
	h := r.lru[0]
	r.lru = r.lru[1:]
	delete(r.cached, h)
	return h
}

func (r *refManager) allocate(s *refSeq, upTo int) bool {
	full, part := upTo/r.bs, upTo%r.bs != 0
	have := len(s.held)
	h := r.chain(s, full)
	newCnt, revive := 0, 0
	for i := have; i < full; i++ {
		ref, ok := r.cached[h[i]]
		if !ok {
			newCnt++
		} else if ref == 0 {
			revive++
		}
	}
	slots := newCnt
	if part && (full > have || !s.partial) {
		slots++
	}
	if s.partial && full > have {
		slots--
	}
	if slots+revive > r.free()+len(r.lru) {
		return false
	}
	if full == have {
		if part && !s.partial {
			var ev []uint64
			if r.free() == 0 {
				ev = append(ev, r.evict())
			}
			r.partial++
			s.partial = true
			if ev != nil {
				r.events = append(r.events, BlockEvent{Kind: Removed, BlockHashes: ev})
			}
		}
		return true
	}
	if s.partial {
		r.partial--
		s.partial = false
	}
	fresh := make([]bool, full-have)
	for i := have; i < full; i++ {
		ref, ok := r.cached[h[i]]
		if !ok {
			fresh[i-have] = true
			continue
		}
		if ref == 0 {
			r.lru = slices.DeleteFunc(r.lru, func(x uint64) bool { return x == h[i] })
		}
		r.cached[h[i]] = ref + 1
	}
	var ev []uint64
	for i := have; i < full; i++ {
		if !fresh[i-have] {
			continue
		}
		if r.free() == 0 {
			ev = append(ev, r.evict())
		}
		r.cached[h[i]] = 1
	}
	if part {
		if r.free() == 0 {
			ev = append(ev, r.evict())
		}
		r.partial++
		s.partial = true
	}
	s.held = append(s.held, h[have:full]...)
	if ev != nil {
		r.events = append(r.events, BlockEvent{Kind: Removed, BlockHashes: ev})
	}
	for i := have; i < full; {
		if !fresh[i-have] {
			i++
			continue
		}
		j := i
		for j < full && fresh[j-have] {
			j++
		}
		e := BlockEvent{Kind: Stored, BlockHashes: h[i:j], TokenIDs: s.tokens[i*r.bs : j*r.bs], First: int32(i)}
		if i > 0 {
			p := h[i-1]
			e.Parent = &p
		}
		r.events = append(r.events, e)
		i = j
	}
	return true
}

func (r *refManager) release(s *refSeq) {
	for i := len(s.held) - 1; i >= 0; i-- {
		r.cached[s.held[i]]--
		if r.cached[s.held[i]] == 0 {
			r.lru = append(r.lru, s.held[i])
		}
	}
	s.held = nil
	if s.partial {
		r.partial--
		s.partial = false
	}
}

// checkManager verifies the manager's internal consistency: LRU links,
// counts, the hash map, capacity, and (if holders is given) refcounts equal
// to the number of holders of each block.
func checkManager(t *testing.T, m *blockManager, holders []*seqBlocks) {
	t.Helper()
	inLRU := map[int32]bool{}
	for pos := m.lruOff; pos < len(m.lru); pos++ {
		idx := m.lru[pos]
		b := m.blocks[idx]
		if b.lruPos != int32(pos) {
			continue // a revived block's stale entry
		}
		if inLRU[idx] {
			t.Fatalf("block %d queued twice", idx)
		}
		inLRU[idx] = true
		if b.ref != 0 {
			t.Fatalf("block %d in the free LRU with refcount %d", idx, b.ref)
		}
		if got, ok := m.byHash.get(b.hash); !ok || got != idx {
			t.Fatalf("LRU block %d (hash %x) not in the cache map", idx, b.hash)
		}
	}
	for idx := range m.blocks {
		if b := m.blocks[idx]; b.lruPos != noBlock && !inLRU[int32(idx)] && (int(b.lruPos) >= len(m.lru) || m.lru[b.lruPos] != int32(idx)) {
			t.Fatalf("block %d names queue entry %d, which is not its own", idx, b.lruPos)
		}
	}
	if len(inLRU) != m.numInactive {
		t.Fatalf("LRU holds %d blocks, numInactive %d", len(inLRU), m.numInactive)
	}
	active := 0
	all := m.byHash.all()
	if len(all) != m.byHash.len() {
		t.Fatalf("cache map holds %d entries, counts %d", len(all), m.byHash.len())
	}
	for h, idx := range all {
		b := m.blocks[idx]
		if b.hash != h {
			t.Fatalf("block %d has hash %x, mapped from %x", idx, b.hash, h)
		}
		switch {
		case b.ref < 0:
			t.Fatalf("block %d refcount %d", idx, b.ref)
		case b.ref > 0:
			active++
			if inLRU[idx] {
				t.Fatalf("block %d both active and free", idx)
			}
		case !inLRU[idx]:
			t.Fatalf("inactive block %d missing from the LRU", idx)
		}
	}
	if active != m.numActive {
		t.Fatalf("%d active blocks, numActive %d", active, m.numActive)
	}
	for _, idx := range m.freeIdx {
		if b := m.blocks[idx]; b.ref != 0 || inLRU[idx] {
			t.Fatalf("free slot %d in use", idx)
		}
		if got, ok := m.byHash.get(m.blocks[idx].hash); ok && got == idx {
			t.Fatalf("free slot %d still in the cache map", idx)
		}
	}
	if m.free() < 0 {
		t.Fatalf("capacity exceeded: %d active + %d inactive + %d partial + %d anonymous > %d",
			m.numActive, m.numInactive, m.numPartial, m.numAnon, m.capacity)
	}
	if holders == nil {
		return
	}
	refs := map[int32]int32{}
	partial, anon := 0, 0
	for _, s := range holders {
		for i, idx := range s.blocks {
			refs[idx]++
			if m.blocks[idx].hash != s.hashes[i] {
				t.Fatalf("held block %d of a request has hash %x, want %x", i, m.blocks[idx].hash, s.hashes[i])
			}
		}
		if s.partial {
			partial++
		}
		anon += s.anon
	}
	for idx, n := range refs {
		if m.blocks[idx].ref != n {
			t.Fatalf("block %d refcount %d, held by %d requests", idx, m.blocks[idx].ref, n)
		}
	}
	for _, idx := range all {
		if m.blocks[idx].ref > 0 && refs[idx] == 0 {
			t.Fatalf("block %d refcount %d but no holder", idx, m.blocks[idx].ref)
		}
	}
	if partial != m.numPartial || anon != m.numAnon {
		t.Fatalf("holders have %d partial / %d anonymous blocks, manager counts %d / %d", partial, anon, m.numPartial, m.numAnon)
	}
}

// TestBlockManagerMatchesReference drives the manager and the reference
// model with the same long random streams of lookups, chunked allocations,
// decode-like growth and releases, and compares them after every operation.
func TestBlockManagerMatchesReference(t *testing.T) {
	testManagerMatchesReference(t)
}

// TestBlockManagerMatchesReferenceCompacting is the same with the LRU
// queue compacted at every chance, so that compaction keeps its order.
func TestBlockManagerMatchesReferenceCompacting(t *testing.T) {
	defer func(n int) { lruCompactMin = n }(lruCompactMin)
	lruCompactMin = 0
	testManagerMatchesReference(t)
}

func testManagerMatchesReference(t *testing.T) {
	for _, tc := range []struct {
		bs, capacity, ops int
	}{
		{4, 8, 20000},
		{4, 40, 20000},
		{16, 64, 10000},
		{16, 1000, 3000},
	} {
		t.Run(fmt.Sprintf("bs%d_cap%d", tc.bs, tc.capacity), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(uint64(tc.bs), uint64(tc.capacity)))
			m := newBlockManager(tc.bs, tc.capacity, true, 7)
			ref := &refManager{bs: tc.bs, capacity: tc.capacity, seed: 7, cached: map[uint64]int{}}
			prefixes := make([][]uint32, 4)
			for i := range prefixes {
				prefixes[i] = randTokens(rng, tc.bs*(1+rng.IntN(6)), 50)
			}
			type pair struct {
				s    *seqBlocks
				r    *refSeq
				upTo int
			}
			var live []*pair
			var nEvicted, nFailed, nHits, nStored, nShared int
			for op := 0; op < tc.ops; op++ {
				switch k := rng.IntN(10); {
				case k < 3 || len(live) == 0: // a new request
					pre := prefixes[rng.IntN(len(prefixes))]
					toks := slices.Clone(pre[:rng.IntN(len(pre)+1)])
					toks = append(toks, randTokens(rng, 1+rng.IntN(3*tc.bs), 50)...)
					p := &pair{s: &seqBlocks{tokens: slices.Clone(toks)}, r: &refSeq{tokens: slices.Clone(toks)}}
					max := (len(toks) - 1) / tc.bs
					hits, rhits := m.countPrefix(p.s, max), ref.countPrefix(p.r, max)
					if hits != rhits {
						t.Fatalf("op %d: prefix hit %d blocks, reference %d", op, hits, rhits)
					}
					nHits += hits
					p.upTo = hits*tc.bs + 1 + rng.IntN(len(toks)-hits*tc.bs)
					ok, rok := m.allocate(p.s, p.upTo), ref.allocate(p.r, p.upTo)
					if ok != rok {
						t.Fatalf("op %d: allocate %v, reference %v", op, ok, rok)
					}
					if ok {
						live = append(live, p)
					}
				case k < 8: // grow a request: prefill chunk or decode
					i := rng.IntN(len(live))
					p := live[i]
					if p.upTo == len(p.s.tokens) {
						tok := uint32(rng.IntN(50))
						p.s.tokens = append(p.s.tokens, tok)
						p.r.tokens = append(p.r.tokens, tok)
					}
					p.upTo += 1 + rng.IntN(len(p.s.tokens)-p.upTo)
					ok, rok := m.allocate(p.s, p.upTo), ref.allocate(p.r, p.upTo)
					if ok != rok {
						t.Fatalf("op %d: allocate %v, reference %v", op, ok, rok)
					}
					if !ok { // preempted
						nFailed++
						m.release(p.s)
						ref.release(p.r)
						live = slices.Delete(live, i, i+1)
					}
				default: // finish or abort
					i := rng.IntN(len(live))
					m.release(live[i].s)
					ref.release(live[i].r)
					live = slices.Delete(live, i, i+1)
				}
				if !reflect.DeepEqual(normEvents(m.events), normEvents(ref.events)) {
					t.Fatalf("op %d: events\n%v\nreference\n%v", op, m.events, ref.events)
				}
				for _, e := range m.events {
					if e.Kind == Removed {
						nEvicted += len(e.BlockHashes)
					} else {
						nStored += len(e.BlockHashes)
					}
				}
				m.events, ref.events = nil, nil
				m.byHash.each(func(_ uint64, idx int32) {
					if m.blocks[idx].ref > 1 {
						nShared++
					}
				})
				holders := make([]*seqBlocks, len(live))
				for i, p := range live {
					holders[i] = p.s
				}
				checkManager(t, m, holders)
				compareRef(t, op, m, ref)
			}
			t.Logf("stored %d, evicted %d, failed allocations %d, prefix hits %d, shared block-ops %d", nStored, nEvicted, nFailed, nHits, nShared)
			if nStored == 0 || nHits == 0 || nShared == 0 || (tc.capacity < 100 && (nEvicted == 0 || nFailed == 0)) {
				t.Fatal("the random stream does not exercise the manager")
			}
		})
	}
}

// all is the map's content as a Go map.
func (m *blockMap) all() map[uint64]int32 {
	out := map[uint64]int32{}
	m.each(func(k uint64, v int32) { out[k] = v })
	return out
}

func normEvents(evs []BlockEvent) []BlockEvent {
	if len(evs) == 0 {
		return nil
	}
	return evs
}

func compareRef(t *testing.T, op int, m *blockManager, ref *refManager) {
	t.Helper()
	if m.byHash.len() != len(ref.cached) {
		t.Fatalf("op %d: %d cached blocks, reference %d", op, m.byHash.len(), len(ref.cached))
	}
	for h, n := range ref.cached {
		idx, ok := m.byHash.get(h)
		if !ok || int(m.blocks[idx].ref) != n {
			t.Fatalf("op %d: block %x: present %v refcount %d, reference refcount %d", op, h, ok, m.blocks[idx].ref, n)
		}
	}
	var lru []uint64
	for pos := m.lruOff; pos < len(m.lru); pos++ {
		if idx := m.lru[pos]; m.blocks[idx].lruPos == int32(pos) {
			lru = append(lru, m.blocks[idx].hash)
		}
	}
	if !slices.Equal(lru, ref.lru) {
		t.Fatalf("op %d: LRU order differs from the reference", op)
	}
	if m.numPartial != ref.partial {
		t.Fatalf("op %d: %d partial blocks, reference %d", op, m.numPartial, ref.partial)
	}
}

func randTokens(rng *rand.Rand, n, vocab int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(rng.IntN(vocab))
	}
	return out
}

// TestEvictionOrder: released blocks are evicted least recently used first,
// a request's own blocks tail first, so shared prefixes outlive suffixes.
func TestEvictionOrder(t *testing.T) {
	m := newBlockManager(4, 6, true, 1)
	seqOf := func(base uint32, n int) *seqBlocks {
		toks := make([]uint32, n)
		for i := range toks {
			toks[i] = base + uint32(i)
		}
		return &seqBlocks{tokens: toks}
	}
	a := seqOf(100, 16) // 4 blocks
	if !m.allocate(a, 16) {
		t.Fatal("a does not fit")
	}
	aIDs := slices.Clone(a.hashes)
	m.release(a)
	m.events = nil

	b := seqOf(200, 12) // 3 blocks: 2 free slots, evicts a's tail block
	if !m.allocate(b, 12) {
		t.Fatal("b does not fit")
	}
	if want := []uint64{aIDs[3]}; !slices.Equal(removed(m.events), want) {
		t.Fatalf("b evicted %x, want a's last block %x", removed(m.events), want)
	}
	m.release(b)
	m.events = nil

	// a's head is reused (revived) by a request sharing its first block, so
	// the next evictions take a's remaining suffix, then b's, tail first.
	c := &seqBlocks{tokens: append(slices.Clone(a.tokens[:4]), 900, 901, 902, 903, 904)}
	if hits := m.countPrefix(c, 2); hits != 1 {
		t.Fatalf("c hits %d blocks, want 1", hits)
	}
	if !m.allocate(c, 9) { // a0 revived + 1 new full + 1 partial
		t.Fatal("c does not fit")
	}
	want := []uint64{aIDs[2], aIDs[1]}
	if got := removed(m.events); !slices.Equal(got, want) {
		t.Fatalf("c evicted %x, want %x (a's suffix, tail first)", got, want)
	}
	checkManager(t, m, []*seqBlocks{c})
}

func removed(evs []BlockEvent) []uint64 {
	var out []uint64
	for _, e := range evs {
		if e.Kind == Removed {
			out = append(out, e.BlockHashes...)
		}
	}
	return out
}

// TestBlockMap checks the open-addressing map against a Go map, with keys
// crowded into few home slots so that probe runs are long and wrap around
// the end of the table (backward-shift deletion), and keys that differ
// only above the bits a slot keeps (equal tags: the block decides).
func TestBlockMap(t *testing.T) {
	var blocks []block
	for hi := range uint64(4) {
		for mid := range uint64(3) {
			for home := range uint64(4) {
				blocks = append(blocks, block{hash: hi<<60 | mid<<32 | 13 + home}) // homes 13..16: runs wrap
			}
		}
	}
	m := newBlockMap(len(blocks), &blocks) // 16 slots: at most 8 keys keep it so
	if 64-m.idxBits > 60 {
		t.Fatalf("slots keep %d bits of an id: the keys' tags differ", 64-m.idxBits)
	}
	want := map[uint64]int32{}
	rng := rand.New(rand.NewPCG(5, 5))
	for op := 0; op < 200000; op++ {
		v := int32(rng.IntN(len(blocks)))
		key := blocks[v].hash
		switch _, ok := want[key]; {
		case rng.IntN(2) == 0 && len(want) < 8 && !ok:
			m.put(key, v)
			want[key] = v
		default:
			m.delete(key)
			delete(want, key)
		}
		if m.len() != len(want) {
			t.Fatalf("op %d: len %d, want %d", op, m.len(), len(want))
		}
		for _, b := range blocks {
			got, ok := m.get(b.hash)
			if w, in := want[b.hash]; ok != in || ok && got != w || !ok && got != noBlock {
				t.Fatalf("op %d: get(%x) = %d %v, want %d %v", op, b.hash, got, ok, w, in)
			}
		}
		if !reflect.DeepEqual(m.all(), want) {
			t.Fatalf("op %d: content differs", op)
		}
	}
	if len(m.slots) != minMapSlots {
		t.Fatalf("grew to %d slots with at most 8 keys", len(m.slots))
	}
	m.clear()
	if m.len() != 0 || len(m.all()) != 0 {
		t.Fatal("clear")
	}
}

// The table grows as keys come, keeping every entry and a load factor of
// at most 1/2.
func TestBlockMapGrows(t *testing.T) {
	blocks := make([]block, 10000)
	m := newBlockMap(len(blocks), &blocks)
	want := map[uint64]int32{}
	rng := rand.New(rand.NewPCG(6, 6))
	for i := range blocks {
		k := rng.Uint64() | 1
		blocks[i].hash = k
		m.put(k, int32(i))
		want[k] = int32(i)
		if 2*m.len() > len(m.slots) {
			t.Fatalf("%d keys in %d slots", m.len(), len(m.slots))
		}
	}
	if len(m.slots) != 32768 || !reflect.DeepEqual(m.all(), want) {
		t.Fatalf("%d slots, content equal: %v", len(m.slots), reflect.DeepEqual(m.all(), want))
	}
}

// TestLRUQueueStaysBoundedUnderChurn churns a full cache with requests of
// new blocks: every allocation evicts from the queue's front and every
// release appends, and the queue must reuse its evicted front rather than
// grow with the number of evictions.
func TestLRUQueueStaysBoundedUnderChurn(t *testing.T) {
	const capacity, bs, blocks = 64, 4, 8
	m := newBlockManager(bs, capacity, true, 1)
	next := uint32(1)
	for range 5000 {
		churnOne(t, m, blocks, &next)
	}
	if c := cap(m.lru); c > 8*capacity {
		t.Fatalf("LRU queue capacity %d after 5,000 requests on a cache of %d blocks; want at most %d", c, capacity, 8*capacity)
	}
	if m.numInactive != capacity {
		t.Fatalf("%d inactive blocks, want the full cache's %d", m.numInactive, capacity)
	}
}

// churnOne allocates and releases a request of n new blocks, its tokens
// counted on from *next, on a manager with nothing active.
func churnOne(t *testing.T, m *blockManager, n int, next *uint32) {
	t.Helper()
	s := &seqBlocks{tokens: make([]uint32, m.blockSize*n)}
	for i := range s.tokens {
		s.tokens[i], *next = *next, *next+1
	}
	if !m.allocate(s, len(s.tokens)) {
		t.Fatalf("a request of %d new blocks did not fit a cache of %d with nothing active", n, m.capacity)
	}
	m.release(s)
	m.events = m.events[:0]
}

// runToIdle steps e until it has nothing left to run.
func runToIdle(t *testing.T, e *Engine) {
	t.Helper()
	for range 1000 {
		if len(e.byID) == 0 {
			return
		}
		e.Step()
	}
	t.Fatal("requests still running after 1000 steps")
}

// A finished request's slot list goes to the next request, whose blocks
// it then lists, when its first blocks are allocated (a waiting request
// holds none); a request that finishes holding its blocks keeps its own.
func TestFinishedRequestsLeaveTheirSlotListsToTheNext(t *testing.T) {
	e := mustNew(t, Config{BlockSize: 4, NumGPUBlocks: 64, MaxNumSeqs: 4, MaxNumBatchedTokens: 64, EnablePrefixCaching: true})
	list := func(id string) *int32 {
		s := e.byID[id]
		if s == nil {
			s = e.held[id]
		}
		return unsafe.SliceData(s.blocks)
	}
	mustAdd(t, e, "a", seqTokens(0, 40), 2)
	if list("a") != nil {
		t.Fatal("a waiting request holds a slot list")
	}
	e.Step()
	first := list("a")
	runToIdle(t, e)
	if err := e.Add(Request{ID: "held", Tokens: seqTokens(100, 24), MaxTokens: 1, HoldBlocks: true}); err != nil {
		t.Fatal(err)
	}
	e.Step()
	if got := list("held"); got != first {
		t.Fatal("the next request got a fresh slot list, not the finished one's")
	}
	runToIdle(t, e)
	want := e.HeldBlocks("held")
	if len(want) != 6 {
		t.Fatalf("held %v, want 6 blocks", want)
	}
	// A later request must not take the held request's list.
	mustAdd(t, e, "b", seqTokens(200, 24), 3)
	e.Step()
	if list("b") == first {
		t.Fatal("a request took the slot list of a request still holding its blocks")
	}
	runToIdle(t, e)
	if got := e.HeldBlocks("held"); !slices.Equal(got, want) {
		t.Fatalf("held blocks %v after another request ran, want %v", got, want)
	}
}

// A Stored event's parent points into its request's ids rather than at a
// copy: it must still name the block before the event's first when the
// engine has gone on, requests have finished and others have taken their
// slot lists.
func TestStoredParentsOutliveTheirSteps(t *testing.T) {
	cfg := Config{BlockSize: 4, NumGPUBlocks: 64, MaxNumSeqs: 8, MaxNumBatchedTokens: 64, EnablePrefixCaching: true, Seed: 3}
	a, b := mustNew(t, cfg), mustNew(t, cfg)
	type kept struct {
		parent *uint64
		want   uint64
	}
	var evs []kept
	stepTwins(t, a, b, 5, func(_ int, ra, _ StepResult) {
		for _, ev := range ra.Events {
			if ev.Kind == Stored && ev.Parent != nil {
				evs = append(evs, kept{ev.Parent, *ev.Parent})
			}
		}
	})
	if len(evs) == 0 {
		t.Fatal("no Stored event with a parent")
	}
	for i, k := range evs {
		if *k.parent != k.want {
			t.Fatalf("event %d of %d: parent %x, was %x when published", i, len(evs), *k.parent, k.want)
		}
	}
}

// TestWarmVictimsReachesEveryVictim drains an LRU queue full of stale
// entries (revived blocks') one eviction at a time, as allocate does, and
// requires that every victim within warmAhead of the queue's front when
// warmVictims ran had its map slot asked for, once.
func TestWarmVictimsReachesEveryVictim(t *testing.T) {
	defer func(n int) { lruCompactMin = n }(lruCompactMin)
	lruCompactMin = 1 << 30 // positions stay put
	warmed := map[int]int{}
	victimWarmed = func(pos int) { warmed[pos]++ }
	defer func() { victimWarmed = nil }()

	const bs, capacity = 4, 4096
	rng := rand.New(rand.NewPCG(3, 4))
	m := newBlockManager(bs, capacity, true, 1)
	var seqs []*seqBlocks
	for range 200 {
		s := &seqBlocks{tokens: randTokens(rng, bs*(1+rng.IntN(12)), 1<<30)}
		if !m.allocate(s, len(s.tokens)) {
			t.Fatal("allocation failed with room to spare")
		}
		m.release(s)
		seqs = append(seqs, s)
	}
	for range 2000 { // revivals leave stale entries behind
		s := seqs[rng.IntN(len(seqs))]
		m.allocate(s, len(s.tokens))
		m.release(s)
	}
	warmed = map[int]int{}
	skipped, checked := 0, 0
	for {
		m.warmVictims()
		front := m.lruOff
		if m.lruPop() == noBlock {
			break
		}
		pos := m.lruOff - 1
		if pos > front {
			skipped++
		}
		if pos <= front+warmAhead {
			checked++
			if warmed[pos] != 1 {
				t.Fatalf("victim at queue position %d (front %d) warmed %d times, want once", pos, front, warmed[pos])
			}
		}
	}
	for pos, n := range warmed {
		if n != 1 {
			t.Fatalf("queue position %d warmed %d times", pos, n)
		}
	}
	if skipped < 100 || checked < 100 {
		t.Fatalf("%d evictions skipped stale entries, %d checked: the queue was not stale enough to test", skipped, checked)
	}
}

// BenchmarkConversationChurn: turns of 512 conversations on a full cache
// of 131,072 16-token blocks, each turn its conversation's whole history
// and 64 new blocks, allocated and released: the simulator's churn at
// 16-token blocks, where a third of a prompt's blocks are found (most of
// them revived, which leaves a stale queue entry) and every new block
// evicts one. Hashes are given, so that the figure is the block
// management's.
func BenchmarkConversationChurn(b *testing.B) {
	for _, engines := range []int{1, 8} {
		b.Run(fmt.Sprintf("engines=%d", engines), func(b *testing.B) { benchConversationChurn(b, engines) })
	}
}

// benchConversationChurn runs BenchmarkConversationChurn's turns on
// engines block managers, each turn on one picked at random: eight
// engines' tables, as the simulator's fleet has them, do not fit the
// caches that one engine's fits.
func benchConversationChurn(b *testing.B, engines int) {
	const bs, capacity, convs, turn, maxLen = 16, 131072, 512, 64, 1024
	rng := rand.New(rand.NewPCG(1, 2))
	ms := make([]*blockManager, engines)
	for i := range ms {
		ms[i] = newBlockManager(bs, capacity, true, 1)
		ms[i].noTokens = true
	}
	tokens := make([]uint32, bs*maxLen)
	hist := make([][][]uint64, engines)
	for i := range hist {
		hist[i] = make([][]uint64, convs)
	}
	held := make([]int32, 0, maxLen)
	var m *blockManager
	step := func(e int) int {
		m = ms[e]
		c := rng.IntN(convs)
		h := &hist[e][c]
		if len(*h)+turn > maxLen {
			*h = (*h)[:0]
		}
		for range turn {
			*h = append(*h, rng.Uint64())
		}
		n := len(*h)
		s := &seqBlocks{tokens: tokens[:n*bs], hashes: *h, blocks: held[:0]}
		if !m.allocate(s, n*bs) {
			b.Fatal("allocation failed on an idle cache")
		}
		m.release(s)
		m.events = m.events[:0]
		m.evicted = m.evicted[:0]
		return n
	}
	for e := range ms {
		for ms[e].numInactive < capacity {
			step(e)
		}
	}
	blocks, found := 0, 0
	b.ResetTimer()
	for range b.N {
		blocks += step(rng.IntN(engines))
		for _, idx := range m.found {
			if idx != noBlock {
				found++
			}
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(blocks), "ns/block")
	b.ReportMetric(float64(found)/float64(blocks), "found/block")
}
