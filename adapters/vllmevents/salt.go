package vllmevents

// CacheSalt returns the cache_salt a request's blocks were computed under,
// read from the extra keys of the event's first block (vLLM adds the salt
// to the request's first block only, after its LoRA name and its
// multimodal items), or "" when there is none. loraName is the event's
// lora_name. bareMM says whether the engine may write multimodal
// identifiers as bare strings (vLLM before 0.19, which had no offsets);
// an engine seen sending (identifier, offset) pairs does not.
//
// The rule, on block 0's keys in order:
//   - the first string equal to loraName is the adapter, not a salt (a
//     salt equal to the adapter's name is the second such string);
//   - (identifier, offset) pairs, bytes and scalars are never a salt;
//   - of the strings left, the last is the salt: vLLM appends it after the
//     multimodal items; except that, with bareMM, a string of 64 hex
//     digits is taken for a multimodal identifier (vLLM's own item hashes
//     look so), since the engine's own shape cannot tell them apart.
//
// A misread costs cache credit, never a false match: the router then
// hashes the engine's blocks under a key no request carries.
func CacheSalt(keys [][]ExtraKey, loraName string, bareMM bool) string {
	if len(keys) == 0 {
		return ""
	}
	adapter := loraName != ""
	last := ""
	for _, k := range keys[0] {
		if k.Kind != ExtraString {
			continue
		}
		if adapter && k.Str == loraName {
			adapter = false
			continue
		}
		last = k.Str
	}
	if bareMM && isDigest(last) {
		return ""
	}
	return last
}

// isDigest reports whether s looks like vLLM's multimodal item hash: 64
// hex digits.
func isDigest(s string) bool {
	if len(s) != 64 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !('0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F') {
			return false
		}
	}
	return true
}

// HasOffsetMM reports whether keys hold an (identifier, offset) pair: the
// engine writes multimodal items the way vLLM 0.19 and later do.
func HasOffsetMM(keys [][]ExtraKey) bool {
	for _, block := range keys {
		for _, k := range block {
			if k.Kind == ExtraIdentifierOffset {
				return true
			}
		}
	}
	return false
}
