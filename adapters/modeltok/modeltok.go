// Package modeltok puts a model's tokenizer and chat template together:
// what the frontend needs to turn a request's text or messages into the
// token ids its engines will compute, without asking an engine.
package modeltok

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/kvrouter/kvrouter/adapters/chattemplate"
	"github.com/kvrouter/kvrouter/adapters/hftokenizer"
)

// ErrNoChatTemplate: the model's tokenizer_config.json has no chat
// template, so its chat prompts are rendered by an engine.
var ErrNoChatTemplate = errors.New("modeltok: the tokenizer has no chat template")

// Model tokenizes one model's prompts. Safe for concurrent use.
type Model struct {
	Path  string
	tok   *hftokenizer.Tokenizer
	chat  *chattemplate.Template // nil without a chat template
	cache *prefixCache
}

// Load reads a Hugging Face tokenizer from path, a model directory or its
// tokenizer.json (.gz copies are read too), and the chat template of the
// tokenizer_config.json beside it, if it has one.
func Load(path string) (*Model, error) {
	tok, err := hftokenizer.Load(path)
	if err != nil {
		return nil, fmt.Errorf("tokenizer %s: %w", path, err)
	}
	m := &Model{Path: path, tok: tok, cache: newPrefixCache()}
	dir := path
	if st, err := os.Stat(path); err != nil || !st.IsDir() {
		dir = filepath.Dir(path)
	}
	cfg, err := hftokenizer.ReadFile(filepath.Join(dir, "tokenizer_config.json"))
	switch {
	case errors.Is(err, os.ErrNotExist):
		return m, nil
	case err != nil:
		return nil, fmt.Errorf("tokenizer %s: %w", path, err)
	}
	var probe struct {
		ChatTemplate json.RawMessage `json:"chat_template"`
	}
	if err := json.Unmarshal(cfg, &probe); err != nil {
		return nil, fmt.Errorf("tokenizer %s: tokenizer_config.json: %w", path, err)
	}
	if len(probe.ChatTemplate) == 0 || string(probe.ChatTemplate) == "null" {
		return m, nil
	}
	if m.chat, err = chattemplate.Parse(cfg); err != nil {
		return nil, fmt.Errorf("tokenizer %s: chat template: %w", path, err)
	}
	return m, nil
}

// Tokenizer is the model's tokenizer itself, for its vocabulary.
func (m *Model) Tokenizer() *hftokenizer.Tokenizer { return m.tok }

// HasChatTemplate reports whether EncodeChat can render messages.
func (m *Model) HasChatTemplate() bool { return m.chat != nil }

// EncodeText is a completion prompt's ids; engines add special tokens
// (BOS) to completions unless the request says otherwise.
func (m *Model) EncodeText(text string, addSpecialTokens bool) ([]uint32, error) {
	return m.cache.encode(m.tok, text, addSpecialTokens)
}

// EncodeChat renders messages with the chat template and encodes the
// text. Engines add no special tokens to a chat prompt by default: the
// template writes them.
func (m *Model) EncodeChat(messages []json.RawMessage, opts chattemplate.Options, addSpecialTokens bool) ([]uint32, string, error) {
	if m.chat == nil {
		return nil, "", ErrNoChatTemplate
	}
	text, err := m.chat.Render(messages, opts)
	if err != nil {
		return nil, "", err
	}
	ids, err := m.cache.encode(m.tok, text, addSpecialTokens)
	return ids, text, err
}

// RenderChat renders messages with the chat template, for timing it apart
// from the encode.
func (m *Model) RenderChat(messages []json.RawMessage, opts chattemplate.Options) error {
	if m.chat == nil {
		return ErrNoChatTemplate
	}
	_, err := m.chat.Render(messages, opts)
	return err
}
