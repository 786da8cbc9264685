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
	"strings"

	"github.com/kvrouter/kvrouter/adapters/chattemplate"
	"github.com/kvrouter/kvrouter/adapters/hftokenizer"
)

// ErrNoChatTemplate: the model's files have no chat
// template, so its chat prompts are rendered by an engine.
var ErrNoChatTemplate = errors.New("modeltok: the tokenizer has no chat template")

// Model tokenizes one model's prompts. Safe for concurrent use.
type Model struct {
	// Path is the tokenizer as given (a path or a model id); Dir is the
	// directory its files were read from.
	Path, Dir string
	tok       *hftokenizer.Tokenizer
	chat      *chattemplate.Template // nil without a chat template
	cache     *prefixCache
	mm        map[string]uint32 // placeholder token per modality
}

// Load reads a Hugging Face tokenizer from path, a model directory or its
// tokenizer.json (.gz copies are read too), or a model id found in the
// local Hugging Face cache (Resolve), and the chat template beside it:
// chat_template.jinja (with additional_chat_templates/), else
// chat_template.json, else tokenizer_config.json's, as transformers picks
// it. A generation_config.json there must parse. Every file that does not
// is an error naming it.
func Load(path string) (*Model, error) {
	m, err := load(path)
	if err != nil {
		return nil, fmt.Errorf("tokenizer %s: %w", path, err)
	}
	return m, nil
}

func load(path string) (*Model, error) {
	resolved, err := Resolve(path)
	if err != nil {
		return nil, err
	}
	tok, err := hftokenizer.Load(resolved)
	if err != nil {
		return nil, err
	}
	dir := resolved
	if st, err := os.Stat(resolved); err != nil || !st.IsDir() {
		dir = filepath.Dir(resolved)
	}
	m := &Model{Path: path, Dir: dir, tok: tok, cache: newPrefixCache(), mm: readMMPlaceholders(dir)}
	if err := checkGenerationConfig(dir); err != nil {
		return nil, err
	}
	cfg := map[string]json.RawMessage{}
	data, err := readOptional(dir, "tokenizer_config.json")
	if err != nil {
		return nil, err
	}
	if data != nil {
		if err := json.Unmarshal(data, &cfg); err != nil {
			return nil, fmt.Errorf("tokenizer_config.json: %w", err)
		}
	}
	source := "tokenizer_config.json"
	if file, tmpl, err := separateChatTemplate(dir); err != nil {
		return nil, err
	} else if tmpl != nil {
		source, cfg["chat_template"] = file, tmpl
	}
	if t := cfg["chat_template"]; len(t) == 0 || string(t) == "null" {
		return m, nil
	}
	// The special tokens the template sees stay tokenizer_config.json's
	// whichever file the template comes from, as in transformers.
	merged, err := json.Marshal(cfg)
	if err != nil {
		return nil, err
	}
	if m.chat, err = chattemplate.Parse(merged); err != nil {
		return nil, fmt.Errorf("%s: chat template: %w", source, err)
	}
	return m, nil
}

// readOptional reads dir/name (or its .gz), nil if neither exists.
func readOptional(dir, name string) ([]byte, error) {
	data, err := hftokenizer.ReadFile(filepath.Join(dir, name))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return data, nil
}

// separateChatTemplate is the chat template newer Hugging Face repositories
// ship beside tokenizer_config.json, as the JSON value of a
// chat_template field, and the file it came from; nil if there is none.
// transformers prefers chat_template.jinja, whose named siblings in
// additional_chat_templates/ make a named list, and vLLM's processors
// chat_template.json.
func separateChatTemplate(dir string) (string, json.RawMessage, error) {
	src, err := readOptional(dir, "chat_template.jinja")
	if err != nil {
		return "", nil, err
	}
	if src != nil {
		named, err := additionalChatTemplates(dir)
		if err != nil {
			return "", nil, err
		}
		var v any = string(src)
		if len(named) > 0 {
			v = append([]namedTemplate{{"default", string(src)}}, named...)
		}
		raw, err := json.Marshal(v)
		return "chat_template.jinja", raw, err
	}
	data, err := readOptional(dir, "chat_template.json")
	if err != nil || data == nil {
		return "", nil, err
	}
	var file struct {
		ChatTemplate json.RawMessage `json:"chat_template"`
	}
	if err := json.Unmarshal(data, &file); err != nil {
		return "", nil, fmt.Errorf("chat_template.json: %w", err)
	}
	if len(file.ChatTemplate) == 0 {
		return "", nil, errors.New("chat_template.json: no chat_template field")
	}
	return "chat_template.json", file.ChatTemplate, nil
}

type namedTemplate struct {
	Name     string `json:"name"`
	Template string `json:"template"`
}

// additionalChatTemplates reads additional_chat_templates/NAME.jinja, the
// named templates transformers saves beside chat_template.jinja.
func additionalChatTemplates(dir string) ([]namedTemplate, error) {
	sub := filepath.Join(dir, "additional_chat_templates")
	entries, err := os.ReadDir(sub)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []namedTemplate
	for _, e := range entries {
		name := strings.TrimSuffix(e.Name(), ".gz")
		if e.IsDir() || !strings.HasSuffix(name, ".jinja") {
			continue
		}
		src, err := hftokenizer.ReadFile(filepath.Join(sub, e.Name()))
		if err != nil {
			return nil, fmt.Errorf("additional_chat_templates/%s: %w", e.Name(), err)
		}
		out = append(out, namedTemplate{strings.TrimSuffix(name, ".jinja"), string(src)})
	}
	return out, nil
}

// checkGenerationConfig reads generation_config.json only to refuse a broken
// one at start. Its bos/eos ids and sampling defaults shape what an engine
// generates and when it stops, not the prompt ids the router hashes, and
// transformers gives a chat template the special tokens of
// tokenizer_config.json alone: filling them from here would render prompts
// the engine does not.
func checkGenerationConfig(dir string) error {
	data, err := readOptional(dir, "generation_config.json")
	if err != nil || data == nil {
		return err
	}
	var cfg struct {
		BOS tokenIDs `json:"bos_token_id"`
		EOS tokenIDs `json:"eos_token_id"`
		PAD tokenIDs `json:"pad_token_id"`
	}
	if err := json.Unmarshal(data, &cfg); err != nil {
		return fmt.Errorf("generation_config.json: %w", err)
	}
	return nil
}

// tokenIDs is a generation_config.json token id field: one id, a list of
// ids or null.
type tokenIDs []int64

func (t *tokenIDs) UnmarshalJSON(b []byte) error {
	var one *int64
	if err := json.Unmarshal(b, &one); err == nil {
		if one != nil {
			*t = tokenIDs{*one}
		}
		return nil
	}
	var list []int64
	if err := json.Unmarshal(b, &list); err != nil {
		return fmt.Errorf("a token id must be an integer or a list of them, not %s", b)
	}
	*t = list
	return nil
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
