package trace

import "golang.org/x/sys/cpu"

// The tokens of a block are 256 independent splitmix64 outputs; eight at a
// time in AVX-512 lanes they take a fraction of the scalar loop's time,
// which is bound by its four 64-bit multiplications per two tokens (a
// third of a simulated run at 512-token blocks went there).
var haveAVX512 = cpu.X86.HasAVX512F && cpu.X86.HasAVX512DQ

// blockTokensAVX512 writes the tokens of the stream whose k-th pair (from
// 0) is mixed from first[k%8] + (k/8)·8·golden.
//
//go:noescape
func blockTokensAVX512(out *[BlockTokens]uint32, first *[8]uint64)

func blockTokens(out *[BlockTokens]uint32, cid uint64) {
	if !haveAVX512 {
		blockTokensGeneric(out, cid)
		return
	}
	s := mix64(cid ^ tokenSeed)
	var first [8]uint64
	for j := range first {
		s += golden
		first[j] = s
	}
	blockTokensAVX512(out, &first)
}
