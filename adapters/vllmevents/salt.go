package vllmevents

// CacheSalt returns the cache_salt a request's blocks were computed under,
// read from the extra keys of the event's first block (vLLM adds the salt
// to the request's first block only, after its LoRA name and its
// multimodal items), or "" when there is none. loraName is the event's
// lora_name.
//
// The rule, on block 0's keys in order: the first string equal to loraName
// is the adapter, not a salt (a salt equal to the adapter's name is the
// second such string); (identifier, offset) pairs, bytes and scalars are
// never a salt; of the strings left, the last is the salt, since vLLM
// appends it after the multimodal items.
//
// Before 0.19, vLLM wrote multimodal identifiers as bare strings too, so
// the salt cannot be told from an item then: a bare identifier in block 0
// without a salt is taken for one. That costs credit, never a false match:
// the router then keys the blocks by a salt no request carries (see
// StrayStrings for the other bare strings).
func CacheSalt(keys [][]ExtraKey, loraName string) string {
	if len(keys) == 0 {
		return ""
	}
	salt, _ := classify(keys[0], loraName, true)
	return salt
}

// StrayStrings reports whether a block's extra keys hold bare strings that
// are neither its adapter's name nor, on the event's first block (first),
// the salt: multimodal identifiers as vLLM wrote them before 0.19, or keys
// of an engine kvrouter does not know.
func StrayStrings(block []ExtraKey, loraName string, first bool) bool {
	_, stray := classify(block, loraName, first)
	return stray
}

func classify(block []ExtraKey, loraName string, first bool) (salt string, stray bool) {
	adapter := loraName != ""
	n := 0
	for _, k := range block {
		if k.Kind != ExtraString {
			continue
		}
		if adapter && k.Str == loraName {
			adapter = false
			continue
		}
		salt = k.Str
		n++
	}
	if !first {
		return "", n > 0
	}
	return salt, n > 1
}
