package blockhash

import "math/bits"

// XXH3-64 for the two inputs every routing decision hashes hundreds of
// times: a 16-token block (64 bytes) and a chain link (16 bytes). They
// follow the XXH3 specification's paths for 17–128 and 9–16 bytes
// exactly (the tests compare them with github.com/zeebo/xxh3 on random
// input), read the input as words instead of bytes and inline into the
// callers' loops: hashing an 8,192-token prompt takes about half the time
// of the general function, whose length dispatch and call dominate at
// these sizes.

// The XXH3 default secret's words at byte offsets 0, 8, …, 56, from the
// specification.
const (
	secret00 = 0xbe4ba423396cfeb8
	secret08 = 0x1cad21f72c81017c
	secret16 = 0xdb979083e96dd4de
	secret24 = 0x1f67b3b7a4a44072
	secret32 = 0x78e5c0cc4ee679cb
	secret40 = 0x2172ffcc7dd05a82
	secret48 = 0x8e2443f7744608b8
	secret56 = 0x4c263a81e69035e0

	xxPrime64_1 = 0x9e3779b185ebca87
	mask64      = 1<<64 - 1
)

func mulFold(x, y uint64) uint64 {
	hi, lo := bits.Mul64(x, y)
	return hi ^ lo
}

func avalanche(x uint64) uint64 {
	x ^= x >> 37
	x *= 0x165667919e3779f9
	return x ^ x>>32
}

// word is the little-endian 64-bit word of two tokens, as XXH3 reads the
// bytes of a []uint32 laid out little-endian.
func word(a, b uint32) uint64 { return uint64(a) | uint64(b)<<32 }

// hash16Tokens is XXH3-64 with seed over the 64 bytes of 16 tokens.
func hash16Tokens(t *[16]uint32, seed uint64) uint64 {
	acc := uint64(64 * xxPrime64_1 & mask64)
	acc += mulFold(word(t[0], t[1])^(secret00+seed), word(t[2], t[3])^(secret08-seed))
	acc += mulFold(word(t[12], t[13])^(secret16+seed), word(t[14], t[15])^(secret24-seed))
	acc += mulFold(word(t[4], t[5])^(secret32+seed), word(t[6], t[7])^(secret40-seed))
	acc += mulFold(word(t[8], t[9])^(secret48+seed), word(t[10], t[11])^(secret56-seed))
	return avalanche(acc)
}

// Chain's two words, mixed with the secret and Seed once.
const (
	chainLo = (secret24 ^ secret32 + Seed) & mask64
	chainHi = (secret40 ^ secret48 - Seed) & mask64
)

// chain16 is XXH3-64 with Seed over parent and local as little-endian
// words: Chain.
func chain16(parent, local uint64) uint64 {
	lo, hi := parent^chainLo, local^chainHi
	return avalanche(16 + bits.ReverseBytes64(lo) + hi + mulFold(lo, hi))
}

// keys16 are the secret's words of hash16Tokens mixed with one seed:
// AppendHashes mixes them once per prompt, where a call to hash16Tokens
// mixes them again for every block.
type keys16 [8]uint64

func newKeys16(seed uint64) keys16 {
	return keys16{secret00 + seed, secret08 - seed, secret16 + seed, secret24 - seed,
		secret32 + seed, secret40 - seed, secret48 + seed, secret56 - seed}
}
