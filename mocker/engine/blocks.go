package engine

import (
	"cmp"
	"iter"
	"slices"
	"unsafe"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/buffers"
	"github.com/kvrouter/kvrouter/core/hugepage"
	"github.com/kvrouter/kvrouter/core/prefetch"
)

// The KV block manager.
//
// The GPU holds Config.NumGPUBlocks block slots. A slot is in one of four
// states:
//
//   - active full block: a full block of tokens, identified by its content
//     (engine hash), held by refcount >= 1 requests;
//   - inactive full block: refcount 0, still cached and reusable until
//     evicted; these sit in an LRU list (front = evicted first);
//   - partial block: the unfinished last block of one request, never shared
//     and never cached (vLLM caches full blocks only);
//   - free.
//
// With prefix caching on, the content of a full block exists at most once:
// a request that needs a block whose content is already cached takes that
// block (refcount++ if active, revived out of the LRU if inactive) instead of
// a new slot. A new block takes a free slot or, when none is left, evicts the
// least recently used inactive block (Removed event). Blocks that become full
// are published (Stored) with their parent, consecutive new blocks of one
// request batched in one event. A released request's blocks go back
// tail-first, so the LRU evicts suffixes before the prefixes they hang from.
//
// With prefix caching off, slots are anonymous: no ids, no sharing, no events.

const noBlock = -1

// block is 16 bytes, four to a cache line: the arrays of a fleet's engines
// are read at random and do not fit the caches, and the smaller they are
// the more of them does. What only CachedBlocks reads (the parent) is kept
// apart, and only by engines that list their blocks (Config.NoBlockTokens).
type block struct {
	hash   uint64
	ref    int32
	lruPos int32 // the block's entry in blockManager.lru while inactive, else noBlock
}

// blockParent is where a cached block hangs, for CachedBlocks.
type blockParent struct {
	id   uint64 // engine id of the block before it; valid when !root
	root bool
}

type blockManager struct {
	blockSize int
	capacity  int
	caching   bool
	seed      uint64
	// seqIDs: blocks are named by their sequence hashes
	// (Config.SequenceHashIDs), plain hashes the blocks of requests
	// without keys.
	seqIDs bool
	plain  blockhash.Hasher

	blocks []block // full blocks by slot index
	// tokens holds blocks[i]'s tokens, for CachedBlocks, in pages of
	// tokenPageBlocks blocks: the cache grows as it fills, and one flat
	// array would be copied on every doubling (megabytes per engine).
	tokens   [][]uint32
	noTokens bool          // Config.NoBlockTokens: tokens and parents stay empty
	parents  []blockParent // blocks[i]'s parent, unless noTokens
	freeIdx  []int32       // unused indices into blocks
	byHash   blockMap
	// extra holds the adapter and extra keys of the cached blocks that
	// have any, for CachedBlocks; most blocks have none.
	extra map[int32]slotKeys

	// lru queues the inactive blocks, evicted from lruOff on: a block is
	// appended when its last holder lets it go, and reviving it only marks
	// its entry stale (lruPos no longer names it). A queue instead of a
	// linked list, because an eviction then reads the next victims from
	// one array and can ask for their blocks ahead; a list made every
	// eviction wait for the block before it.
	lru    []int32
	lruOff int
	// warmedNear and warmedFar are the queue positions from which
	// warmVictims goes on asking for map slots and blocks.
	warmedNear, warmedFar int
	numActive             int // full blocks with ref > 0
	numInactive           int // full blocks with ref == 0 (in the LRU)
	numPartial            int // partial blocks
	numAnon               int // anonymous slots (caching off)

	events  []BlockEvent // sink, drained by the engine each step
	group   int          // the group_idx of these blocks (Config.KVCacheGroups)
	groups  []*sideGroup // the hybrid model's other groups (groups.go)
	evicted []uint64     // scratch: blocks evicted by the allocation in progress
	victims []int32      // scratch: their slots, for the new blocks (placeNew)
	found   []int32      // scratch: slots of the cached blocks the allocation in progress reuses (noBlock: new)
	// counts numbers countPrefix's counts, and countedIdx holds the slots
	// of the leading cached blocks the last one found: the scheduler
	// counts a waiting request's cached prefix and allocates it next,
	// and the allocation takes them instead of looking every one up
	// again, if that request was the last counted (its seqBlocks.count)
	// and no block has been mapped or unmapped since (countedGen). A
	// number rather than the request's address, which the manager would
	// then keep alive, with the tokens of the callers' throwaway requests
	// (CachedPrefixBlocks).
	counts     uint64
	countedIdx []int32
	countedGen uint64

	// spareEvents and spareIDs are event slices and Removed events' id
	// lists the caller is done with (Engine.Recycle), reused before any
	// new one is allocated.
	spareEvents spareLists[BlockEvent]
	spareIDs    spareLists[uint64]
	// spareBlocks are finished requests' slot lists, for the next
	// requests': a list the length of a long prompt was a fresh, cleared
	// allocation per request.
	spareBlocks buffers.Longest[int32]

	allocateAll bool // tests: no step skips allocate (see holds)
	reserved    bool // reserve sized the tables
}

// blockList is an empty slot list of room for n blocks: the shortest
// spare one that has the room, else a new one. A spare too short stays
// for a shorter request; taking only the last one put, a long prompt
// threw it away for a fresh list.
func (m *blockManager) blockList(n int) []int32 {
	if l := m.spareBlocks.Take(n); l != nil {
		return l
	}
	return make([]int32, 0, n)
}

func newBlockManager(blockSize, capacity int, caching bool, seed uint64) *blockManager {
	m := &blockManager{
		blockSize: blockSize,
		capacity:  capacity,
		caching:   caching,
		seed:      seed,
	}
	m.byHash = newBlockMap(capacity, &m.blocks)
	return m
}

// reserve sizes the tables for n cached blocks (at most the capacity):
// the block array, the map at its load factor, and the inactive queue at
// the most that n inactive blocks make it hold (see lruPushBack). Only
// before the first allocation.
func (m *blockManager) reserve(n int) {
	n = min(n, m.capacity)
	if n <= 0 || !m.caching {
		return
	}
	if !m.noTokens {
		m.parents = make([]blockParent, 0, n)
	}
	m.reserved = true
	if t, ok := takeTables(n); ok {
		// Their contents are another engine's: only the map's are read
		// before they are written.
		m.blocks, m.lru = t.blocks[:0], t.lru[:0]
		clear(t.slots)
		m.byHash.use(t.slots)
		return
	}
	m.blocks = hugepage.Make[block](n)[:0]
	m.byHash.use(hugepage.Make[uint64](mapSlots(n)))
	m.lru = hugepage.Make[int32](lruRoom(n))[:0]
}

// giveBack hands the tables that reserve sized to the next engine that
// reserves as many blocks (Engine.Free). The manager is not used again.
func (m *blockManager) giveBack() {
	if !m.reserved {
		return
	}
	putTables(blockTables{blocks: m.blocks[:0], slots: m.byHash.slots, lru: m.lru[:0]})
	m.blocks, m.byHash.slots, m.lru = nil, nil, nil
}

// free is the number of free slots (not counting evictable inactive blocks).
func (m *blockManager) free() int {
	return m.capacity - m.numActive - m.numInactive - m.numPartial - m.numAnon
}

// used is the number of slots held by requests (KV usage numerator).
func (m *blockManager) used() int {
	return m.numActive + m.numPartial + m.numAnon
}

// seqBlocks is what a request holds in the manager.
type seqBlocks struct {
	tokens []uint32 // all tokens known so far (prompt, then generated)
	hashes []uint64 // engine ids of the full blocks of tokens, computed lazily
	locals []uint64 // under blockManager.seqIDs, the local hashes of the blocks of hashes
	blocks []int32  // slot indices of the full blocks held, in order
	// room is how many full blocks s can reach (prompt and max_tokens),
	// the room its blocks list gets when its first blocks are allocated:
	// not before, as an overloaded engine's waiting requests, nearly all
	// it was given, held lists that nothing filled yet.
	room    int
	partial bool // holds a partial block
	anon    int  // anonymous slots held (caching off)
	keys    *requestKeys
	tag     int32  // Request.Tag, for Stored events
	count   uint64 // blockManager.counts when countPrefix last counted s

	groups []sideSeq // blocks in the side groups, by blockManager.groups
}

// ensureHashes makes s.hashes cover the first n full blocks of s.tokens.
func (m *blockManager) ensureHashes(s *seqBlocks, n int) {
	if m.seqIDs {
		m.ensureSeqHashes(s, n)
		return
	}
	bs := m.blockSize
	for i := len(s.hashes); i < n; i++ {
		var parent uint64
		if i > 0 {
			parent = s.hashes[i-1]
		}
		if s.keys != nil {
			parent ^= foldKeys(s.keys.block(i, bs))
		}
		s.hashes = append(s.hashes, hashBlock(m.seed, parent, s.tokens[i*bs:(i+1)*bs]))
	}
}

// ensureSeqHashes is ensureHashes for an engine that names its blocks by
// their sequence hashes.
func (m *blockManager) ensureSeqHashes(s *seqBlocks, n int) {
	from := len(s.hashes)
	if from >= n {
		return
	}
	h := m.plain
	if s.keys != nil {
		h = s.keys.hasher(m.blockSize)
	}
	toks := s.tokens[from*m.blockSize : n*m.blockSize]
	if from == 0 {
		s.locals, s.hashes = h.AppendHashes(s.locals, s.hashes, toks)
		return
	}
	s.locals, s.hashes = h.AppendChainedHashes(s.locals, s.hashes, s.hashes[from-1], toks)
}

// countPrefix is the number of leading full blocks of s found cached
// (active or inactive), at most maxBlocks. It changes nothing.
func (m *blockManager) countPrefix(s *seqBlocks, maxBlocks int) int {
	if !m.caching {
		return 0
	}
	m.counts++
	s.count, m.countedIdx, m.countedGen = m.counts, m.countedIdx[:0], m.byHash.gen
	n := 0
	for n < maxBlocks {
		// Hashes are computed a window ahead, so that the window's slots
		// are asked for before the first is read: the allocation that
		// follows needs them anyway.
		end := min(n+warmAhead, maxBlocks)
		m.ensureHashes(s, end)
		for _, h := range s.hashes[n:end] {
			m.byHash.warm(h)
		}
		for ; n < end; n++ {
			idx, ok := m.byHash.get(s.hashes[n])
			if !ok {
				return n
			}
			m.countedIdx = append(m.countedIdx, idx)
		}
	}
	return n
}

// countedPrefix is the slots of s's leading cached blocks that countPrefix
// found, if they are still valid.
func (m *blockManager) countedPrefix(s *seqBlocks) []int32 {
	if s.count != m.counts || m.countedGen != m.byHash.gen {
		return nil
	}
	return m.countedIdx
}

// warmAhead is how many block lookups are asked for before they are made.
const warmAhead = 16

// allocateOwn makes s hold the blocks for its first upTo tokens (upTo never
// decreases while s holds blocks). It changes nothing and reports false when
// the blocks do not fit even after evicting every inactive block.
func (m *blockManager) allocateOwn(s *seqBlocks, upTo int) bool {
	bs := m.blockSize
	full := upTo / bs
	part := upTo%bs != 0
	if !m.caching {
		need := full - s.anon
		if part {
			need++
		}
		if need <= 0 {
			return true
		}
		if need > m.free() {
			return false
		}
		m.numAnon += need
		s.anon += need
		return true
	}
	have := len(s.blocks)
	if full == have {
		// Only the partial tail block, which s may already hold.
		if part && !s.partial {
			if m.free()+m.numInactive < 1 {
				return false
			}
			m.makeRoom()
			m.numPartial++
			s.partial = true
			m.flushEvicted()
		}
		return true
	}

	m.ensureHashes(s, full)
	newCnt, revive := 0, 0
	m.found = m.found[:0]
	from := have
	if counted := m.countedPrefix(s); len(counted) > have {
		from = min(len(counted), full)
		for _, idx := range counted[have:from] {
			m.found = append(m.found, idx)
			if m.blocks[idx].ref == 0 {
				revive++
			}
		}
	}
	for i := from; i < min(from+warmAhead, full); i++ {
		m.byHash.warm(s.hashes[i])
	}
	for i := from; i < full; i++ {
		if j := i + warmAhead; j < full {
			m.byHash.warm(s.hashes[j])
		}
		idx, ok := m.byHash.get(s.hashes[i])
		m.found = append(m.found, idx)
		if !ok {
			newCnt++
		} else if m.blocks[idx].ref == 0 {
			revive++
		}
	}
	need := newCnt + revive
	if part {
		need++
	}
	if s.partial {
		need--
	}
	if need > m.free()+m.numInactive {
		return false
	}

	if s.partial {
		// The old partial block becomes full: its slot is released and the
		// full block takes a slot (or an existing copy) below.
		m.numPartial--
		s.partial = false
	}
	if s.blocks == nil {
		s.blocks = m.blockList(max(s.room, full))
	}
	// Take the cached blocks first, so that this allocation cannot evict a
	// block it is about to reuse.
	for i := have; i < full; i++ {
		idx := m.found[i-have]
		if idx == noBlock {
			s.blocks = append(s.blocks, noBlock)
			continue
		}
		b := &m.blocks[idx]
		if b.ref == 0 {
			m.lruRemove(idx)
			m.numInactive--
			m.numActive++
		}
		b.ref++
		s.blocks = append(s.blocks, idx)
	}
	if newCnt > 0 {
		m.placeNew(s, have, full, newCnt)
	}
	if part {
		m.makeRoom()
		m.numPartial++
		s.partial = true
	}
	m.flushEvicted()
	if newCnt > 0 {
		m.emitStored(s, have, full)
	}
	return true
}

// placeNew gives the newCnt new blocks among s's blocks [have, full) (those
// s.blocks lists as noBlock) their slots, maps them and counts them active.
// The first free() of them take free slots; each of the others takes the
// slot of the inactive block it evicts, the first evicted going to the
// first of them, as when each evicted its victim just before it took the
// slot. The evictions all run first, in one loop whose misses (each
// victim's block and map slot) overlap, and the insertions after them:
// no new block can be a victim (it is active), and none of the blocks s
// reuses either (allocateOwn took them first).
func (m *blockManager) placeNew(s *seqBlocks, have, full, newCnt int) {
	fresh := min(m.free(), newCnt)
	victims := m.victims[:0]
	for range newCnt - fresh {
		m.warmVictims()
		victims = append(victims, m.evict())
	}
	m.victims = victims
	// The insertions ask for their slots again: a long prompt's lookups
	// have read thousands of lines since its first.
	for i := have; i < min(have+warmAhead, full); i++ {
		if s.blocks[i] == noBlock {
			m.byHash.warm(s.hashes[i])
		}
	}
	q := 0
	for i := have; i < full; i++ {
		if j := i + warmAhead; j < full && s.blocks[j] == noBlock {
			m.byHash.warm(s.hashes[j])
		}
		if s.blocks[i] != noBlock {
			continue
		}
		var idx int32
		if q < fresh {
			idx = m.newIndex()
		} else {
			idx = victims[q-fresh]
		}
		q++
		m.blocks[idx] = block{hash: s.hashes[i], ref: 1, lruPos: noBlock}
		if !m.noTokens {
			m.parents[idx] = blockParent{root: i == 0}
			if i > 0 {
				m.parents[idx].id = s.hashes[i-1]
			}
			copy(m.blockTokens(idx), s.tokens[i*m.blockSize:(i+1)*m.blockSize])
		}
		m.setKeys(idx, s.keys, i)
		m.byHash.put(s.hashes[i], idx)
		s.blocks[i] = idx
	}
	m.numActive += newCnt
}

// emitStored publishes the blocks of s in [from, to) that allocate just
// created (m.found[i-from] == noBlock), one event per run of consecutive new
// blocks.
func (m *blockManager) emitStored(s *seqBlocks, from, to int) {
	bs := m.blockSize
	start := -1
	for i := from; i <= to; i++ {
		isNew := i < to && m.found[i-from] == noBlock
		if isNew && start < 0 {
			start = i
		}
		if !isNew && start >= 0 {
			ev := BlockEvent{
				Kind:        Stored,
				Group:       m.group,
				BlockHashes: s.hashes[start:i:i],
				TokenIDs:    s.tokens[start*bs : i*bs : i*bs],
				Tag:         s.tag,
				First:       int32(start),
			}
			if m.seqIDs {
				ev.LocalHashes = s.locals[start:i:i]
			}
			if start > 0 {
				// Into the request's ids, as BlockHashes is: they are
				// only ever appended to, and a copy was an allocation
				// per event.
				ev.Parent = &s.hashes[start-1]
			}
			if s.keys != nil {
				ev.LoRAName = s.keys.lora
				ev.ExtraKeys = blockKeys(s.keys, start, i, bs)
			}
			m.events = append(m.events, ev)
			start = -1
		}
	}
}

// makeRoom frees one slot if none is free, evicting the LRU inactive block.
// The caller has checked that one is available.
func (m *blockManager) makeRoom() {
	if m.free() > 0 {
		return
	}
	m.freeIdx = append(m.freeIdx, m.evict())
}

// evict evicts the LRU inactive block, which must exist, and returns its
// slot, now unused.
func (m *blockManager) evict() int32 {
	idx := m.lruPop()
	if idx == noBlock {
		panic("engine: block manager out of slots")
	}
	h := m.blocks[idx].hash
	m.byHash.delete(h)
	if len(m.extra) > 0 {
		delete(m.extra, idx)
	}
	m.numInactive--
	m.evicted = append(m.evicted, h)
	return idx
}

// flushEvicted publishes the blocks evicted by the current allocation as
// one Removed event. The event takes the scratch list itself when a
// spare one (Engine.Recycle) can become the scratch: copying the ids into
// the spare cost as much as the evictions' other bookkeeping. Without one,
// the event gets a copy of its own size, and the scratch keeps its room.
func (m *blockManager) flushEvicted() {
	if len(m.evicted) == 0 {
		return
	}
	ids := m.evicted
	if spare := m.spareIDs.take(); spare != nil {
		m.evicted = spare
	} else {
		ids = append([]uint64(nil), ids...)
		m.evicted = m.evicted[:0]
	}
	m.events = append(m.events, BlockEvent{Kind: Removed, Group: m.group, BlockHashes: ids})
}

// maxSpare bounds the spare lists: a caller recycles at most what the
// steps handed out, but need not take back everything it recycles.
const maxSpare = 64

// spareLists are emptied slices kept for reuse, the last put taken first.
type spareLists[T any] [][]T

func (l *spareLists[T]) take() []T {
	n := len(*l)
	if n == 0 {
		return nil
	}
	x := (*l)[n-1]
	*l = (*l)[:n-1]
	return x
}

func (l *spareLists[T]) put(x []T) {
	if cap(x) > 0 && len(*l) < maxSpare {
		*l = append(*l, x[:0])
	}
}

// maxSpareLong bounds the slot lists kept (blockList): as many as the
// requests that start in a step or two.
const maxSpareLong = 16

func (m *blockManager) newIndex() int32 {
	if n := len(m.freeIdx); n > 0 {
		idx := m.freeIdx[n-1]
		m.freeIdx = m.freeIdx[:n-1]
		return idx
	}
	if len(m.blocks) == cap(m.blocks) {
		// Grown by hand rather than by append, so that a large array
		// lands on huge pages: each block is read at random, as the
		// block map's slots are.
		grown := hugepage.Make[block](min(max(2*len(m.blocks), 64), max(m.capacity, len(m.blocks)+1)))
		m.blocks = grown[:copy(grown, m.blocks)]
	}
	m.blocks = append(m.blocks, block{})
	idx := int32(len(m.blocks) - 1)
	if !m.noTokens {
		m.parents = append(m.parents, blockParent{})
		if int(idx) >= len(m.tokens)*tokenPageBlocks {
			m.tokens = append(m.tokens, make([]uint32, tokenPageBlocks*m.blockSize))
		}
	}
	return idx
}

const tokenPageBlocks = 256

// blockTokens is the token storage of block idx (nil under noTokens).
func (m *blockManager) blockTokens(idx int32) []uint32 {
	if m.noTokens {
		return nil
	}
	page, off := int(idx)/tokenPageBlocks, int(idx)%tokenPageBlocks*m.blockSize
	return m.tokens[page][off : off+m.blockSize : off+m.blockSize]
}

// release returns every block s holds, tail first.
func (m *blockManager) release(s *seqBlocks) { m.releaseTail(s, 0) }

// releaseTail returns the blocks s holds after its first keep full blocks,
// tail first, and its partial or anonymous blocks.
func (m *blockManager) releaseTail(s *seqBlocks, keep int) {
	m.releaseGroups(s)
	for i := len(s.blocks) - 1; i >= keep; i-- {
		if j := i - warmAhead; j >= keep {
			prefetch.Line(unsafe.Pointer(&m.blocks[s.blocks[j]]))
		}
		idx := s.blocks[i]
		b := &m.blocks[idx]
		b.ref--
		if b.ref == 0 {
			m.numActive--
			m.numInactive++
			m.lruPushBack(idx)
		}
	}
	s.blocks = s.blocks[:keep]
	if s.partial {
		m.numPartial--
		s.partial = false
	}
	m.numAnon -= s.anon
	s.anon = 0
}

// reset drops every cached block. Only valid when no request holds blocks.
func (m *blockManager) reset() {
	m.blocks = m.blocks[:0]
	m.parents = m.parents[:0]
	m.freeIdx = m.freeIdx[:0]
	m.byHash.clear()
	clear(m.extra)
	m.lru, m.lruOff = m.lru[:0], 0
	m.warmedNear, m.warmedFar = 0, 0
	m.numInactive = 0
	m.resetGroups()
}

func (m *blockManager) lruPushBack(idx int32) {
	// Compact when stale entries are half the live ones, or before the
	// queue would grow while its evicted front is half of it: a full
	// cache's churn evicts from the front as fast as it appends, and
	// without the second rule the queue grew by copying itself for ever.
	live := len(m.lru) - m.lruOff
	if live >= lruCompactMin && live >= 2*m.numInactive ||
		len(m.lru) >= lruCompactMin && len(m.lru) == cap(m.lru) && m.lruOff >= live {
		m.compactLRU()
	}
	if len(m.lru) == cap(m.lru) {
		// Doubling: append grows a large slice by a quarter, and a
		// queue that fills an engine of 131,072 blocks (stale entries
		// included) was copied some fifteen times on its way there.
		grown := make([]int32, len(m.lru), max(2*cap(m.lru), lruCompactMin))
		copy(grown, m.lru)
		m.lru = grown
	}
	m.blocks[idx].lruPos = int32(len(m.lru))
	m.lru = append(m.lru, idx)
}

// lruRoom is the most the inactive queue holds for n inactive blocks: up
// to n stale entries beside them (the first rule of lruPushBack), and an
// evicted front as long as both before the second compacts.
func lruRoom(n int) int { return max(4*n, lruCompactMin) }

// lruCompactMin is the queue length below which it is never compacted
// (tests lower it to compact at every chance).
var lruCompactMin = 64

func (m *blockManager) lruRemove(idx int32) {
	m.blocks[idx].lruPos = noBlock
}

// lruPop takes the least recently released inactive block off the queue,
// or returns noBlock when there is none.
func (m *blockManager) lruPop() int32 {
	for m.lruOff < len(m.lru) {
		pos := m.lruOff
		idx := m.lru[pos]
		m.lruOff++
		if b := &m.blocks[idx]; b.lruPos == int32(pos) {
			b.lruPos = noBlock
			return idx
		}
	}
	return noBlock
}

// compactLRU drops the queue's stale entries (revived blocks') and the
// evicted front, so that the queue stays within twice the inactive blocks.
func (m *blockManager) compactLRU() {
	n := 0
	for pos := m.lruOff; pos < len(m.lru); pos++ {
		idx := m.lru[pos]
		if b := &m.blocks[idx]; b.lruPos == int32(pos) {
			b.lruPos = int32(n)
			m.lru[n] = idx
			n++
		}
	}
	m.lru, m.lruOff = m.lru[:n], 0
	m.warmedNear, m.warmedFar = 0, 0
}

// warmVictims asks for what the next evictions touch: the blocks up to
// 2*warmAhead entries ahead in the queue, and the map slots of the live
// ones up to warmAhead ahead (whose blocks an earlier call asked for).
// Cursors carry each pass on from where the last stopped: an eviction
// skips the stale entries before its victim, and a pass a fixed distance
// ahead of the queue's front skipped as many victims (a third of them on
// the conversation trace), whose evictions then waited for memory.
func (m *blockManager) warmVictims() {
	far := min(m.lruOff+2*warmAhead, len(m.lru)-1)
	for pos := max(m.warmedFar, m.lruOff); pos <= far; pos++ {
		prefetch.Line(unsafe.Pointer(&m.blocks[m.lru[pos]]))
	}
	m.warmedFar = max(m.warmedFar, far+1)
	near := min(m.lruOff+warmAhead, len(m.lru)-1)
	for pos := max(m.warmedNear, m.lruOff); pos <= near; pos++ {
		if b := &m.blocks[m.lru[pos]]; b.lruPos == int32(pos) {
			m.byHash.warmRun(b.hash)
			if victimWarmed != nil {
				victimWarmed(pos)
			}
		}
	}
	m.warmedNear = max(m.warmedNear, near+1)
}

// victimWarmed, when set (tests), hears of every queue position whose map
// slot warmVictims asks for.
var victimWarmed func(pos int)

// CachedBlock is one full block the engine caches, as a Stored event would
// name it. Tokens shares memory with the engine until its next step.
type CachedBlock struct {
	Hash   uint64
	Parent *uint64 // nil for a first block
	Tokens []uint32
	// LoRAName and ExtraKeys are the block's adapter and extra keys, as
	// its Stored event had them (ExtraKeys nil when none).
	LoRAName  string
	ExtraKeys []any
	// Host: the block is on the host tier (Engine.HostBlocks).
	Host bool
}

// parentsFirst orders slots by their depth below the first ancestor
// missing from the set (parentOf answers false there), then by slot, so
// that a listing replays every block after its parent.
func parentsFirst(slots []int32, parentOf func(int32) (int32, bool)) []int32 {
	depth := make(map[int32]int, len(slots))
	var depthOf func(i int32) int
	depthOf = func(i int32) int {
		if d, ok := depth[i]; ok {
			return d
		}
		d := 0
		if p, ok := parentOf(i); ok {
			d = depthOf(p) + 1
		}
		depth[i] = d
		return d
	}
	for _, i := range slots {
		depthOf(i)
	}
	slices.SortFunc(slots, func(a, b int32) int { return cmp.Or(cmp.Compare(depth[a], depth[b]), cmp.Compare(a, b)) })
	return slots
}

// cached lists the cached blocks, every block after its parent (when that
// is cached too; a block can outlive its parent only in principle, since
// releases go tail-first); under noTokens, without parents, by slot.
func (m *blockManager) cached() []CachedBlock {
	out := make([]CachedBlock, 0, m.byHash.len())
	slots := make([]int32, 0, m.byHash.len())
	for i := range m.slotsInUse() {
		slots = append(slots, i)
	}
	order := parentsFirst(slots, func(idx int32) (int32, bool) {
		if m.noTokens || m.parents[idx].root {
			return 0, false
		}
		return m.byHash.get(m.parents[idx].id)
	})
	for _, idx := range order {
		b := &m.blocks[idx]
		cb := CachedBlock{Hash: b.hash, Tokens: m.blockTokens(idx)}
		if x, ok := m.extra[idx]; ok {
			cb.LoRAName, cb.ExtraKeys = x.lora, x.keys
		}
		if !m.noTokens && !m.parents[idx].root {
			p := m.parents[idx].id
			cb.Parent = &p
		}
		out = append(out, cb)
	}
	return out
}

// slotsInUse yields the slot indices of the cached full blocks.
func (m *blockManager) slotsInUse() iter.Seq[int32] {
	return func(yield func(int32) bool) {
		for _, sl := range m.byHash.slots {
			if sl != 0 && !yield(m.byHash.idxOf(sl)) {
				return
			}
		}
	}
}
