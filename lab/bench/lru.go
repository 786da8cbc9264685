package bench

import "github.com/kvrouter/kvrouter/core/kv"

// engineCache is one simulated engine's prefix cache: up to cap blocks,
// keyed by the block's position-dependent content (the router's sequence
// hash, which the simulation may use as a content key; it is never sent in
// an event), each known to the outside only by an opaque engine id drawn
// from a seeded stream, as vLLM's own block hashes are.
//
// Storage is flat: entries live in a slice with an intrusive doubly linked
// recency list (entry 0 is the list's sentinel) and an open-addressing table
// of entry indices finds them by key. Nothing is allocated once the cache is
// full.
//
// Recency rule (vLLM's): a request's blocks are touched leaf-first so that
// the root ends up most recently used. Every block is then more recent than
// its descendants, the least recently used block is always a leaf, and the
// cached set stays prefix-closed: evicting from the tail never strands a
// child without its parent.
type engineCache struct {
	cap   int
	ent   []entry
	free  []int32
	table []uint64 // see slotOf
	size  int

	seed    uint64 // engine id stream: see engineID
	issued  uint32 // engine ids drawn so far
	eventID uint64
}

// entry is 20 bytes (4-byte fields only): at 10,000 engines of 16,384
// blocks the caches are most of the harness's memory.
type entry struct {
	keyLo, keyHi uint32
	// id is the entry's place in the engine id stream (see engineID).
	id         uint32
	prev, next int32
}

func (e *entry) key() uint64 { return uint64(e.keyLo) | uint64(e.keyHi)<<32 }

func newEngineCache(capacity int, seed uint64) *engineCache {
	c := &engineCache{
		cap: capacity,
		ent: make([]entry, 1, capacity+1),
		// At most two thirds full: a lookup that misses (one per request,
		// and one per new block) then probes about five slots.
		table: make([]uint64, capacity*3/2+1),
		seed:  seed,
	}
	// Fault the memory in now, outside the timed replay: fresh pages from
	// the OS are zero but untouched, and the first write to each would
	// otherwise be charged to the harness while the fleet fills up.
	clear(c.ent[:cap(c.ent)])
	clear(c.table)
	return c
}

// engineID is the k-th id of the engine's stream, an opaque 64-bit value as
// vLLM's block hashes are; entries keep k, not the id.
func (c *engineCache) engineID(k uint32) uint64 { return mix64(c.seed + uint64(k)*golden) }

// nextEngineID draws the next id of the stream (never 0, which events
// cannot carry).
func (c *engineCache) nextEngineID() uint32 {
	for {
		c.issued++
		if c.engineID(c.issued) != 0 {
			return c.issued
		}
	}
}

// The table packs each slot as the key's high 32 bits above the entry
// index (0 = empty) and places keys by those same bits, so probing and
// deletion read only the table; the entry is read to confirm a match.

func slotOf(key uint64, e int32) uint64 { return key&^0xffffffff | uint64(uint32(e)) }

// home places a slot by its key's high 32 bits (multiply-shift range
// reduction, so the table's size need not be a power of two).
func (c *engineCache) home(slot uint64) int { return int((slot >> 32) * uint64(len(c.table)) >> 32) }

func (c *engineCache) next(i int) int {
	if i++; i == len(c.table) {
		return 0
	}
	return i
}

func (c *engineCache) lookup(key uint64) int32 {
	hi := key &^ 0xffffffff
	for i := c.home(key); ; i = c.next(i) {
		s := c.table[i]
		if s == 0 {
			return 0
		}
		if s&^0xffffffff == hi {
			if e := int32(uint32(s)); c.ent[e].key() == key {
				return e
			}
		}
	}
}

// insertKey adds key → e; it reports false, changing nothing, if key is
// already present.
func (c *engineCache) insertKey(key uint64, e int32) bool {
	hi := key &^ 0xffffffff
	i := c.home(key)
	for ; c.table[i] != 0; i = c.next(i) {
		if s := c.table[i]; s&^0xffffffff == hi && c.ent[int32(uint32(s))].key() == key {
			return false
		}
	}
	c.table[i] = slotOf(key, e)
	return true
}

// deleteKey removes entry e (whose key is key) from the table, shifting the
// following run back so that the table needs no tombstones.
func (c *engineCache) deleteKey(key uint64, e int32) {
	want := slotOf(key, e)
	i := c.home(key)
	for c.table[i] != want {
		i = c.next(i)
	}
	for {
		c.table[i] = 0
		j := i
		for {
			j = c.next(j)
			s := c.table[j]
			if s == 0 {
				return
			}
			home := c.home(s)
			// Move s into the hole at i unless its home lies cyclically in (i, j].
			if (j > i && (home <= i || home > j)) || (j < i && home <= i && home > j) {
				c.table[i] = s
				i = j
				break
			}
		}
	}
}

func (c *engineCache) unlink(e int32) {
	en := &c.ent[e]
	c.ent[en.prev].next = en.next
	c.ent[en.next].prev = en.prev
}

// linkAfter puts e right after p in recency order (p = 0: most recent).
func (c *engineCache) linkAfter(p, e int32) {
	n := c.ent[p].next
	c.ent[e].prev, c.ent[e].next = p, n
	c.ent[p].next = e
	c.ent[n].prev = e
}

func (c *engineCache) alloc() int32 {
	if k := len(c.free); k > 0 {
		e := c.free[k-1]
		c.free = c.free[:k-1]
		return e
	}
	c.ent = append(c.ent, entry{})
	return int32(len(c.ent) - 1)
}

// serveScratch is the per-goroutine working memory of serve.
type serveScratch struct {
	pos     []int32
	blocks  []kv.Block
	removed []uint64
}

// serve admits a request whose blocks have the given keys and local hashes
// (at most cap of them are kept). It returns the number of leading blocks
// that were cached, the parent engine id of the new chain (ok false: the
// chain starts at the root), the new blocks to announce in one Stored event
// and the engine ids evicted to make room, for one Removed event. The
// slices live in sc.
func (c *engineCache) serve(keys, local []uint64, sc *serveScratch) (hit int, parent uint64, hasParent bool) {
	n := min(len(keys), c.cap)
	sc.pos = sc.pos[:0]
	sc.blocks = sc.blocks[:0]
	sc.removed = sc.removed[:0]
	for hit < n {
		e := c.lookup(keys[hit])
		if e == 0 {
			break
		}
		sc.pos = append(sc.pos, e)
		hit++
	}
	// Touch the cached prefix leaf-first: the root becomes most recent.
	for i := hit - 1; i >= 0; i-- {
		e := sc.pos[i]
		c.unlink(e)
		c.linkAfter(0, e)
	}
	// Make room from the tail. The prefix is at the head and n ≤ cap, so
	// it is never evicted.
	for need := c.size + (n - hit) - c.cap; need > 0; need-- {
		e := c.ent[0].prev
		en := &c.ent[e]
		sc.removed = append(sc.removed, c.engineID(en.id))
		c.deleteKey(en.key(), e)
		c.unlink(e)
		*en = entry{}
		c.free = append(c.free, e)
		c.size--
	}
	// New blocks go right below the prefix, each after its parent.
	prev := int32(0)
	if hit > 0 {
		prev = sc.pos[hit-1]
		parent, hasParent = c.engineID(c.ent[prev].id), true
	}
	for i := hit; i < n; i++ {
		e := c.alloc()
		if !c.insertKey(keys[i], e) {
			// Impossible while the cache is prefix-closed (see above).
			panic("bench: engine cache holds a block whose parent it dropped")
		}
		k := c.nextEngineID()
		c.ent[e].keyLo, c.ent[e].keyHi, c.ent[e].id = uint32(keys[i]), uint32(keys[i]>>32), k
		c.linkAfter(prev, e)
		c.size++
		sc.blocks = append(sc.blocks, kv.Block{EngineHash: c.engineID(k), LocalHash: local[i]})
		prev = e
	}
	return hit, parent, hasParent
}

const golden = 0x9e3779b97f4a7c15

func mix64(z uint64) uint64 {
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	return z ^ z>>31
}

// cachedPrefix is how many leading keys the cache holds, changing nothing:
// the overlap an exact index reports for this engine.
func (c *engineCache) cachedPrefix(keys []uint64) int {
	n := 0
	for n < len(keys) && c.lookup(keys[n]) != 0 {
		n++
	}
	return n
}
