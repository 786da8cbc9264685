package engine

import "math/bits"

// The engine's block ids and generated tokens come from a small wyhash-like
// mixer: fast, deterministic across processes and platforms, and keyed by
// Config.Seed so that two engines never share ids. They are deliberately not
// kvrouter's block hashes (SPEC §2: engines' own hashes are opaque), unless
// Config.SequenceHashIDs asks for those.

const (
	k0 = 0xa0761d6478bd642f
	k1 = 0xe7037ed1a0b428db
	k2 = 0x8ebc6af09c88c6e3
	k3 = 0x589965cc75374cc3
)

func mum(a, b uint64) uint64 {
	hi, lo := bits.Mul64(a, b)
	return hi ^ lo
}

// hashBlock is the engine id of a full block: a function of the seed, the
// parent block's engine id (0 at the root) and the block's tokens.
func hashBlock(seed, parent uint64, toks []uint32) uint64 {
	h := mum(parent^k0, seed^k1)
	i := 0
	for ; i+4 <= len(toks); i += 4 {
		a := uint64(toks[i]) | uint64(toks[i+1])<<32
		b := uint64(toks[i+2]) | uint64(toks[i+3])<<32
		h = mum(a^h^k1, b^k2)
	}
	for ; i < len(toks); i++ {
		h = mum(uint64(toks[i])^h^k3, k0)
	}
	return mum(h^k3, uint64(len(toks))^k1)
}

// promptSalt separates the prompt fingerprint from block ids.
const promptSalt = 0x6c62272e07bb0142

// genToken is the index-th generated token of a request whose prompt
// fingerprint is promptHash, in [0, vocab).
func genToken(seed, promptHash uint64, index int, vocab uint32) uint32 {
	z := mum(promptHash^k2, (uint64(index)+seed)^k3)
	return uint32((z & 0xffffffff) * uint64(vocab) >> 32)
}
