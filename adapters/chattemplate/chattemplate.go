// Package chattemplate renders a model's Hugging Face chat template for an
// OpenAI messages array in process, byte for byte as transformers and
// @huggingface/jinja do, so the frontend need not ask an engine's /tokenize.
//
// Messages are normalised the way vLLM hands them to the template: null or
// missing content becomes "", content given as a list of parts becomes its
// text parts joined with "\n", and a
// tool call's arguments that are a JSON object string become that object.
package chattemplate

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"sort"
	"strings"

	"github.com/ardanlabs/jinja"
)

// Template is a tokenizer_config.json's chat templates compiled once; it is
// safe for concurrent Render calls.
type Template struct {
	templates map[string]*jinja.Template
	special   map[string]jinja.Value
}

// Options are the per-request inputs of apply_chat_template.
type Options struct {
	AddGenerationPrompt bool
	// Tools is the request's OpenAI tools array; empty means no tools, which
	// the template sees as none.
	Tools json.RawMessage
	// Kwargs are chat_template_kwargs (e.g. enable_thinking); they may
	// override special tokens but not messages, tools or
	// add_generation_prompt.
	Kwargs map[string]any
	// TemplateName picks one of a named template list; empty picks
	// "tool_use" when tools are given and it exists, else "default", as
	// transformers does.
	TemplateName string
}

// specialTokenKeys are the tokenizer_config.json fields transformers puts in
// the template context through special_tokens_map.
var specialTokenKeys = []string{"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}

// Load parses the tokenizer_config.json at path.
func Load(path string) (*Template, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	return Parse(b)
}

// Parse compiles the chat template(s) of a tokenizer_config.json.
func Parse(tokenizerConfig []byte) (*Template, error) {
	var cfg map[string]json.RawMessage
	if err := json.Unmarshal(tokenizerConfig, &cfg); err != nil {
		return nil, fmt.Errorf("chattemplate: tokenizer config: %w", err)
	}
	raw, ok := cfg["chat_template"]
	if !ok || string(raw) == "null" {
		return nil, errors.New("chattemplate: tokenizer config has no chat_template")
	}
	sources := map[string]string{}
	var one string
	if err := json.Unmarshal(raw, &one); err == nil {
		sources["default"] = one
	} else {
		var list []struct {
			Name     string `json:"name"`
			Template string `json:"template"`
		}
		if err := json.Unmarshal(raw, &list); err != nil {
			return nil, errors.New("chattemplate: chat_template is neither a string nor a list of {name, template}")
		}
		for _, e := range list {
			sources[e.Name] = e.Template
		}
	}
	t := &Template{templates: map[string]*jinja.Template{}, special: map[string]jinja.Value{}}
	for name, src := range sources {
		c, err := compile(src)
		if err != nil {
			return nil, fmt.Errorf("chattemplate: template %q: %w", name, err)
		}
		t.templates[name] = c
	}
	for _, k := range specialTokenKeys {
		if s, ok := tokenString(cfg[k]); ok {
			t.special[k] = jinja.NewString(s)
		}
	}
	if r, ok := cfg["additional_special_tokens"]; ok {
		var list []json.RawMessage
		if json.Unmarshal(r, &list) == nil {
			items := []jinja.Value{}
			for _, e := range list {
				if s, ok := tokenString(e); ok {
					items = append(items, jinja.NewString(s))
				}
			}
			t.special["additional_special_tokens"] = jinja.NewList(items)
		}
	}
	if r, ok := cfg["extra_special_tokens"]; ok {
		var extra map[string]json.RawMessage
		if json.Unmarshal(r, &extra) == nil {
			for k, e := range extra {
				if s, ok := tokenString(e); ok {
					t.special[k] = jinja.NewString(s)
				}
			}
		}
	}
	return t, nil
}

// compile recovers because a parser panic on a hostile template must be an
// error, not a crashed router.
func compile(src string) (c *jinja.Template, err error) {
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("template compiler panicked: %v", r)
		}
	}()
	return jinja.Compile(src)
}

// tokenString reads a special token written either as a string or as an
// AddedToken object, whose content is what the template sees.
func tokenString(raw json.RawMessage) (string, bool) {
	if len(raw) == 0 {
		return "", false
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s, true
	}
	var tok struct {
		Content *string `json:"content"`
	}
	if json.Unmarshal(raw, &tok) == nil && tok.Content != nil {
		return *tok.Content, true
	}
	return "", false
}

// Names lists the template names, sorted.
func (t *Template) Names() []string {
	names := make([]string, 0, len(t.templates))
	for n := range t.templates {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

func (t *Template) pick(opts Options, hasTools bool) (*jinja.Template, error) {
	if opts.TemplateName != "" {
		if c, ok := t.templates[opts.TemplateName]; ok {
			return c, nil
		}
		return nil, fmt.Errorf("chattemplate: unknown template name %q (have %s)", opts.TemplateName, strings.Join(t.Names(), ", "))
	}
	if hasTools {
		if c, ok := t.templates["tool_use"]; ok {
			return c, nil
		}
	}
	if c, ok := t.templates["default"]; ok {
		return c, nil
	}
	return nil, fmt.Errorf("chattemplate: no default template; pass a template name (have %s)", strings.Join(t.Names(), ", "))
}

// Render applies the chat template to messages, each one JSON object in
// OpenAI chat format. Errors, including the template's raise_exception, are
// the client's fault and carry a message fit for a 400 answer.
func (t *Template) Render(messages []json.RawMessage, opts Options) (out string, err error) {
	defer func() {
		if r := recover(); r != nil {
			out, err = "", fmt.Errorf("chattemplate: template failed: %v", r)
		}
	}()
	msgs := make([]jinja.Value, len(messages))
	for i, raw := range messages {
		v, err := decodeValue(raw)
		if err != nil {
			return "", fmt.Errorf("chattemplate: message %d: %w", i, err)
		}
		if !v.IsDict() {
			return "", fmt.Errorf("chattemplate: message %d is not a JSON object", i)
		}
		msgs[i] = normalise(v)
	}
	tools := jinja.None()
	hasTools := len(opts.Tools) > 0 && string(opts.Tools) != "null"
	if hasTools {
		if tools, err = decodeValue(opts.Tools); err != nil {
			return "", fmt.Errorf("chattemplate: tools: %w", err)
		}
		if !tools.IsList() {
			return "", errors.New("chattemplate: tools is not a JSON array")
		}
	}
	c, err := t.pick(opts, hasTools)
	if err != nil {
		return "", err
	}
	ctx := make(map[string]jinja.Value, len(t.special)+len(opts.Kwargs)+4)
	for k, v := range t.special {
		ctx[k] = v
	}
	for k, v := range opts.Kwargs {
		ctx[k] = jinja.FromGoValue(v)
	}
	ctx["messages"] = jinja.NewList(msgs)
	ctx["tools"] = tools
	ctx["documents"] = jinja.None()
	ctx["add_generation_prompt"] = jinja.NewBool(opts.AddGenerationPrompt)
	out, err = c.RenderValues(ctx)
	if err != nil {
		return "", fmt.Errorf("chattemplate: %w", err)
	}
	return out, nil
}

// normalise rewrites a message as vLLM passes it to the template.
func normalise(msg jinja.Value) jinja.Value {
	d := msg.AsDict()
	if c, ok := d.Get("content"); !ok || c.IsNone() {
		d.Set("content", jinja.NewString(""))
	} else if c.IsList() {
		var texts []string
		for _, p := range c.AsList().Items {
			if !p.IsDict() {
				continue
			}
			pd := p.AsDict()
			if typ, ok := pd.Get("type"); !ok || !typ.IsString() || typ.AsString() != "text" {
				continue
			}
			if txt, ok := pd.Get("text"); ok && txt.IsString() {
				texts = append(texts, txt.AsString())
			}
		}
		d.Set("content", jinja.NewString(strings.Join(texts, "\n")))
	}
	if calls, ok := d.Get("tool_calls"); ok && calls.IsList() {
		for _, call := range calls.AsList().Items {
			if !call.IsDict() {
				continue
			}
			fn, ok := call.AsDict().Get("function")
			if !ok || !fn.IsDict() {
				continue
			}
			args, ok := fn.AsDict().Get("arguments")
			if !ok || !args.IsString() {
				continue
			}
			if parsed, err := decodeValue([]byte(args.AsString())); err == nil && parsed.IsDict() {
				fn.AsDict().Set("arguments", parsed)
			}
		}
	}
	return msg
}
