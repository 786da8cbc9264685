package router

import (
	"errors"
	"fmt"
	"slices"

	"github.com/kvrouter/kvrouter/core/blockhash"
)

// An engine keys a block that holds placeholder tokens of a multimodal
// item (an image, an audio clip) by the item's identifier as well as by
// its tokens: the placeholder tokens of two different images are the same
// ids. The router hashes such a block with the identifiers of the items it
// overlaps (blockhash.Hasher.LocalHashMM), on requests and on the engines'
// events alike, so that only the same item matches.
//
// When the router cannot know the identifier the engine will give an item
// (MMItem.Known false), no block from the first one that holds part of it
// on may be credited as cached: the request is matched up to that block
// and never beyond. Its later blocks are still hashed (with the item's
// best-effort Hash) and booked as load, so load and prefill estimates
// count the whole prompt.

// ErrInvalidMM reports multimodal items that do not lie within the prompt.
var ErrInvalidMM = errors.New("router: multimodal item outside the prompt")

// checkMM validates a request's multimodal items against its prompt.
func checkMM(mm []MMItem, promptLen int) error {
	for i, it := range mm {
		if it.Offset < 0 || it.Length <= 0 || it.Offset > promptLen-it.Length {
			return fmt.Errorf("%w: item %d covers tokens [%d, %d+%d) of %d", ErrInvalidMM, i, it.Offset, it.Offset, it.Length, promptLen)
		}
	}
	return nil
}

// appendMMHashes rehashes, in local and seq (the hashes AppendHashes gave
// for tokens with h), every full block that overlaps one of mm's items with
// those items' identifiers, and rechains the sequence hashes from the first
// such block. matchable is how many leading blocks may be matched: all of
// them unless an item is unknown, else the blocks before the first block
// that holds part of an unknown item.
func appendMMHashes(h blockhash.Hasher, tokens []uint32, mm []MMItem, local, seq []uint64) (matchable int) {
	n := len(seq)
	matchable = n
	if len(mm) == 0 || n == 0 {
		return matchable
	}
	bs := h.BlockSize()
	type blockID struct {
		block int
		id    uint64
	}
	var ids []blockID
	for _, it := range mm {
		first := it.Offset / bs
		if !it.Known {
			matchable = min(matchable, first)
		}
		last := min((it.Offset+it.Length-1)/bs, n-1)
		for b := first; b <= last; b++ {
			ids = append(ids, blockID{b, it.Hash})
		}
	}
	if len(ids) == 0 {
		return matchable
	}
	slices.SortFunc(ids, func(a, b blockID) int { return a.block - b.block })
	var blockIDs []uint64
	for i := 0; i < len(ids); {
		b := ids[i].block
		blockIDs = blockIDs[:0]
		for ; i < len(ids) && ids[i].block == b; i++ {
			blockIDs = append(blockIDs, ids[i].id)
		}
		local[b] = h.LocalHashMM(tokens[b*bs:(b+1)*bs], blockIDs)
	}
	for b := ids[0].block; b < n; b++ {
		if b == 0 {
			seq[0] = local[0]
		} else {
			seq[b] = blockhash.Chain(seq[b-1], local[b])
		}
	}
	return matchable
}

// engineLocalHash is the local hash of block i of an engine's stored
// blocks: with the identifiers of the multimodal items it holds, if any.
func engineLocalHash(h blockhash.Hasher, es *EngineStored, i int) uint64 {
	block := es.Tokens[i*h.BlockSize() : (i+1)*h.BlockSize()]
	if i < len(es.MM) && len(es.MM[i]) > 0 {
		return h.LocalHashMM(block, es.MM[i])
	}
	return h.LocalHash(block)
}
