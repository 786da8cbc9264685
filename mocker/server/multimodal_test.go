package server

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/mocker/tokenizer"
)

// imageChat is a chat whose user turn holds a long text, then an image,
// then a question.
func imageChat(image, uuid string) map[string]any {
	part := map[string]any{"type": "image_url", "image_url": map[string]any{"url": image}}
	if uuid != "" {
		part["uuid"] = uuid
	}
	return map[string]any{"model": "kvrouter-mock", "max_tokens": 1, "messages": []any{
		map[string]any{"role": "system", "content": strings.Repeat("you are a careful describer of pictures ", 8)},
		map[string]any{"role": "user", "content": []any{
			map[string]any{"type": "text", "text": "what is in"},
			part,
			map[string]any{"type": "text", "text": "and why is it there?"},
		}},
	}}
}

func chatCachedTokens(t *testing.T, url string, body map[string]any) (prompt, cached int) {
	t.Helper()
	resp, out := post(t, url+"/v1/chat/completions", body)
	var c struct {
		Usage usage `json:"usage"`
	}
	if resp.StatusCode != http.StatusOK || json.Unmarshal(out, &c) != nil {
		t.Fatalf("%d %s", resp.StatusCode, out)
	}
	return c.Usage.PromptTokens, c.Usage.PromptTokensDetails.CachedTokens
}

// An image expands to the model's fixed number of placeholder tokens, in
// /tokenize as in the prompt, and keys the blocks it covers: the same chat
// around another image reuses only the blocks before the image; the same
// image, by its data or its uuid, reuses the whole prompt.
func TestChatImagesKeyTheirBlocks(t *testing.T) {
	cfg := DefaultConfig()
	cfg.MMTokensPerItem = 40
	srv, _ := startConfig(t, 4096, 100, RealClock{}, cfg)

	resp, out := post(t, srv.URL+"/tokenize", imageChat("data:image/png;base64,AAAA", ""))
	var tk struct {
		Tokens []uint32 `json:"tokens"`
	}
	if resp.StatusCode != http.StatusOK || json.Unmarshal(out, &tk) != nil {
		t.Fatalf("tokenize: %d %s", resp.StatusCode, out)
	}
	first, n := -1, 0
	for i, id := range tk.Tokens {
		if id == tokenizer.Image {
			if first < 0 {
				first = i
			}
			n++
		}
	}
	if n != 40 {
		t.Fatalf("an image expanded to %d placeholders, want 40: %v", n, tk.Tokens)
	}
	imageBlock := first / 16 * 16 // tokens before the image's first block

	prompt, cached := chatCachedTokens(t, srv.URL, imageChat("data:image/png;base64,AAAA", ""))
	if prompt != len(tk.Tokens) || cached != 0 {
		t.Fatalf("first chat: %d prompt tokens, %d cached", prompt, cached)
	}
	if _, cached = chatCachedTokens(t, srv.URL, imageChat("data:image/png;base64,BBBB", "")); cached != imageBlock {
		t.Fatalf("another image: %d cached tokens, want the %d before the image's block", cached, imageBlock)
	}
	if _, cached = chatCachedTokens(t, srv.URL, imageChat("data:image/png;base64,AAAA", "")); cached != (prompt-1)/16*16 {
		t.Fatalf("the same image: %d cached tokens, want %d", cached, (prompt-1)/16*16)
	}
	// A uuid is the item's identity, whatever the data.
	chatCachedTokens(t, srv.URL, imageChat("https://example.com/a.png", "cat-1"))
	if _, cached = chatCachedTokens(t, srv.URL, imageChat("https://example.com/other.png", "cat-1")); cached != (prompt-1)/16*16 {
		t.Fatalf("the same uuid: %d cached tokens, want %d", cached, (prompt-1)/16*16)
	}
}

func TestChatMediaThatDoesNotPairIsRefused(t *testing.T) {
	cfg := DefaultConfig()
	srv, _ := startConfig(t, 256, 100, RealClock{}, cfg)
	for name, msgs := range map[string]any{
		"image placeholder without item": []any{map[string]any{"role": "user", "content": "look: <image>"}},
		"audio placeholder without item": []any{map[string]any{"role": "user", "content": "<audio>"}},
	} {
		resp, out := post(t, srv.URL+"/v1/chat/completions", map[string]any{"messages": msgs})
		if resp.StatusCode != http.StatusBadRequest {
			t.Errorf("%s: %d %s", name, resp.StatusCode, out)
		}
	}
}
