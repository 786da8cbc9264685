package hftokenizer

import (
	"errors"
	"slices"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Encoding is a text's ids with its cuts: the places right after an added
// token, where Hugging Face's tokenizers encode what follows on its own.
// The ids before a cut therefore hold for every text with the same bytes up
// to it, which is what lets a growing conversation be encoded from its
// last cut instead of from the start.
type Encoding struct {
	Text             string
	IDs              []uint32
	Cuts             []Cut // ascending
	AddSpecialTokens bool
}

var errResumeMismatch = errors.New("hftokenizer: resuming a text that does not start as the encoding did")

// Cut is a place an encoding can resume from: text offset and ids before it.
type Cut struct{ Text, IDs int }

// EncodeCuts is Encode, also recording the cuts.
func (t *Tokenizer) EncodeCuts(text string, addSpecialTokens bool) (*Encoding, error) {
	if !utf8.ValidString(text) {
		return nil, ErrInvalidUTF8
	}
	e := &Encoding{Text: text, AddSpecialTokens: addSpecialTokens}
	ids := make([]uint32, 0, len(text)/3+len(t.prefix)+len(t.suffix)+1)
	if addSpecialTokens {
		ids = append(ids, t.prefix...)
	}
	e.IDs = t.encodeFrom(text, 0, ids, addSpecialTokens, &e.Cuts)
	return e, nil
}

// Resume encodes text, which must have prev.Text's bytes up to
// prev.Cuts[cut], reusing prev's ids up to there: the same ids as
// EncodeCuts(text, prev.AddSpecialTokens), for the cost of what follows
// the cut.
func (t *Tokenizer) Resume(prev *Encoding, cut int, text string) (*Encoding, error) {
	c := prev.Cuts[cut]
	if len(text) < c.Text || text[:c.Text] != prev.Text[:c.Text] {
		return nil, errResumeMismatch
	}
	if !utf8.ValidString(text[c.Text:]) {
		return nil, ErrInvalidUTF8
	}
	e := &Encoding{Text: text, AddSpecialTokens: prev.AddSpecialTokens, Cuts: slices.Clone(prev.Cuts[:cut+1])}
	ids := make([]uint32, c.IDs, c.IDs+(len(text)-c.Text)/3+len(t.suffix)+1)
	copy(ids, prev.IDs[:c.IDs])
	e.IDs = t.encodeFrom(text, c.Text, ids, prev.AddSpecialTokens, &e.Cuts)
	return e, nil
}

// CutPoints are the text offsets of text's cuts, as EncodeCuts would record
// them, found without encoding: for looking up an earlier encoding.
func (t *Tokenizer) CutPoints(text string, dst []int) []int {
	for i := 0; i < len(text); {
		a, ok := t.addedAt(text, i)
		if !ok {
			i++
			continue
		}
		i += len(a.content)
		if a.rstrip {
			i = len(text) - len(strings.TrimLeftFunc(text[i:], unicode.IsSpace))
		}
		dst = append(dst, i)
	}
	return dst
}
