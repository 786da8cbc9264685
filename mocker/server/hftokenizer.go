package server

import (
	"bytes"
	"compress/gzip"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"unicode/utf8"

	"github.com/kvrouter/kvrouter/adapters/chattemplate"
	"github.com/kvrouter/kvrouter/adapters/hftokenizer"
	"github.com/kvrouter/kvrouter/mocker/tokenizer"
)

// codec turns requests into prompt token ids and generated ids into text:
// the mocker's own tokenizer by default, a model's real one with
// Config.Tokenizer.
type codec interface {
	// encodeText tokenizes a completion prompt; addSpecialTokens nil means
	// the engine's default.
	encodeText(text string, addSpecialTokens *bool) ([]uint32, error)
	// encodeChat applies the chat template and tokenizes the result.
	encodeChat(c chatInput) ([]uint32, error)
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
// fixed chat template.
type fakeCodec struct{}

func (fakeCodec) encodeText(text string, _ *bool) ([]uint32, error) {
	return tokenizer.Encode(text), nil
}

func (fakeCodec) encodeChat(c chatInput) ([]uint32, error) {
	msgs, err := messagesText(c.messages)
	if err != nil {
		return nil, err
	}
	return tokenizer.ApplyChatTemplate(msgs, c.addGenerationPrompt), nil
}

func (fakeCodec) vocabSize() int        { return tokenizer.VocabSize }
func (fakeCodec) word(id uint32) string { return tokenizer.Word(id) }

// Tokenizer is a model's Hugging Face tokenizer and chat template, so that
// the engine caches the token ids a router tokenizing with the same files
// computes. It is safe for concurrent use; one can serve many engines.
type Tokenizer struct {
	tok      *hftokenizer.Tokenizer
	template *chattemplate.Template // nil: tokenizer_config.json has no chat_template
	// gen are the ids generated tokens are drawn from: not special, and
	// valid UTF-8 on their own, so each streamed token is text by itself.
	gen []uint32
}

// LoadTokenizer reads the tokenizer at path, a directory holding
// tokenizer.json or that file itself (see hftokenizer.Load), and the chat
// template of the tokenizer_config.json beside it, if it has one.
func LoadTokenizer(path string) (*Tokenizer, error) {
	tok, err := hftokenizer.Load(path)
	if err != nil {
		return nil, fmt.Errorf("tokenizer %s: %w", path, err)
	}
	t := &Tokenizer{tok: tok}
	dir := path
	if st, err := os.Stat(path); err != nil || !st.IsDir() {
		dir = filepath.Dir(path)
	}
	cfgPath := filepath.Join(dir, "tokenizer_config.json")
	cfg, err := readMaybeGz(cfgPath)
	switch {
	case errors.Is(err, os.ErrNotExist):
	case err != nil:
		return nil, fmt.Errorf("tokenizer config %s: %w", cfgPath, err)
	default:
		var probe struct {
			ChatTemplate json.RawMessage `json:"chat_template"`
		}
		if err := json.Unmarshal(cfg, &probe); err != nil {
			return nil, fmt.Errorf("tokenizer config %s: %w", cfgPath, err)
		}
		if len(probe.ChatTemplate) > 0 && string(probe.ChatTemplate) != "null" {
			if t.template, err = chattemplate.Parse(cfg); err != nil {
				return nil, fmt.Errorf("tokenizer config %s: %w", cfgPath, err)
			}
		}
	}
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

// readMaybeGz reads name, or name.gz gunzipped if only that exists, as
// hftokenizer.Load reads its files.
func readMaybeGz(name string) ([]byte, error) {
	data, err := os.ReadFile(name)
	if !errors.Is(err, os.ErrNotExist) {
		return data, err
	}
	if data, err = os.ReadFile(name + ".gz"); err != nil {
		return nil, err
	}
	zr, err := gzip.NewReader(bytes.NewReader(data))
	if err != nil {
		return nil, err
	}
	return io.ReadAll(zr)
}

// HasChatTemplate tells whether chat requests can be served.
func (t *Tokenizer) HasChatTemplate() bool { return t.template != nil }

// encodeText adds special tokens unless told not to, as vLLM's completions
// and /tokenize of a prompt do.
func (t *Tokenizer) encodeText(text string, addSpecialTokens *bool) ([]uint32, error) {
	return t.tok.Encode(text, addSpecialTokens == nil || *addSpecialTokens)
}

// encodeChat renders the chat template and tokenizes the result without
// special tokens unless told otherwise, as vLLM does: the template writes
// the BOS itself.
func (t *Tokenizer) encodeChat(c chatInput) ([]uint32, error) {
	if t.template == nil {
		return nil, errors.New("the tokenizer has no chat template (tokenizer_config.json's chat_template), so chat requests cannot be served")
	}
	if len(c.messages) == 0 {
		return nil, errors.New("messages must not be empty")
	}
	text, err := t.template.Render(c.messages, chattemplate.Options{
		AddGenerationPrompt: c.addGenerationPrompt, Tools: c.tools, Kwargs: c.kwargs,
	})
	if err != nil {
		return nil, err
	}
	return t.tok.Encode(text, c.addSpecialTokens != nil && *c.addSpecialTokens)
}

func (t *Tokenizer) vocabSize() int { return t.tok.VocabSize() }

// word maps an id of the engine's generator, deterministic but of no
// vocabulary, onto an ordinary token of this one.
func (t *Tokenizer) word(id uint32) string {
	piece, _, _ := t.tok.Piece(t.gen[int(id)%len(t.gen)])
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
