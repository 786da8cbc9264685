package hftokenizer

import (
	"path/filepath"
	"testing"
)

// TestDecodeRoundTrip decodes the encoding of every corpus string back to
// the string (normalised as the tokenizer normalises it), with and without
// special tokens written literally in it.
func TestDecodeRoundTrip(t *testing.T) {
	corpus := readJSONLines[string](t, filepath.Join("testdata", "corpus.jsonl.gz"))
	for _, model := range []string{"llama3", "qwen3"} {
		t.Run(model, func(t *testing.T) {
			t.Parallel()
			tok := loadTestTokenizer(t, model)
			bad := 0
			for i, s := range corpus {
				ids, err := tok.Encode(s, false)
				if err != nil {
					t.Fatalf("string %d: %v", i, err)
				}
				got, err := tok.Decode(ids, false)
				if err != nil {
					t.Fatalf("string %d: %v", i, err)
				}
				want := s
				if tok.normalize != nil {
					want = tok.normalize(s)
				}
				if got != want && bad < 5 {
					bad++
					t.Errorf("string %d: Decode(Encode(%q)) = %q", i, truncate(want), truncate(got))
				}
			}
		})
	}
}

func TestDecodeSpecialTokens(t *testing.T) {
	llama := loadTestTokenizer(t, "llama3_1")
	qwen := loadTestTokenizer(t, "qwen3")
	cases := []struct {
		name string
		tok  *Tokenizer
		text string
		skip bool
		want string
	}{
		{"BOS kept", llama, "Hi", false, "<|begin_of_text|>Hi"},
		{"BOS skipped", llama, "Hi", true, "Hi"},
		{"literal specials skipped", llama, "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>", true, "user\n\nHi"},
		{"qwen chat markers", qwen, "<|im_start|>user\nHi<|im_end|>", false, "<|im_start|>user\nHi<|im_end|>"},
		// <think> is an added token that is not special: skipping keeps it.
		{"non-special added token kept", qwen, "<think>\nx</think>", true, "<think>\nx</think>"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ids, err := c.tok.Encode(c.text, true)
			if err != nil {
				t.Fatal(err)
			}
			got, err := c.tok.Decode(ids, c.skip)
			if err != nil {
				t.Fatal(err)
			}
			if got != c.want {
				t.Errorf("Decode(%v, %v) = %q, want %q", ids, c.skip, got, c.want)
			}
		})
	}
}

func TestDecodeInvalid(t *testing.T) {
	tok := loadTestTokenizer(t, "llama3")
	if _, err := tok.Decode([]uint32{uint32(tok.VocabSize())}, false); err == nil {
		t.Error("Decode accepted an id past the vocabulary")
	}
	// 9468 is the first 3 bytes of an emoji's 4 (see TestEncodeCases): one
	// U+FFFD for the truncated sequence, as Rust's from_utf8_lossy.
	got, err := tok.Decode([]uint32{9468, 64}, false)
	if err != nil {
		t.Fatal(err)
	}
	if got != "\uFFFDa" {
		t.Errorf("Decode of a truncated emoji = %q, want %q", got, "\uFFFDa")
	}
	for s, want := range map[string]string{
		"\xff\xfe":     "\uFFFD\uFFFD",
		"\xed\xa0\x80": "\uFFFD\uFFFD\uFFFD", // a surrogate: E0-ED's second byte is out of range
		"\xf0\x9f\x98": "\uFFFD",
		"a\xc3":        "a\uFFFD",
	} {
		if got := lossyUTF8(s); got != want {
			t.Errorf("lossyUTF8(%q) = %q, want %q", s, got, want)
		}
	}
}
