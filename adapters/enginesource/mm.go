package enginesource

import (
	"errors"

	"github.com/kvrouter/kvrouter/adapters/vllmevents"
	"github.com/kvrouter/kvrouter/core/blockhash"
)

// mmIdentifiers reads, per block, the identifiers of the multimodal items
// an engine's extra_keys place on it (router.EngineStored.MM), as Dynamo
// reads them: an (identifier, offset) pair (vLLM ≥ 0.19) is an item
// whatever its identifier; a bare string (before 0.19) is one only when it
// is a 64-hex-digit digest other than the adapter's name, since a bare
// string may also be the LoRA name or the cache salt. A client's own item
// id (vLLM's uuid) thus reaches the router only from engines of 0.19 on;
// before, such a block is indexed by its tokens alone, which no request
// carrying the item matches (a miss, never a false match). nil when no
// block holds an item.
func mmIdentifiers(keys [][]vllmevents.ExtraKey, lora string) [][]uint64 {
	var out [][]uint64
	for b, block := range keys {
		for _, k := range block {
			var id uint64
			var ok bool
			switch {
			case k.Kind == vllmevents.ExtraIdentifierOffset:
				id, ok = blockhash.HashMMIdentifier(k.Str)
			case k.Kind == vllmevents.ExtraString && k.Str != lora && len(k.Str) == 64:
				id, ok = blockhash.HashMMIdentifier(k.Str)
				// A 64-character string that is no digest is a salt.
				ok = ok && isDigest(k.Str)
			}
			if !ok {
				continue
			}
			if out == nil {
				out = make([][]uint64, len(keys))
			}
			out[b] = append(out[b], id)
		}
	}
	return out
}

func isDigest(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F') {
			return false
		}
	}
	return true
}

// errMisalignedExtraKeys: extra_keys must hold one entry per block; an
// event whose do not is indexed apart (see apartMarks), never by its
// tokens alone.
var errMisalignedExtraKeys = errors.New("extra_keys: not one entry per block")
