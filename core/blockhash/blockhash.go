// Package blockhash cuts token sequences into blocks and hashes them the way
// Dynamo's router does, so that kvrouter and Dynamo agree on every block id.
//
//   - local hash: XXH3-64 (seed 1337, or the LoRA-mixed seed) over the block's
//     token ids as little-endian uint32, no length prefix;
//   - sequence hash: seq[0] = local[0], seq[i] = XXH3-64(seed 1337) over
//     seq[i-1] and local[i] as little-endian uint64.
//
// Only full blocks are hashed; a trailing partial block is ignored.
package blockhash

import (
	"encoding/binary"
	"slices"
	"strconv"
	"unsafe"

	"github.com/zeebo/xxh3"
)

// nativeLE: on little-endian machines the in-memory bytes of a []uint32 are
// already the wire encoding, so blocks are hashed in place without a copy.
var nativeLE = binary.NativeEndian.Uint16([]byte{1, 0}) == 1

func tokenBytes(tokens []uint32) []byte {
	if len(tokens) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&tokens[0])), 4*len(tokens))
}

// Seed is the XXH3 seed of every base-model hash.
const Seed uint64 = 1337

// LoRASeed returns the seed for blocks computed under a LoRA adapter: 1337
// plus XXH3-64(seed 0) of the adapter name, wrapping. The empty name is the
// base model.
func LoRASeed(adapter string) uint64 { return KeySeed(adapter, "") }

// KeySeed returns the seed for blocks computed under a LoRA adapter and a
// cache salt (vLLM's per-request cache_salt, SGLang's cache_salt): 1337,
// plus XXH3-64(seed 0) of the adapter name when there is one, plus
// XXH3-64(seed 1) of the salt when there is one, wrapping; Dynamo's
// kv-hashing derives its seed the same way, so a salted block has the same
// id in both. Engines mix the salt into the first block only and chain it
// to the rest; seeding every block instead gives the same partition of
// blocks (no salted block matches an unsalted or differently salted one)
// without a special first block.
func KeySeed(adapter, salt string) uint64 {
	seed := Seed
	if adapter != "" {
		seed += xxh3.HashString(adapter)
	}
	if salt != "" {
		seed += xxh3.HashStringSeed(salt, 1)
	}
	return seed
}

// Hasher hashes token sequences for one block size and adapter. The zero
// value is not usable; build one with New. A Hasher is immutable and safe for
// concurrent use.
type Hasher struct {
	blockSize int
	seed      uint64
}

// New returns a Hasher for blocks of blockSize tokens under the given LoRA
// adapter ("" for the base model). blockSize must be positive.
func New(blockSize int, adapter string) Hasher {
	if blockSize <= 0 {
		panic("blockhash: block size must be positive")
	}
	return Hasher{blockSize: blockSize, seed: LoRASeed(adapter)}
}

// NewKeyed returns a Hasher for blocks of blockSize tokens under a LoRA
// adapter and a cache salt ("" for none); see KeySeed.
func NewKeyed(blockSize int, adapter, salt string) Hasher {
	h := New(blockSize, "")
	h.seed = KeySeed(adapter, salt)
	return h
}

// BlockSize is the number of tokens in one block.
func (h Hasher) BlockSize() int { return h.blockSize }

// Blocks is the number of full blocks in n tokens.
func (h Hasher) Blocks(n int) int { return n / h.blockSize }

// LocalHash hashes exactly one block of tokens.
func (h Hasher) LocalHash(block []uint32) uint64 {
	if len(block) == 16 {
		return hash16Tokens((*[16]uint32)(block), h.seed)
	}
	if nativeLE {
		return xxh3.HashSeed(tokenBytes(block), h.seed)
	}
	var buf [64 * 4]byte
	if len(block)*4 <= len(buf) {
		b := buf[:len(block)*4]
		putTokens(b, block)
		return xxh3.HashSeed(b, h.seed)
	}
	b := make([]byte, len(block)*4)
	putTokens(b, block)
	return xxh3.HashSeed(b, h.seed)
}

// LocalHashMM hashes one block of tokens that holds (part of) multimodal
// items, identified by mm (see HashMMIdentifier): the block's tokens as
// little-endian uint32 followed by the identifiers, sorted, as
// little-endian uint64, as Dynamo hashes a block with multimodal objects.
// With no identifiers it is LocalHash.
func (h Hasher) LocalHashMM(block []uint32, mm []uint64) uint64 {
	if len(mm) == 0 {
		return h.LocalHash(block)
	}
	b := make([]byte, 4*len(block), 4*len(block)+8*len(mm))
	putTokens(b, block)
	sorted := slices.Clone(mm)
	slices.Sort(sorted)
	for _, id := range sorted {
		b = binary.LittleEndian.AppendUint64(b, id)
	}
	return xxh3.HashSeed(b, h.seed)
}

// HashMMIdentifier maps a multimodal item's identifier to the uint64 that
// enters block hashes: a 64-hex-digit digest (vLLM's own identifiers) is
// read from its first 16 hex digits, anything else is XXH3-64 of its bytes;
// false for the empty identifier. Dynamo maps identifiers the same way.
func HashMMIdentifier(id string) (uint64, bool) {
	if id == "" {
		return 0, false
	}
	if len(id) == 64 {
		if v, err := strconv.ParseUint(id[:16], 16, 64); err == nil && isHex(id[16:]) {
			return v, true
		}
	}
	return xxh3.HashString(id), true
}

func isHex(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F') {
			return false
		}
	}
	return true
}

// AppendLocalHashes appends the local hash of every full block of tokens to
// dst and returns it.
func (h Hasher) AppendLocalHashes(dst []uint64, tokens []uint32) []uint64 {
	bs := h.blockSize
	if bs == 16 {
		for start := 0; start+16 <= len(tokens); start += 16 {
			dst = append(dst, hash16Tokens((*[16]uint32)(tokens[start:start+16]), h.seed))
		}
		return dst
	}
	if nativeLE {
		for start := 0; start+bs <= len(tokens); start += bs {
			dst = append(dst, xxh3.HashSeed(tokenBytes(tokens[start:start+bs]), h.seed))
		}
		return dst
	}
	var scratch []byte
	if bs*4 > 64*4 {
		scratch = make([]byte, bs*4)
	}
	var buf [64 * 4]byte
	for start := 0; start+bs <= len(tokens); start += bs {
		b := buf[:]
		if scratch != nil {
			b = scratch
		}
		b = b[:bs*4]
		putTokens(b, tokens[start:start+bs])
		dst = append(dst, xxh3.HashSeed(b, h.seed))
	}
	return dst
}

// AppendHashes appends the local and the sequence hash of every full block
// of tokens to local and seq: AppendLocalHashes then
// AppendSequenceHashes, in one pass where the default block size allows
// it, so that hashing a block overlaps the wait on the previous link of
// the chain. Two passes, the independent local hashes first, measured
// half again as slow: the loop is bound by its instructions more than by
// the chain, so the 16-token hash is written out here with its seeded
// keys mixed once, rather than called per block, and the results are
// stored in place rather than appended.
func (h Hasher) AppendHashes(local, seq []uint64, tokens []uint32) ([]uint64, []uint64) {
	return h.appendHashes(local, seq, tokens, 0, false)
}

// AppendChainedHashes is AppendHashes for blocks that continue a chain:
// the first block's parent has sequence hash parent.
func (h Hasher) AppendChainedHashes(local, seq []uint64, parent uint64, tokens []uint32) ([]uint64, []uint64) {
	return h.appendHashes(local, seq, tokens, parent, true)
}

func (h Hasher) appendHashes(local, seq []uint64, tokens []uint32, parent uint64, chained bool) ([]uint64, []uint64) {
	if h.blockSize != 16 {
		n := len(local)
		local = h.AppendLocalHashes(local, tokens)
		if !chained {
			return local, AppendSequenceHashes(seq, local[n:])
		}
		for _, l := range local[n:] {
			parent = Chain(parent, l)
			seq = append(seq, parent)
		}
		return local, seq
	}
	n := len(tokens) / 16
	if n == 0 {
		return local, seq
	}
	l0, s0 := len(local), len(seq)
	local, seq = slices.Grow(local, n)[:l0+n], slices.Grow(seq, n)[:s0+n]
	ls, ss := local[l0:], seq[s0:]
	k := newKeys16(h.seed)
	l0h := hash16Tokens((*[16]uint32)(tokens[:16]), h.seed)
	prev := l0h
	if chained {
		prev = chain16(parent, l0h)
	}
	ls[0], ss[0] = l0h, prev
	for i := 1; i < n && i < len(ls) && i < len(ss); i++ {
		t := (*[16]uint32)(tokens[16*i : 16*i+16])
		acc := uint64(64 * xxPrime64_1 & mask64)
		acc += mulFold(word(t[0], t[1])^k[0], word(t[2], t[3])^k[1])
		acc += mulFold(word(t[12], t[13])^k[2], word(t[14], t[15])^k[3])
		acc += mulFold(word(t[4], t[5])^k[4], word(t[6], t[7])^k[5])
		acc += mulFold(word(t[8], t[9])^k[6], word(t[10], t[11])^k[7])
		l := avalanche(acc)
		prev = chain16(prev, l)
		ls[i], ss[i] = l, prev
	}
	return local, seq
}

// LocalHashes returns the local hash of every full block of tokens.
func (h Hasher) LocalHashes(tokens []uint32) []uint64 {
	return h.AppendLocalHashes(make([]uint64, 0, len(tokens)/h.blockSize), tokens)
}

// Hashes returns both the local and the sequence hashes of tokens, the
// pair every routing decision needs; computing them together hashes each
// request once.
func (h Hasher) Hashes(tokens []uint32) (local, seq []uint64) {
	n := len(tokens) / h.blockSize
	return h.AppendHashes(make([]uint64, 0, n), make([]uint64, 0, n), tokens)
}

func putTokens(b []byte, tokens []uint32) {
	for i, t := range tokens {
		binary.LittleEndian.PutUint32(b[i*4:], t)
	}
}

// Chain returns the sequence hash of a block whose parent has sequence hash
// parent and whose own local hash is local.
func Chain(parent, local uint64) uint64 { return chain16(parent, local) }

// AppendSequenceHashes appends the chained sequence hashes of local to dst.
func AppendSequenceHashes(dst []uint64, local []uint64) []uint64 {
	for i, l := range local {
		if i == 0 {
			dst = append(dst, l)
			continue
		}
		dst = append(dst, Chain(dst[len(dst)-1], l))
	}
	return dst
}

// SequenceHashes returns the chained sequence hashes of local.
func SequenceHashes(local []uint64) []uint64 {
	return AppendSequenceHashes(make([]uint64, 0, len(local)), local)
}
