package server

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"unicode/utf8"

	"github.com/kvrouter/kvrouter/adapters/chattemplate"
	"github.com/kvrouter/kvrouter/adapters/modeltok"
	"github.com/kvrouter/kvrouter/mocker/engine"
	"github.com/kvrouter/kvrouter/mocker/tokenizer"
)

// codec turns requests into prompt token ids and generated ids into text:
// the mocker's own tokenizer by default, a model's real one with
// Config.Tokenizer.
type codec interface {
	// encodeText tokenizes a completion prompt; addSpecialTokens nil means
	// the engine's default.
	encodeText(text string, addSpecialTokens *bool) ([]uint32, error)
	// encodeChat applies the chat template and tokenizes the result; mm
	// places the chat's media items on the tokens.
	encodeChat(c chatInput) (ids []uint32, mm []engine.MMFeature, err error)
	vocabSize() int
	// word is the text of a generated token.
	word(id uint32) string
}

// chatInput is what the chat template sees of a request, plus
// add_special_tokens.
type chatInput struct {
	messages            []json.RawMessage
	addGenerationPrompt bool
	addSpecialTokens    *bool
	tools               json.RawMessage
	kwargs              map[string]any
}

// fakeCodec is the mocker's own tokenizer, which has no BOS to add and a
// fixed chat template; mmTokens is the placeholder tokens per media item.
type fakeCodec struct{ mmTokens int }

func (fakeCodec) encodeText(text string, _ *bool) ([]uint32, error) {
	return tokenizer.Encode(text), nil
}

func (f fakeCodec) encodeChat(c chatInput) ([]uint32, []engine.MMFeature, error) {
	msgs, items, err := messagesText(c.messages)
	if err != nil {
		return nil, nil, err
	}
	return expandPlaceholders(tokenizer.ApplyChatTemplate(msgs, c.addGenerationPrompt), items, f.mmTokens)
}

func (fakeCodec) vocabSize() int        { return tokenizer.VocabSize }
func (fakeCodec) word(id uint32) string { return tokenizer.Word(id) }

// Tokenizer is a model's Hugging Face tokenizer and chat template, so that
// the engine caches the token ids a router tokenizing with the same files
// (adapters/modeltok, the same code) computes. It is safe for concurrent
// use; one can serve many engines.
type Tokenizer struct {
	m *modeltok.Model
	// gen are the ids generated tokens are drawn from: not special, and
	// valid UTF-8 on their own, so each streamed token is text by itself.
	gen []uint32
}

// LoadTokenizer reads the tokenizer at path, a directory holding
// tokenizer.json or that file itself (see hftokenizer.Load), and the chat
// template of the tokenizer_config.json beside it, if it has one.
func LoadTokenizer(path string) (*Tokenizer, error) {
	m, err := modeltok.Load(path)
	if err != nil {
		return nil, err
	}
	t := &Tokenizer{m: m}
	tok := m.Tokenizer()
	for id := range uint32(tok.VocabSize()) {
		if piece, special, ok := tok.Piece(id); ok && !special && piece != "" && utf8.ValidString(piece) {
			t.gen = append(t.gen, id)
		}
	}
	if len(t.gen) == 0 {
		return nil, fmt.Errorf("tokenizer %s: no ordinary tokens to generate", path)
	}
	return t, nil
}

// HasChatTemplate tells whether chat requests can be served.
func (t *Tokenizer) HasChatTemplate() bool { return t.m.HasChatTemplate() }

// encodeText adds special tokens unless told not to, as vLLM's completions
// and /tokenize of a prompt do.
func (t *Tokenizer) encodeText(text string, addSpecialTokens *bool) ([]uint32, error) {
	return t.m.EncodeText(text, addSpecialTokens == nil || *addSpecialTokens)
}

// encodeChat renders the chat template and tokenizes the result without
// special tokens unless told otherwise, as vLLM does: the template writes
// the BOS itself.
func (t *Tokenizer) encodeChat(c chatInput) ([]uint32, []engine.MMFeature, error) {
	if !t.m.HasChatTemplate() {
		return nil, nil, errors.New("the tokenizer has no chat template (tokenizer_config.json's chat_template), so chat requests cannot be served")
	}
	if len(c.messages) == 0 {
		return nil, nil, errors.New("messages must not be empty")
	}
	ids, _, err := t.m.EncodeChat(c.messages, chattemplate.Options{
		AddGenerationPrompt: c.addGenerationPrompt, Tools: c.tools, Kwargs: c.kwargs,
	}, c.addSpecialTokens != nil && *c.addSpecialTokens)
	return ids, nil, err
}

func (t *Tokenizer) vocabSize() int { return t.m.Tokenizer().VocabSize() }

// word maps an id of the engine's generator, deterministic but of no
// vocabulary, onto an ordinary token of this one.
func (t *Tokenizer) word(id uint32) string {
	piece, _, _ := t.m.Tokenizer().Piece(t.gen[int(id)%len(t.gen)])
	return piece
}

// appendJSONString appends s as a JSON string. Mocker words are printable
// ASCII, which strconv quotes as JSON does; real tokens may not be.
func appendJSONString(b []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		if s[i] < 0x20 || s[i] > 0x7e {
			q, _ := json.Marshal(s)
			return append(b, q...)
		}
	}
	return strconv.AppendQuote(b, s)
}
