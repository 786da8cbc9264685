package vllmevents

import (
	"strings"
	"testing"
)

// The cases are the shapes vLLM's generate_block_hash_extra_keys builds
// for block 0 (LoRA name, multimodal items, cache salt, prompt-embeds
// digest, in that order), before and after 0.19's (identifier, offset)
// pairs.
func TestCacheSaltFromExtraKeys(t *testing.T) {
	str := func(s string) ExtraKey { return ExtraKey{Kind: ExtraString, Str: s} }
	pair := func(s string, off int64) ExtraKey { return ExtraKey{Kind: ExtraIdentifierOffset, Str: s, Offset: off} }
	digest := strings.Repeat("ab12", 16)
	for _, tc := range []struct {
		name   string
		keys   [][]ExtraKey
		lora   string
		bareMM bool
		want   string
	}{
		{"no keys", nil, "", false, ""},
		{"first block without keys", [][]ExtraKey{nil, {str("x")}}, "", false, ""},
		{"salt only", [][]ExtraKey{{str("tenant-a")}}, "", false, "tenant-a"},
		{"salt only, old engine", [][]ExtraKey{{str("tenant-a")}}, "", true, "tenant-a"},
		{"adapter only", [][]ExtraKey{{str("sql")}}, "sql", false, ""},
		{"adapter and salt", [][]ExtraKey{{str("sql"), str("tenant-a")}}, "sql", false, "tenant-a"},
		{"salt equal to the adapter", [][]ExtraKey{{str("sql"), str("sql")}}, "sql", false, "sql"},
		{"adapter name not sent as lora_name", [][]ExtraKey{{str("sql"), str("t")}}, "", false, "t"},
		{"image then salt", [][]ExtraKey{{pair(digest, 3), str("tenant-a")}}, "", false, "tenant-a"},
		{"image, no salt", [][]ExtraKey{{pair("my-uuid", 0)}}, "", false, ""},
		{"adapter, image, salt", [][]ExtraKey{{str("sql"), pair("img", -2), str("tenant-a")}}, "sql", false, "tenant-a"},
		{"hex salt on a new engine", [][]ExtraKey{{str(digest)}}, "", false, digest},
		{"old engine: bare image, no salt", [][]ExtraKey{{str(digest)}}, "", true, ""},
		{"old engine: bare image then salt", [][]ExtraKey{{str(digest), str("tenant-a")}}, "", true, "tenant-a"},
		{"old engine: adapter, two images", [][]ExtraKey{{str("sql"), str(digest), str(strings.Repeat("0", 64))}}, "sql", true, ""},
		{"prompt embeds are no salt", [][]ExtraKey{{{Kind: ExtraBytes, Bytes: []byte("tenant-a")}}}, "", false, ""},
		{"salt then prompt embeds", [][]ExtraKey{{str("tenant-a"), {Kind: ExtraBytes, Bytes: []byte{1}}}}, "", false, "tenant-a"},
		{"scalars are no salt", [][]ExtraKey{{{Kind: ExtraInt, Offset: 4}, {Kind: ExtraOther}}}, "", false, ""},
	} {
		if got := CacheSalt(tc.keys, tc.lora, tc.bareMM); got != tc.want {
			t.Errorf("%s: salt %q, want %q", tc.name, got, tc.want)
		}
	}
	if !HasOffsetMM([][]ExtraKey{nil, {pair("a", 0)}}) || HasOffsetMM([][]ExtraKey{{str("a")}}) {
		t.Error("HasOffsetMM")
	}
}
