package replay

import "math/bits"

// BlockIDs numbers block hashes densely, 0, 1, 2, ... in the order they
// are first seen, so that whatever a pass over a workload keeps per block
// lives in slices indexed by the number rather than in maps keyed by the
// hash: the bounds of a sweep keep four such records per block, over tens
// of millions of blocks, and one probe of this table replaces four map
// lookups and their inserts.
//
// Numbers are never withdrawn, so the table is insert-only: linear
// probing in a power-of-two array of packed slots, with no deletion or
// tombstones, grown by doubling at three quarters full.
type BlockIDs struct {
	slots []idSlot
	n     int32
	shift uint // 64 − log2(len(slots))
}

// idSlot holds a hash and its number plus one (0 marks an empty slot, so
// that every hash, 0 included, can be a key).
type idSlot struct {
	key uint64
	id  int32
}

const fib = 0x9e3779b97f4a7c15

// NewBlockIDs starts an empty numbering with room for about hint hashes
// before it grows.
func NewBlockIDs(hint int) *BlockIDs {
	b := &BlockIDs{}
	b.alloc(max(hint*4/3, 16))
	return b
}

func (b *BlockIDs) alloc(room int) {
	size := 1 << bits.Len(uint(room-1))
	b.slots = make([]idSlot, size)
	b.shift = uint(64 - bits.TrailingZeros(uint(size)))
}

// Len is how many hashes have been numbered.
func (b *BlockIDs) Len() int32 { return b.n }

// ID is h's number, a new one (Len before the call) if h is new.
func (b *BlockIDs) ID(h uint64) int32 {
	mask := len(b.slots) - 1
	for i := int((h * fib) >> b.shift); ; i = (i + 1) & mask {
		s := &b.slots[i]
		if s.id == 0 {
			id := b.n
			s.key, s.id = h, id+1
			if b.n++; int(b.n) > len(b.slots)*3/4 {
				b.grow()
			}
			return id
		}
		if s.key == h {
			return s.id - 1
		}
	}
}

// AppendIDs appends the numbers of hs to ids.
func (b *BlockIDs) AppendIDs(ids []int32, hs []uint64) []int32 {
	for _, h := range hs {
		ids = append(ids, b.ID(h))
	}
	return ids
}

func (b *BlockIDs) grow() {
	old := b.slots
	b.alloc(2 * len(old))
	mask := len(b.slots) - 1
	for _, s := range old {
		if s.id == 0 {
			continue
		}
		i := int((s.key * fib) >> b.shift)
		for b.slots[i].id != 0 {
			i = (i + 1) & mask
		}
		b.slots[i] = s
	}
}
