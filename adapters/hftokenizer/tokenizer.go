// Package hftokenizer encodes text to token ids exactly as a Hugging Face
// tokenizer.json does, so the frontend can tokenize prompts in process
// instead of asking an engine's /tokenize. It covers byte-level BPE
// tokenizers (Llama 3, Qwen, DeepSeek V3, gpt-oss); Load rejects what it
// cannot reproduce exactly rather than approximating it. Decode turns ids
// back into text, for the simulated engine's generated tokens.
package hftokenizer

import (
	"errors"
	"strings"
	"sync"
	"unicode"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
)

// ErrInvalidUTF8 is returned for text that is not valid UTF-8. Hugging Face
// tokenizers only accept Unicode strings (Python's str, JavaScript's string),
// so such input has no reference encoding to reproduce; substituting U+FFFD
// as decoders do would silently change the prompt the engine sees.
var ErrInvalidUTF8 = errors.New("hftokenizer: text is not valid UTF-8")

// Tokenizer encodes text and decodes ids; it is safe for concurrent use.
type Tokenizer struct {
	vocab        map[string]uint32 // raw bytes -> id
	byteIDs      [256]uint32
	merges       map[uint64]uint64 // left id<<32|right id -> rank<<32|merged id
	ignoreMerges bool

	added []addedToken // longest first
	// addedLens are the lengths of the added tokens by their first byte,
	// longest first, and addedByContent finds them: a match is a few map
	// lookups where there are hundreds of tokens sharing "<|".
	addedLens      [256][]int
	addedByContent map[string][]int32

	normalize      func(string) string
	splits         []matcher
	addPrefixSpace bool

	hasTemplate    bool
	prefix, suffix []uint32 // added around the text when special tokens are

	pieces []string    // id -> the bytes it decodes to
	kinds  []pieceKind // id -> what pieces[id] is

	cache wordCache
}

type addedToken struct {
	content                    string
	id                         uint32
	lstrip, rstrip, singleWord bool
}

// Encode returns the token ids of text. addSpecialTokens adds what the
// tokenizer's post-processor (or tokenizer_config.json's add_bos_token)
// puts around a single sequence, typically a BOS token, as engines do for
// completion prompts. Added and special tokens written literally in text are
// always recognized, as in Hugging Face's tokenizers.
func (t *Tokenizer) Encode(text string, addSpecialTokens bool) ([]uint32, error) {
	if !utf8.ValidString(text) {
		return nil, ErrInvalidUTF8
	}
	ids := make([]uint32, 0, len(text)/3+len(t.prefix)+len(t.suffix)+1)
	if addSpecialTokens {
		ids = append(ids, t.prefix...)
	}
	return t.encodeFrom(text, 0, ids, addSpecialTokens, nil), nil
}

// encodeFrom encodes text[start:] after ids, the encoding of text[:start]
// up to a cut (start 0, or right after an added token). With cuts, it
// records every cut it passes.
func (t *Tokenizer) encodeFrom(text string, start int, ids []uint32, addSpecialTokens bool, cuts *[]Cut) []uint32 {
	for i := start; i < len(text); {
		a, ok := t.addedAt(text, i)
		if !ok {
			i++
			continue
		}
		section := text[start:i]
		if a.lstrip {
			section = strings.TrimRightFunc(section, unicode.IsSpace)
		}
		ids = t.encodeSection(section, ids)
		ids = append(ids, a.id)
		i += len(a.content)
		if a.rstrip {
			i = len(text) - len(strings.TrimLeftFunc(text[i:], unicode.IsSpace))
		}
		start = i
		if cuts != nil {
			*cuts = append(*cuts, Cut{Text: start, IDs: len(ids)})
		}
	}
	ids = t.encodeSection(text[start:], ids)
	if addSpecialTokens {
		ids = append(ids, t.suffix...)
	}
	return ids
}

// addedAt returns the longest added token that starts at byte i of text.
func (t *Tokenizer) addedAt(text string, i int) (*addedToken, bool) {
	for _, n := range t.addedLens[text[i]] {
		if i+n > len(text) {
			continue
		}
		for _, k := range t.addedByContent[text[i:i+n]] {
			a := &t.added[k]
			if a.singleWord && !isWordBoundary(text, i, i+n) {
				continue
			}
			return a, true
		}
	}
	return nil, false
}

// isWordBoundary tells whether text[i:j] stands alone: no word rune touches
// it on either side (single_word added tokens).
func isWordBoundary(text string, i, j int) bool {
	isWord := func(r rune) bool { return r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r) }
	if i > 0 {
		if r, _ := utf8.DecodeLastRuneInString(text[:i]); isWord(r) {
			return false
		}
	}
	if j < len(text) {
		if r, _ := utf8.DecodeRuneInString(text[j:]); isWord(r) {
			return false
		}
	}
	return true
}

func (t *Tokenizer) encodeSection(s string, ids []uint32) []uint32 {
	if s == "" {
		return ids
	}
	if t.normalize != nil {
		if s = t.normalize(s); s == "" {
			return ids
		}
	}
	if t.addPrefixSpace && s[0] != ' ' {
		s = " " + s
	}
	return t.split(0, s, ids)
}

// split applies the level-th Split pre-tokenizer to s and hands each piece
// to the next, the last one's pieces to BPE. Text between two matches is a
// piece of its own, as the Isolated behaviour keeps it.
func (t *Tokenizer) split(level int, s string, ids []uint32) []uint32 {
	if level == len(t.splits) {
		return t.encodeWord(s, ids)
	}
	m := t.splits[level]
	prev := 0
	for i := 0; i < len(s); {
		e := m(s, i)
		if e <= i {
			_, n := decode(s, i)
			i += n
			continue
		}
		if prev < i {
			ids = t.split(level+1, s[prev:i], ids)
		}
		ids = t.split(level+1, s[i:e], ids)
		prev, i = e, e
	}
	if prev < len(s) {
		ids = t.split(level+1, s[prev:], ids)
	}
	return ids
}

func nfc(s string) string {
	for i := 0; i < len(s); i++ {
		if s[i] >= utf8.RuneSelf {
			return norm.NFC.String(s)
		}
	}
	return s
}

// maxCachedWord bounds the words worth caching: long ones rarely repeat.
const (
	maxCachedWord  = 64
	maxCachedWords = 1 << 16
)

type wordCache struct {
	mu sync.Mutex
	m  map[string][]uint32
}

func (c *wordCache) get(w string) ([]uint32, bool) {
	c.mu.Lock()
	ids, ok := c.m[w]
	c.mu.Unlock()
	return ids, ok
}

func (c *wordCache) put(w string, ids []uint32) {
	c.mu.Lock()
	if len(c.m) >= maxCachedWords {
		clear(c.m)
	}
	c.m[strings.Clone(w)] = ids
	c.mu.Unlock()
}

// encodeWord appends the BPE encoding of one pre-tokenized word.
func (t *Tokenizer) encodeWord(w string, ids []uint32) []uint32 {
	if len(w) == 1 {
		return append(ids, t.byteIDs[w[0]])
	}
	if t.ignoreMerges {
		if id, ok := t.vocab[w]; ok {
			return append(ids, id)
		}
	}
	cacheable := len(w) <= maxCachedWord
	if cacheable {
		if cached, ok := t.cache.get(w); ok {
			return append(ids, cached...)
		}
	}
	start := len(ids)
	ids = t.bpe(w, ids)
	if cacheable {
		t.cache.put(w, append([]uint32(nil), ids[start:]...))
	}
	return ids
}

// bpe merges the bytes of w, always applying the lowest-ranked merge among
// adjacent symbols, leftmost first on ties, as Hugging Face's BPE does. The
// symbols live in ids[start:], so no per-word allocation is needed; ranks
// caches each adjacent pair's merge so a step costs one scan, not one map
// lookup per pair.
func (t *Tokenizer) bpe(w string, ids []uint32) []uint32 {
	start := len(ids)
	for i := 0; i < len(w); i++ {
		ids = append(ids, t.byteIDs[w[i]])
	}
	sym := ids[start:]
	var stack [maxCachedWord]uint64
	ranks := stack[:0]
	if len(sym)-1 > len(stack) {
		ranks = make([]uint64, 0, len(sym)-1)
	}
	for i := 0; i+1 < len(sym); i++ {
		ranks = append(ranks, t.merge(sym[i], sym[i+1]))
	}
	for len(sym) > 1 {
		best, bi := noMerge, -1
		for i, r := range ranks {
			if r < best {
				best, bi = r, i
			}
		}
		if bi < 0 {
			break
		}
		sym[bi] = uint32(best)
		copy(sym[bi+1:], sym[bi+2:])
		sym = sym[:len(sym)-1]
		copy(ranks[bi:], ranks[bi+1:])
		ranks = ranks[:len(ranks)-1]
		if bi > 0 {
			ranks[bi-1] = t.merge(sym[bi-1], sym[bi])
		}
		if bi < len(ranks) {
			ranks[bi] = t.merge(sym[bi], sym[bi+1])
		}
	}
	return ids[:start+len(sym)]
}

const noMerge = ^uint64(0)

func (t *Tokenizer) merge(a, b uint32) uint64 {
	if v, ok := t.merges[uint64(a)<<32|uint64(b)]; ok {
		return v
	}
	return noMerge
}
