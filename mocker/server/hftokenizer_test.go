package server

import (
	"bufio"
	"bytes"
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/adapters/chattemplate"
	"github.com/kvrouter/kvrouter/adapters/hftokenizer"
)

const llamaDir = "../../adapters/hftokenizer/testdata/llama3_1"

// startReal runs one engine tokenizing with the tokenizer at path.
func startReal(t *testing.T, path string) string {
	t.Helper()
	tok, err := LoadTokenizer(path)
	if err != nil {
		t.Fatal(err)
	}
	cfg := DefaultConfig()
	cfg.Tokenizer = tok
	srv, _ := startConfig(t, 1000, 1000, RealClock{}, cfg)
	return srv.URL
}

type tokenizeAnswer struct {
	Count  int      `json:"count"`
	Tokens []uint32 `json:"tokens"`
}

func postTokenize(t *testing.T, url string, body any) []uint32 {
	t.Helper()
	resp, b := post(t, url+"/tokenize", body)
	var a tokenizeAnswer
	if resp.StatusCode != http.StatusOK || json.Unmarshal(b, &a) != nil || a.Count != len(a.Tokens) {
		t.Fatalf("/tokenize %v: %d %s", body, resp.StatusCode, b)
	}
	return a.Tokens
}

type completionAnswer struct {
	Choices []struct {
		Text    string `json:"text"`
		Message struct {
			Content string `json:"content"`
		} `json:"message"`
	} `json:"choices"`
	Usage usage `json:"usage"`
}

func completeReal(t *testing.T, url, path string, body map[string]any) completionAnswer {
	t.Helper()
	resp, b := post(t, url+path, body)
	var a completionAnswer
	if resp.StatusCode != http.StatusOK || json.Unmarshal(b, &a) != nil || len(a.Choices) != 1 {
		t.Fatalf("%s: %d %s", path, resp.StatusCode, b)
	}
	return a
}

// streamTexts returns the text of each streamed chunk, every chunk parsed
// as JSON.
func streamTexts(t *testing.T, url, path string, body map[string]any) []string {
	t.Helper()
	body["stream"] = true
	b, _ := json.Marshal(body)
	resp, err := http.Post(url+path, "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var texts []string
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var c struct {
			Choices []struct {
				Text  string `json:"text"`
				Delta struct {
					Content string `json:"content"`
				} `json:"delta"`
			} `json:"choices"`
		}
		if err := json.Unmarshal([]byte(data), &c); err != nil {
			t.Fatalf("chunk %s: %v", data, err)
		}
		for _, ch := range c.Choices {
			texts = append(texts, ch.Text+ch.Delta.Content)
		}
	}
	return texts
}

// TestRealTokenizer checks that an engine given a real tokenizer answers
// /tokenize, counts prompts and caches blocks with the ids the tokenizer
// and chat template compute in process, as a router would.
func TestRealTokenizer(t *testing.T) {
	url := startReal(t, llamaDir)
	ref, err := hftokenizer.Load(llamaDir)
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := hftokenizer.ReadFile(filepath.Join(llamaDir, "tokenizer_config.json"))
	if err != nil {
		t.Fatal(err)
	}
	tmpl, err := chattemplate.Parse(cfg)
	if err != nil {
		t.Fatal(err)
	}

	text := strings.Repeat("The quick brown fox jumps over the lazy dog. Ünïcödé 👨‍👩‍👧 ", 8)
	withBOS, _ := ref.Encode(text, true)
	plain, _ := ref.Encode(text, false)
	if got := postTokenize(t, url, map[string]any{"prompt": text}); !slices.Equal(got, withBOS) {
		t.Errorf("/tokenize prompt = %v, want %v", got, withBOS)
	}
	if got := postTokenize(t, url, map[string]any{"prompt": text, "add_special_tokens": false}); !slices.Equal(got, plain) {
		t.Errorf("/tokenize prompt without special tokens = %v, want %v", got, plain)
	}

	msgs := []json.RawMessage{
		json.RawMessage(`{"role": "system", "content": "Be brief."}`),
		json.RawMessage(`{"role": "user", "content": "  What is a KV cache?  "}`),
	}
	for _, gen := range []bool{true, false} {
		rendered, err := tmpl.Render(msgs, chattemplate.Options{AddGenerationPrompt: gen})
		if err != nil {
			t.Fatal(err)
		}
		want, _ := ref.Encode(rendered, false)
		if got := postTokenize(t, url, map[string]any{"messages": msgs, "add_generation_prompt": gen}); !slices.Equal(got, want) {
			t.Errorf("/tokenize messages (add_generation_prompt %v) = %v, want %v", gen, got, want)
		}
		if gen {
			a := completeReal(t, url, "/v1/chat/completions", map[string]any{"messages": msgs, "max_tokens": 3})
			if a.Usage.PromptTokens != len(want) {
				t.Errorf("chat prompt_tokens = %d, want %d", a.Usage.PromptTokens, len(want))
			}
		}
	}

	// The first request caches the prompt's blocks; the same text again,
	// and the ids the tokenizer gives for it, hit them.
	first := completeReal(t, url, "/v1/completions", map[string]any{"prompt": text, "max_tokens": 4})
	if first.Usage.PromptTokens != len(withBOS) {
		t.Errorf("prompt_tokens = %d, want %d", first.Usage.PromptTokens, len(withBOS))
	}
	again := completeReal(t, url, "/v1/completions", map[string]any{"prompt": text, "max_tokens": 4})
	byIDs := completeReal(t, url, "/v1/completions", map[string]any{"prompt": withBOS, "max_tokens": 4})
	cached := again.Usage.PromptTokensDetails.CachedTokens
	if cached < len(withBOS)-16 || byIDs.Usage.PromptTokensDetails.CachedTokens != cached {
		t.Errorf("cached tokens: %d for the text again, %d for its ids, want both ≥ %d", cached, byIDs.Usage.PromptTokensDetails.CachedTokens, len(withBOS)-16)
	}

	// Generated tokens are ordinary tokens of the vocabulary, the same
	// whether streamed or not.
	pieces := map[string]bool{}
	for id := range uint32(ref.VocabSize()) {
		if p, special, ok := ref.Piece(id); ok && !special {
			pieces[p] = true
		}
	}
	for _, path := range []string{"/v1/completions", "/v1/chat/completions"} {
		body := map[string]any{"prompt": text, "messages": msgs, "max_tokens": 6}
		whole := completeReal(t, url, path, body)
		chunks := streamTexts(t, url, path, body)
		if len(chunks) != 6 {
			t.Fatalf("%s: %d chunks, want 6", path, len(chunks))
		}
		for _, c := range chunks {
			if !pieces[c] {
				t.Errorf("%s: streamed %q is not a token of the vocabulary", path, c)
			}
		}
		if got := strings.Join(chunks, ""); got != whole.Choices[0].Text+whole.Choices[0].Message.Content {
			t.Errorf("%s: streamed %q, whole %q", path, got, whole.Choices[0].Text+whole.Choices[0].Message.Content)
		}
	}

	if resp, b := post(t, url+"/v1/completions", map[string]any{"prompt": []int{ref.VocabSize()}}); resp.StatusCode != http.StatusBadRequest {
		t.Errorf("id past the vocabulary: %d %s", resp.StatusCode, b)
	}
}

// TestRealTokenizerTemplateErrors answers 400 in OpenAI's shape for
// messages the chat template rejects, and for chat requests to a tokenizer
// without a chat template.
func TestRealTokenizerTemplateErrors(t *testing.T) {
	abs, err := filepath.Abs(filepath.Join(llamaDir, "tokenizer.json.gz"))
	if err != nil {
		t.Fatal(err)
	}
	withTemplate, without := t.TempDir(), t.TempDir()
	for dir, cfg := range map[string]string{
		withTemplate: `{"chat_template": "{% if messages[0].role != 'user' %}{{ raise_exception('the first message must be the user\\'s') }}{% endif %}{{ messages[0].content }}"}`,
		without:      `{"bos_token": "<|begin_of_text|>"}`,
	} {
		if err := os.Symlink(abs, filepath.Join(dir, "tokenizer.json.gz")); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "tokenizer_config.json"), []byte(cfg), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	system := []any{map[string]any{"role": "system", "content": "hi"}}
	for _, c := range []struct {
		name, url, path, want string
	}{
		{"raise_exception", startReal(t, withTemplate), "/v1/chat/completions", "the first message must be the user's"},
		{"raise_exception on /tokenize", startReal(t, withTemplate), "/tokenize", "the first message must be the user's"},
		{"no chat template", startReal(t, without), "/v1/chat/completions", "no chat template"},
	} {
		t.Run(c.name, func(t *testing.T) {
			resp, b := post(t, c.url+c.path, map[string]any{"messages": system})
			var e apiError
			if resp.StatusCode != http.StatusBadRequest || json.Unmarshal(b, &e) != nil ||
				e.Error.Type != "invalid_request_error" || e.Error.Code != 400 || !strings.Contains(e.Error.Message, c.want) {
				t.Errorf("%d %s, want 400 mentioning %q", resp.StatusCode, b, c.want)
			}
		})
	}
}
