package trace

import (
	"fmt"

	"github.com/kvrouter/kvrouter/core/blockhash"
)

// HashCache computes a trace's router block hashes without re-hashing
// tokens for every request.
//
// Because the router's block size divides 512, the local hashes of a
// request are the concatenation of the per-id local hashes (512/blockSize
// of them per id), truncated to InputLength/blockSize blocks: the cut last
// id's tokens are a prefix of its 512. HashCache memoises the per-id hashes
// of (copy, id) pairs in a fixed-size direct-mapped table, so memory stays
// bounded however many copies are replayed, and an id seen again (the
// system prompt, an earlier turn of a conversation) costs a table probe.
//
// A HashCache is not safe for concurrent use: give each goroutine its own.
type HashCache struct {
	tr   *Trace
	h    blockhash.Hasher
	per  int      // local hashes per id: BlockTokens / blockSize
	keys []uint64 // 1 + (copy·len(IDs) + idx); 0 = empty
	vals []uint64 // per hashes for each entry
	mask uint64

	tok [BlockTokens]uint32

	Hits, Misses uint64
}

// DefaultCacheEntries is the (copy, id) capacity NewHashCache uses for a
// non-positive size: 2^17 ids, 34 MB at block size 16.
const DefaultCacheEntries = 1 << 17

// NewHashCache returns a cache of the local hashes of tr under h, holding
// up to entries (rounded up to a power of two) (copy, id) pairs. The block
// size of h must divide 512.
func NewHashCache(tr *Trace, h blockhash.Hasher, entries int) (*HashCache, error) {
	bs := h.BlockSize()
	if BlockTokens%bs != 0 {
		return nil, fmt.Errorf("trace: block size %d does not divide %d", bs, BlockTokens)
	}
	if entries <= 0 {
		entries = DefaultCacheEntries
	}
	n := 1
	for n < entries {
		n <<= 1
	}
	per := BlockTokens / bs
	return &HashCache{
		tr:   tr,
		h:    h,
		per:  per,
		keys: make([]uint64, n),
		vals: make([]uint64, n*per),
		mask: uint64(n - 1),
	}, nil
}

// PerID is the number of local hashes one hash id contributes.
func (c *HashCache) PerID() int { return c.per }

// ID returns the per-id local hashes of the trace's id number idx (an index
// into Trace.IDs) in copy cp. The slice is owned by the cache and valid
// until the next call.
func (c *HashCache) ID(cp int, idx uint32) []uint64 {
	key := 1 + uint64(cp)*uint64(len(c.tr.IDs)) + uint64(idx)
	slot := mix64(key) & c.mask
	v := c.vals[int(slot)*c.per : int(slot+1)*c.per]
	if c.keys[slot] == key {
		c.Hits++
		return v
	}
	c.Misses++
	blockTokens(&c.tok, ContentID(c.tr.IDs[idx], cp))
	c.h.AppendLocalHashes(v[:0], c.tok[:])
	c.keys[slot] = key
	return v
}

// AppendLocal appends the local hashes of r's prompt in copy cp to dst:
// InputLength/blockSize of them. r must be a request of the cache's trace.
func (c *HashCache) AppendLocal(dst []uint64, r *Request, cp int) []uint64 {
	want := len(dst) + r.InputLength/c.h.BlockSize()
	for _, idx := range r.idx {
		dst = append(dst, c.ID(cp, idx)...)
	}
	return dst[:want]
}

// AppendSequence appends the sequence hashes of r's prompt in copy cp to
// dst, and returns it with the local hashes appended to local.
func (c *HashCache) AppendSequence(dst, local []uint64, r *Request, cp int) (seq, loc []uint64) {
	start := len(local)
	local = c.AppendLocal(local, r, cp)
	return blockhash.AppendSequenceHashes(dst, local[start:]), local
}
