package vllmevents

import (
	"strings"
	"testing"
)

// The cases are the shapes vLLM's generate_block_hash_extra_keys builds
// (LoRA name, multimodal items, cache salt on block 0, prompt-embeds
// digest, in that order), before and after 0.19's (identifier, offset)
// pairs.
func TestCacheSaltFromExtraKeys(t *testing.T) {
	str := func(s string) ExtraKey { return ExtraKey{Kind: ExtraString, Str: s} }
	pair := func(s string, off int64) ExtraKey { return ExtraKey{Kind: ExtraIdentifierOffset, Str: s, Offset: off} }
	digest := strings.Repeat("ab12", 16)
	for _, tc := range []struct {
		name  string
		keys  [][]ExtraKey
		lora  string
		salt  string
		stray []bool // per block
	}{
		{"no keys", nil, "", "", nil},
		{"first block without keys", [][]ExtraKey{nil, {str("x")}}, "", "", []bool{false, true}},
		{"salt only", [][]ExtraKey{{str("tenant-a")}}, "", "tenant-a", []bool{false}},
		{"adapter only", [][]ExtraKey{{str("sql")}, {str("sql")}}, "sql", "", []bool{false, false}},
		{"adapter and salt", [][]ExtraKey{{str("sql"), str("tenant-a")}, {str("sql")}}, "sql", "tenant-a", []bool{false, false}},
		{"salt equal to the adapter", [][]ExtraKey{{str("sql"), str("sql")}, {str("sql")}}, "sql", "sql", []bool{false, false}},
		{"adapter name not sent as lora_name", [][]ExtraKey{{str("sql"), str("t")}}, "", "t", []bool{true}},
		{"image then salt", [][]ExtraKey{{pair(digest, 3), str("tenant-a")}, {pair(digest, -13)}}, "", "tenant-a", []bool{false, false}},
		{"image, no salt", [][]ExtraKey{{pair("my-uuid", 0)}}, "", "", []bool{false}},
		{"adapter, image, salt", [][]ExtraKey{{str("sql"), pair("img", -2), str("tenant-a")}}, "sql", "tenant-a", []bool{false}},
		{"salt of 64 hex digits", [][]ExtraKey{{str(digest)}}, "", digest, []bool{false}},
		{"before 0.19: bare image, no salt", [][]ExtraKey{{str(digest)}, {str(digest)}}, "", digest, []bool{false, true}},
		{"before 0.19: bare image then salt", [][]ExtraKey{{str(digest), str("tenant-a")}}, "", "tenant-a", []bool{true}},
		{"prompt embeds are no salt", [][]ExtraKey{{{Kind: ExtraBytes, Bytes: []byte("tenant-a")}}}, "", "", []bool{false}},
		{"salt then prompt embeds", [][]ExtraKey{{str("tenant-a"), {Kind: ExtraBytes, Bytes: []byte{1}}}}, "", "tenant-a", []bool{false}},
		{"scalars are no salt", [][]ExtraKey{{{Kind: ExtraInt, Offset: 4}, {Kind: ExtraOther}}}, "", "", []bool{false}},
	} {
		if got := CacheSalt(tc.keys, tc.lora); got != tc.salt {
			t.Errorf("%s: salt %q, want %q", tc.name, got, tc.salt)
		}
		for i, want := range tc.stray {
			if got := StrayStrings(tc.keys[i], tc.lora, i == 0); got != want {
				t.Errorf("%s: block %d stray strings %v, want %v", tc.name, i, got, want)
			}
		}
	}
}
