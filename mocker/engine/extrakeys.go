package engine

import (
	"encoding/binary"

	"github.com/kvrouter/kvrouter/core/blockhash"

	"github.com/zeebo/xxh3"
)

// A vLLM engine keys a cached block by more than its tokens: the request's
// LoRA adapter, the multimodal items whose placeholders the block holds,
// and the request's cache_salt on its first block all enter the block hash
// (vllm/v1/core/kv_cache_utils.py, generate_block_hash_extra_keys), so the
// same tokens under another adapter, image or salt are another block. The
// mocker does the same and publishes each block's extra keys in BlockStored
// as vLLM does, so a router that ignored them would credit blocks the
// engine never reuses.

// MMFeature is one multimodal item of a prompt: an identifier (vLLM's
// mm_hash, or the client's uuid) and the span of its placeholder tokens.
type MMFeature struct {
	Identifier     string
	Offset, Length int
}

// requestKeys are what a request adds to its blocks' identity; nil for a
// plain request.
type requestKeys struct {
	lora, salt string
	mm         []MMFeature // sorted by Offset, spans within the prompt
	// keyed hashes the request's blocks under Config.SequenceHashIDs,
	// once made.
	keyed    blockhash.Hasher
	hasKeyed bool
}

// hasher is the request's blocks' hasher under Config.SequenceHashIDs:
// keyed by its adapter and salt as the router keys it.
func (k *requestKeys) hasher(blockSize int) blockhash.Hasher {
	if !k.hasKeyed {
		k.keyed, k.hasKeyed = blockhash.NewKeyed(blockSize, k.lora, k.salt), true
	}
	return k.keyed
}

func newRequestKeys(r *Request) *requestKeys {
	if r.LoRA == "" && r.CacheSalt == "" && len(r.MM) == 0 {
		return nil
	}
	return &requestKeys{lora: r.LoRA, salt: r.CacheSalt, mm: r.MM}
}

// block returns the extra keys of block i (tokens [i·bs, (i+1)·bs)) in
// vLLM's order: LoRA name, each item overlapping the block as (identifier,
// item offset − block start), then the salt on the first block. nil when
// it has none.
func (k *requestKeys) block(i, bs int) []any {
	if k == nil {
		return nil
	}
	var keys []any
	if k.lora != "" {
		keys = append(keys, k.lora)
	}
	start, end := i*bs, (i+1)*bs
	for _, f := range k.mm {
		if f.Offset < end && f.Offset+f.Length > start {
			keys = append(keys, []any{f.Identifier, f.Offset - start})
		}
	}
	if i == 0 && k.salt != "" {
		keys = append(keys, k.salt)
	}
	return keys
}

// fold reduces a block's extra keys to one word mixed into its id; 0 when
// there are none, so plain blocks keep the ids they always had.
func foldKeys(keys []any) uint64 {
	if len(keys) == 0 {
		return 0
	}
	var b []byte
	for _, k := range keys {
		switch v := k.(type) {
		case string:
			b = append(b, 's')
			b = binary.LittleEndian.AppendUint64(b, uint64(len(v)))
			b = append(b, v...)
		case []any:
			id, off := v[0].(string), v[1].(int)
			b = append(b, 'm')
			b = binary.LittleEndian.AppendUint64(b, uint64(len(id)))
			b = append(b, id...)
			b = binary.LittleEndian.AppendUint64(b, uint64(off))
		}
	}
	return xxh3.Hash(b) | 1
}

// slotKeys are a cached block's adapter and extra keys.
type slotKeys struct {
	lora string
	keys []any
}

func (m *blockManager) setKeys(idx int32, k *requestKeys, i int) {
	if k == nil {
		return
	}
	keys := k.block(i, m.blockSize)
	if keys == nil && k.lora == "" {
		return
	}
	if m.extra == nil {
		m.extra = map[int32]slotKeys{}
	}
	m.extra[idx] = slotKeys{lora: k.lora, keys: keys}
}

// blockKeys are the extra keys of blocks [from, to), nil when none has any.
func blockKeys(k *requestKeys, from, to, bs int) [][]any {
	var out [][]any
	for i := from; i < to; i++ {
		if keys := k.block(i, bs); keys != nil {
			if out == nil {
				out = make([][]any, to-from)
			}
			out[i-from] = keys
		}
	}
	return out
}

func validMM(mm []MMFeature, promptLen int) bool {
	prev := 0
	for _, f := range mm {
		if f.Length <= 0 || f.Offset < prev || f.Offset+f.Length > promptLen || f.Identifier == "" {
			return false
		}
		prev = f.Offset
	}
	return true
}
