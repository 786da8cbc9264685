package hftokenizer

import (
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
)

// TestEncodeCases pins cases worth naming; the expected ids are the
// JavaScript reference's.
func TestEncodeCases(t *testing.T) {
	llama := loadTestTokenizer(t, "llama3_1")
	qwen := loadTestTokenizer(t, "qwen3")
	deepseek := loadTestTokenizer(t, "deepseek_v3")
	cases := []struct {
		name    string
		tok     *Tokenizer
		text    string
		special bool
		want    []uint32
	}{
		{"empty", llama, "", false, []uint32{}},
		{"empty adds BOS", llama, "", true, []uint32{128000}},
		{"template BOS", llama, "Hello", true, []uint32{128000, 9906}},
		{"no BOS without special tokens", llama, "Hello", false, []uint32{9906}},
		{"special token written literally", llama, "<|begin_of_text|>Hi<|eot_id|>", false, []uint32{128000, 13347, 128009}},
		{"broken special token is text", llama, "<|begin_of_text|", false, []uint32{27, 91, 7413, 3659, 4424, 91}},
		{"space run keeps its last space for the word", llama, "a    b", false, []uint32{64, 262, 293}},
		{"trailing spaces", llama, "a   ", false, []uint32{64, 262}},
		{"newlines absorb spaces before them", llama, "a  \n\n b", false, []uint32{64, 19124, 293}},
		{"digits in threes", llama, "1234567", false, []uint32{4513, 10961, 22}},
		{"contraction", llama, "I'M", false, []uint32{40, 28703}},
		{"qwen digits alone", qwen, "123", false, []uint32{16, 17, 18}},
		{"qwen chat markers", qwen, "<|im_start|>user\n", true, []uint32{151644, 872, 198}},
		{"add_bos_token from tokenizer_config", deepseek, "Hi", true, []uint32{0, 23166}},
		{"emoji ZWJ sequence", llama, "👨‍👩‍👧", false, []uint32{9468, 239, 101, 102470, 9468, 239, 102, 102470, 9468, 239, 100}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := c.tok.Encode(c.text, c.special)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, c.want) {
				t.Errorf("Encode(%q, %v) = %v, want %v", c.text, c.special, got, c.want)
			}
		})
	}
}

func TestEncodeInvalidUTF8(t *testing.T) {
	tok := loadTestTokenizer(t, "llama3")
	for _, s := range []string{"\xff", "abc\xc3", "a\xed\xa0\x80b"} {
		if _, err := tok.Encode(s, true); !errors.Is(err, ErrInvalidUTF8) {
			t.Errorf("Encode(%q) error = %v, want ErrInvalidUTF8", s, err)
		}
	}
}

// TestEncodeConcurrent shares one tokenizer (and its word cache) across
// goroutines, as the frontend will.
func TestEncodeConcurrent(t *testing.T) {
	tok := loadTestTokenizer(t, "llama3")
	text := strings.Repeat("The cache is shared by every request. ", 50)
	want, err := tok.Encode(text, true)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			got, err := tok.Encode(text, true)
			if err != nil || !slices.Equal(got, want) {
				t.Errorf("concurrent Encode differs: %v", err)
			}
		})
	}
	wg.Wait()
}

func TestLoadRejectsUnsupported(t *testing.T) {
	base := `{"added_tokens":[],"normalizer":null,"post_processor":null,
	"model":{"type":"BPE","vocab":{},"merges":[]},"pre_tokenizer":%s}`
	for _, pre := range []string{
		`{"type":"Split","pattern":{"Regex":"\\w+"},"behavior":"Isolated","invert":false}`,
		`{"type":"ByteLevel","add_prefix_space":false,"use_regex":true}`,
		`{"type":"Metaspace","replacement":"▁"}`,
	} {
		if _, err := New([]byte(strings.Replace(base, "%s", pre, 1)), nil); err == nil {
			t.Errorf("New accepted pre_tokenizer %s", pre)
		}
	}
}
