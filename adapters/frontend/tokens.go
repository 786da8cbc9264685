package frontend

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strings"

	"github.com/kvrouter/kvrouter/adapters/chattemplate"
	"github.com/kvrouter/kvrouter/core/router"
)

// promptKind says where a request's prompt is.
type promptKind uint8

const (
	kindCompletion promptKind = iota // "prompt"
	kindChat                         // "messages"
	kindAny                          // router API: "tokens", "messages" or "prompt"
)

// chatTemplateKeys change what a chat request tokenizes to; they go to
// /tokenize with the messages.
var chatTemplateKeys = []string{"chat_template", "chat_template_kwargs", "tools", "add_generation_prompt", "continue_final_message", "add_special_tokens", "documents"}

// maxTokenizeResponse bounds an engine's /tokenize answer.
const maxTokenizeResponse = 64 << 20

func present(raw json.RawMessage) bool { return len(raw) > 0 && string(raw) != "null" }

// checkPrompt reports a missing prompt before anything else is done.
func checkPrompt(top map[string]json.RawMessage, kind promptKind) *httpError {
	switch kind {
	case kindCompletion:
		if !present(top["prompt"]) {
			return badRequest("missing_prompt", "prompt", "prompt is required")
		}
	case kindChat:
		if !present(top["messages"]) {
			return badRequest("missing_messages", "messages", "messages is required")
		}
		// Checked in place: a chat prompt can be megabytes.
		msgs := bytes.TrimSpace(top["messages"])
		if msgs[0] != '[' || !json.Valid(msgs) {
			return badRequest("invalid_messages", "messages", "messages must be a list of messages")
		}
		if skipSpace(msgs, 1) == len(msgs)-1 {
			return badRequest("invalid_messages", "messages", "messages must not be empty")
		}
	default:
		if !present(top["tokens"]) && !present(top["prompt"]) && !present(top["messages"]) {
			return badRequest("missing_prompt", "tokens", "one of tokens, prompt or messages is required")
		}
	}
	return nil
}

// tokenIDs reads a list of token ids.
func tokenIDs(raw json.RawMessage, param string) ([]uint32, *httpError) {
	if ids, ok := fastTokenIDs(raw); ok {
		return ids, nil
	}
	var ids []int64
	if err := json.Unmarshal(raw, &ids); err != nil {
		return nil, badRequest("invalid_tokens", param, "%s must be a list of token ids", param)
	}
	out := make([]uint32, len(ids))
	for i, id := range ids {
		if id < 0 || id > math.MaxUint32 {
			return nil, badRequest("invalid_tokens", param, "%s[%d] = %d is not a token id", param, i, id)
		}
		out[i] = uint32(id)
	}
	return out, nil
}

// completionPrompt reads an OpenAI prompt: token ids, or text, returned as
// its JSON string for /tokenize. A batch is represented by its first prompt.
func completionPrompt(raw json.RawMessage) (ids []uint32, text json.RawMessage, herr *httpError) {
	const shapes = "prompt must be a string, a list of strings, a list of token ids or a list of such lists"
	raw = bytes.TrimSpace(raw)
	switch {
	case len(raw) > 0 && raw[0] == '"':
		if !json.Valid(raw) {
			return nil, nil, badRequest("invalid_prompt", "prompt", "prompt is not a valid JSON string")
		}
		return nil, raw, nil
	case len(raw) == 0 || raw[0] != '[':
		return nil, nil, badRequest("invalid_prompt", "prompt", shapes)
	}
	i := skipSpace(raw, 1)
	if i < len(raw) && raw[i] == ']' {
		return nil, nil, badRequest("invalid_prompt", "prompt", "prompt must not be an empty list")
	}
	end, err := skipValue(raw, i)
	if err != nil {
		return nil, nil, badRequest("invalid_prompt", "prompt", shapes)
	}
	switch el := raw[i:end]; el[0] {
	case '"':
		if !json.Valid(el) {
			return nil, nil, badRequest("invalid_prompt", "prompt", "prompt[0] is not a valid JSON string")
		}
		return nil, el, nil
	case '[':
		ids, herr = tokenIDs(el, "prompt[0]")
	default:
		ids, herr = tokenIDs(raw, "prompt")
	}
	return ids, nil, herr
}

// promptTokens finds the token ids the router hashes, and the multimodal
// items of a chat's media parts placed on them (see multimodal.go).
func (f *Frontend) promptTokens(ctx context.Context, top map[string]json.RawMessage, kind promptKind, model string, serving []Worker, tokenData []uint32) ([]uint32, []router.MMItem, *httpError) {
	chat := kind == kindChat || (kind == kindAny && present(top["messages"]))
	var parts []mmPart
	if chat {
		parts = chatMMParts(top["messages"])
	}
	ids, herr := f.promptTokenIDs(ctx, top, kind, chat, len(parts) > 0, model, serving, tokenData)
	if herr != nil {
		return nil, nil, herr
	}
	return ids, mmItems(ids, parts, f.mmPlaceholders(model), present(top["mm_processor_kwargs"])), nil
}

// promptTokenIDs finds the token ids: tokenData if given
// (nvext.token_data), token ids in the request, or an engine's
// tokenization of its text or messages. A chat with media is always
// tokenized by an engine, which places its items' placeholders.
func (f *Frontend) promptTokenIDs(ctx context.Context, top map[string]json.RawMessage, kind promptKind, chat, media bool, model string, serving []Worker, tokenData []uint32) ([]uint32, *httpError) {
	if tokenData != nil {
		return tokenData, nil
	}
	if kind == kindAny && present(top["tokens"]) {
		return tokenIDs(top["tokens"], "tokens")
	}
	if err := ctx.Err(); err != nil {
		// The client left (or the router is stopping): a prompt of many
		// megabytes is not tokenized for no one.
		return nil, errCancelled(ctx)
	}
	if ids, herr, done := f.tokenizeInProcess(top, !media, chat, model); done {
		if herr == nil && ctx.Err() != nil {
			return nil, errCancelled(ctx)
		}
		return ids, herr
	}
	f.m.tokenized.WithLabelValues(f.modelLabel(model), "engine").Inc()
	var modelJSON []byte
	if model != "" {
		modelJSON = top["model"]
	}
	if chat {
		kvs := [][]byte{[]byte("model"), modelJSON, []byte("messages"), top["messages"]}
		if !present(top["add_generation_prompt"]) {
			kvs = append(kvs, []byte("add_generation_prompt"), []byte("true"))
		}
		for _, k := range chatTemplateKeys {
			if present(top[k]) {
				kvs = append(kvs, []byte(k), top[k])
			}
		}
		return f.tokenize(ctx, serving, objectOf(kvs...))
	}
	ids, text, herr := completionPrompt(top["prompt"])
	if herr != nil || text == nil {
		return ids, herr
	}
	var special []byte
	if present(top["add_special_tokens"]) {
		special = top["add_special_tokens"]
	}
	return f.tokenize(ctx, serving, objectOf([]byte("model"), modelJSON, []byte("prompt"), text, []byte("add_special_tokens"), special))
}

// tokenizeInProcess tokenizes the prompt with the model's own tokenizer
// when it has one and the request needs nothing only an engine does; done
// is false when the engine's /tokenize must answer.
func (f *Frontend) tokenizeInProcess(top map[string]json.RawMessage, inProcess, chat bool, model string) (ids []uint32, herr *httpError, done bool) {
	if f.cfg.Tokenizer == nil || !inProcess {
		return nil, nil, false
	}
	m := f.cfg.Tokenizer(model)
	if m == nil {
		return nil, nil, false
	}
	flag := func(key string, def bool) (bool, *httpError) {
		if !present(top[key]) {
			return def, nil
		}
		var v bool
		if json.Unmarshal(top[key], &v) != nil {
			return false, badRequest("invalid_"+key, key, "%s must be a boolean", key)
		}
		return v, nil
	}
	if chat {
		if !m.HasChatTemplate() || present(top["chat_template"]) || present(top["continue_final_message"]) || present(top["documents"]) {
			return nil, nil, false
		}
		var msgs []json.RawMessage
		if err := json.Unmarshal(top["messages"], &msgs); err != nil {
			return nil, badRequest("invalid_messages", "messages", "messages must be a list of messages"), true
		}
		opts := chattemplate.Options{Tools: top["tools"]}
		if opts.AddGenerationPrompt, herr = flag("add_generation_prompt", true); herr != nil {
			return nil, herr, true
		}
		if present(top["chat_template_kwargs"]) {
			if err := json.Unmarshal(top["chat_template_kwargs"], &opts.Kwargs); err != nil {
				return nil, badRequest("invalid_chat_template_kwargs", "chat_template_kwargs", "chat_template_kwargs must be an object"), true
			}
		}
		special, herr := flag("add_special_tokens", false)
		if herr != nil {
			return nil, herr, true
		}
		ids, _, err := m.EncodeChat(msgs, opts, special)
		if err != nil {
			return nil, badRequest("invalid_messages", "messages", "the chat template of %s: %v", model, err), true
		}
		f.m.tokenized.WithLabelValues(f.modelLabel(model), "in_process").Inc()
		return ids, nil, true
	}
	ids, text, herr := completionPrompt(top["prompt"])
	if herr != nil || text == nil {
		return ids, herr, true
	}
	var s string
	if err := json.Unmarshal(text, &s); err != nil {
		return nil, badRequest("invalid_prompt", "prompt", "prompt is not a valid JSON string"), true
	}
	special, herr := flag("add_special_tokens", true)
	if herr != nil {
		return nil, herr, true
	}
	ids, err := m.EncodeText(s, special)
	if err != nil {
		return nil, badRequest("invalid_prompt", "prompt", "tokenizing the prompt: %v", err), true
	}
	f.m.tokenized.WithLabelValues(f.modelLabel(model), "in_process").Inc()
	return ids, nil, true
}

// tokenize asks the engines serving the model, one after the other from a
// rotating start, until one answers. A client error (400, 422) ends the
// search; an engine that cannot (unreachable, 5xx, no /tokenize) does not.
func (f *Frontend) tokenize(ctx context.Context, serving []Worker, payload pieces) ([]uint32, *httpError) {
	if len(serving) == 0 {
		return nil, newError(http.StatusServiceUnavailable, "server_error", "no_workers", "", "no worker can tokenize the prompt")
	}
	start := int(f.tokRR.Add(1) % uint64(len(serving)))
	var last error
	for i := range serving {
		w := serving[(start+i)%len(serving)]
		ids, clientErr, err := f.tokenizeOn(ctx, w, payload)
		switch {
		case err == nil:
			return ids, nil
		case clientErr:
			return nil, badRequest("tokenization_failed", "", "tokenizing the prompt on engine %s: %v", w.Name, err)
		case ctx.Err() != nil:
			return nil, errCancelled(ctx)
		}
		f.log.Warn("tokenize failed", "worker", w.Name, "url", w.BaseURL, "err", err)
		last = fmt.Errorf("engine %s: %w", w.Name, err)
	}
	return nil, newError(http.StatusBadGateway, "server_error", "tokenization_failed", "", "no engine could tokenize the prompt: %v", last)
}

// errCancelled is the answer to a request whose context ended while its
// prompt was being tokenized.
func errCancelled(ctx context.Context) *httpError {
	return newError(http.StatusServiceUnavailable, "server_error", "cancelled", "", "request ended while tokenizing: %v", context.Cause(ctx))
}

func (f *Frontend) tokenizeOn(ctx context.Context, w Worker, payload pieces) (ids []uint32, clientErr bool, err error) {
	req, err := payload.post(ctx, strings.TrimRight(w.BaseURL, "/")+"/tokenize")
	if err != nil {
		return nil, false, err
	}
	resp, err := f.cfg.Client.Do(req)
	if err != nil {
		return nil, false, &engineFault{"/tokenize failed before the engine answered", err}
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		body, err := readAtMost(resp.Body, resp.ContentLength, maxEngineError)
		if err != nil {
			return nil, false, &engineFault{"/tokenize's answer broke off", err}
		}
		msg := engineMessage(body)
		switch resp.StatusCode {
		case http.StatusBadRequest, http.StatusUnprocessableEntity, http.StatusRequestEntityTooLarge:
			return nil, true, errors.New(msg)
		}
		return nil, false, fmt.Errorf("/tokenize answered %s: %s", resp.Status, msg)
	}
	ids, err = decodeTokenList(io.LimitReader(resp.Body, maxTokenizeResponse))
	if err != nil {
		return nil, false, &engineFault{"/tokenize answered no token list", err}
	}
	return ids, false, nil
}

// readAtMost reads r whole, up to limit bytes; size, when known (≥ 0),
// sizes the buffer once instead of growing it by doubling.
func readAtMost(r io.Reader, size, limit int64) ([]byte, error) {
	if size < 0 || size > limit {
		return io.ReadAll(io.LimitReader(r, limit))
	}
	buf := make([]byte, size)
	if _, err := io.ReadFull(r, buf); err != nil {
		return nil, err
	}
	return buf, nil
}

// engineMessage extracts the message of an engine's error body.
func engineMessage(body []byte) string {
	var e struct {
		Error struct {
			Message string `json:"message"`
		} `json:"error"`
		Detail  any    `json:"detail"`
		Message string `json:"message"`
	}
	if json.Unmarshal(body, &e) == nil {
		switch {
		case e.Error.Message != "":
			return e.Error.Message
		case e.Message != "":
			return e.Message
		case e.Detail != nil:
			return fmt.Sprint(e.Detail)
		}
	}
	s := strings.TrimSpace(string(body))
	if len(s) > 300 {
		s = s[:300] + "…"
	}
	return s
}

// fastTokenIDs parses the common shape of a token-id prompt, a JSON array
// of plain non-negative integers, without reflection: for an 8k-token
// prompt it is an order of magnitude cheaper than encoding/json. Anything
// else (exponents, signs, overflow, malformed input) reports false and is
// left to encoding/json, which also words the error.
func fastTokenIDs(raw []byte) ([]uint32, bool) {
	i := skipSpace(raw, 0)
	if i >= len(raw) || raw[i] != '[' {
		return nil, false
	}
	// One pass to count the ids sizes the list once; growing it by
	// doubling would leave up to twice its size behind.
	out := make([]uint32, 0, bytes.Count(raw, []byte{','})+1)
	i = skipSpace(raw, i+1)
	if i < len(raw) && raw[i] == ']' {
		return out, skipSpace(raw, i+1) == len(raw)
	}
	for {
		start := i
		var v uint64
		for i < len(raw) && raw[i] >= '0' && raw[i] <= '9' {
			v = v*10 + uint64(raw[i]-'0')
			if v > math.MaxUint32 {
				return nil, false
			}
			i++
		}
		if i == start || (raw[start] == '0' && i-start > 1) {
			return nil, false // not a number, or a leading zero JSON forbids
		}
		out = append(out, uint32(v))
		i = skipSpace(raw, i)
		if i >= len(raw) {
			return nil, false
		}
		switch raw[i] {
		case ',':
			i = skipSpace(raw, i+1)
		case ']':
			return out, skipSpace(raw, i+1) == len(raw)
		default:
			return nil, false
		}
	}
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\n' || b[i] == '\t' || b[i] == '\r') {
		i++
	}
	return i
}
