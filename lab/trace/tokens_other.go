//go:build !amd64

package trace

func blockTokens(out *[BlockTokens]uint32, cid uint64) { blockTokensGeneric(out, cid) }
