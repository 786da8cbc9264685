package enginesource

import (
	"encoding/binary"

	"github.com/kvrouter/kvrouter/adapters/vllmevents"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/zeebo/xxh3"
)

// maxSaltedBlocks bounds the salted blocks remembered per rank (see
// router.SaltChains): more than any engine caches today.
const maxSaltedBlocks = 1 << 22

// storedSalt returns the cache salt of a stored event's blocks: the one
// vLLM writes in the first block's extra keys, else SGLang's cache_salt
// field, else the salt of the block the event continues.
func (s *Source) storedSalt(rank uint32, e *vllmevents.BlockStored, keys [][]vllmevents.ExtraKey) string {
	own := ""
	if e.ParentBlockHash == nil {
		// Only a request's first block carries its salt, and it has no
		// parent.
		own = vllmevents.CacheSalt(keys, e.LoRAName)
	}
	if own == "" {
		own = e.CacheSalt
	}
	c := s.salts[rank]
	if c == nil {
		if own == "" {
			return ""
		}
		if s.salts == nil {
			s.salts = map[uint32]*router.SaltChains{}
		}
		c = router.NewSaltChains(maxSaltedBlocks)
		s.salts[rank] = c
	}
	return c.Stored(e.ParentBlockHash, e.BlockHashes, own)
}

// removedSalts forgets the salts of removed blocks, or, with all, every
// salt of the rank.
func (s *Source) removedSalts(rank uint32, hashes []uint64, all bool) {
	c := s.salts[rank]
	switch {
	case c == nil:
	case all:
		c.Clear()
	default:
		c.Removed(hashes)
	}
}

// apartMarks returns, for each block of the event whose extra keys the
// router cannot honour (prompt-embedding digests, bare strings that are
// neither the adapter nor the salt, as vLLM wrote multimodal identifiers
// before 0.19, shapes no engine sends today, or extra_keys that do not
// decode), a marker to hash the block with as if it held a multimodal item
// of its own. Derived from the block's engine hash, it is an identifier no
// request carries, so such a block and every block below it match
// nothing. Blocks the router can key get nil; the whole result is nil when
// no block needs a marker. Each marked block is counted as unsupported.
func (s *Source) apartMarks(e *vllmevents.BlockStored, keys [][]vllmevents.ExtraKey, malformed bool) [][]uint64 {
	var marks [][]uint64
	mark := func(i int, field string) {
		s.unsupported(field)
		if marks == nil {
			marks = make([][]uint64, len(e.BlockHashes))
		}
		var b [8]byte
		binary.LittleEndian.PutUint64(b[:], e.BlockHashes[i])
		marks[i] = []uint64{xxh3.HashSeed(b[:], apartSeed)}
	}
	for i := range e.BlockHashes {
		if malformed {
			mark(i, "extra_keys=malformed")
			continue
		}
		if i >= len(keys) {
			break
		}
		if vllmevents.StrayStrings(keys[i], e.LoRAName, i == 0 && e.ParentBlockHash == nil) {
			mark(i, "extra_keys=bare_identifier")
			continue
		}
		for _, k := range keys[i] {
			if f := unsupportedKey(k.Kind); f != "" {
				mark(i, f)
				break
			}
		}
	}
	return marks
}

// apartSeed keeps markers apart from identifiers hashed from strings.
const apartSeed = 0x6b76_6170_6172_74

func unsupportedKey(k vllmevents.ExtraKeyKind) string {
	switch k {
	case vllmevents.ExtraString, vllmevents.ExtraIdentifierOffset:
		return ""
	case vllmevents.ExtraBytes:
		return "extra_keys=prompt_embeds"
	}
	return "extra_keys=other"
}

// withMarks adds apartMarks' markers to the blocks' multimodal
// identifiers.
func withMarks(mm, marks [][]uint64) [][]uint64 {
	if marks == nil {
		return mm
	}
	out := make([][]uint64, len(marks))
	for i := range out {
		if i < len(mm) {
			out[i] = append(out[i], mm[i]...)
		}
		out[i] = append(out[i], marks[i]...)
	}
	return out
}
