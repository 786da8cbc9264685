package frontend

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/kvrouter/kvrouter/adapters/modeltok"
	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
)

func TestMMItemsPlaceMediaOnTheirPlaceholders(t *testing.T) {
	const img, aud = 900, 901
	// 0..9 text, 10..19 image, 20..24 text, 25..29 audio, 30..34 image
	tokens := make([]uint32, 40)
	for i := range tokens {
		switch {
		case i >= 10 && i < 20, i >= 30 && i < 35:
			tokens[i] = img
		case i >= 25 && i < 30:
			tokens[i] = aud
		default:
			tokens[i] = uint32(i + 1)
		}
	}
	parts := chatMMParts(json.RawMessage(`[
		{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"x"},"uuid":"cat"}]},
		{"role":"user","content":"plain"},
		{"role":"user","content":[{"type":"input_audio","input_audio":{"data":"QQ==","format":"wav"}},{"type":"image_url","image_url":{"url":"y"}},{"type":"refusal","refusal":"no"}]}]`))
	if len(parts) != 3 || parts[0].modality != "image" || parts[0].uuid != "cat" || parts[1].modality != "audio" || parts[2].modality != "image" || parts[2].hash == parts[0].hash {
		t.Fatalf("parts %+v", parts)
	}
	cat, _ := blockhash.HashMMIdentifier("cat")
	both := map[string]uint32{"image": img, "audio": aud}
	for _, tc := range []struct {
		name         string
		placeholders map[string]uint32
		kwargs       bool
		want         []router.MMItem
	}{
		{"placed", both, false, []router.MMItem{
			{Offset: 10, Length: 10, Hash: cat, Known: true}, {Offset: 25, Length: 5, Hash: parts[1].hash}, {Offset: 30, Length: 5, Hash: parts[2].hash}}},
		{"mm_processor_kwargs rehash the uuid", both, true, []router.MMItem{
			{Offset: 10, Length: 10, Hash: parts[0].hash}, {Offset: 25, Length: 5, Hash: parts[1].hash}, {Offset: 30, Length: 5, Hash: parts[2].hash}}},
		{"no audio placeholder known", map[string]uint32{"image": img}, false, []router.MMItem{
			{Offset: 0, Length: 1, Hash: parts[1].hash}, {Offset: 10, Length: 10, Hash: cat, Known: true}, {Offset: 30, Length: 5, Hash: parts[2].hash}}},
		{"runs that do not pair", map[string]uint32{"image": 1, "audio": aud}, false, []router.MMItem{
			{Offset: 0, Length: 1, Hash: parts[0].hash}, {Offset: 25, Length: 5, Hash: parts[1].hash}}},
	} {
		if got := mmItems(tokens, parts, tc.placeholders, tc.kwargs); fmt.Sprint(got) != fmt.Sprint(tc.want) {
			t.Errorf("%s: got %+v, want %+v", tc.name, got, tc.want)
		}
	}
	if got := chatMMParts(json.RawMessage(`[{"role":"user","content":[{"type":"text","text":"only"}]}]`)); got != nil {
		t.Errorf("text parts read as media: %+v", got)
	}
}

// A chat with an image is never tokenized by an in-process chat template,
// which would render the text alone and make chats with different images
// the same prompt: the engine tokenizes it, placing the image's
// placeholders, and gets the client's body untouched. Blocks from the
// image's first on match only the same image.
func TestChatWithAnImageIsTokenizedByItsEngineAndForwardedUntouched(t *testing.T) {
	const img = 128256
	// The engine's tokenization: 40 text tokens, 64 placeholders, 24 text.
	prompt := make([]uint32, 128)
	for i := range prompt {
		prompt[i] = uint32(1000 + i)
		if i >= 40 && i < 104 {
			prompt[i] = img
		}
	}
	tokenized, _ := json.Marshal(map[string]any{"tokens": prompt, "count": len(prompt)})
	var mu sync.Mutex
	var tokenizeCalls int
	var forwarded []byte
	engine := func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		mu.Lock()
		defer mu.Unlock()
		if strings.HasSuffix(r.URL.Path, "/tokenize") {
			tokenizeCalls++
			_, _ = w.Write(tokenized)
			return
		}
		forwarded = body
		_, _ = w.Write([]byte(`{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"ok"}}]}`))
	}
	tok := llamaTokenizer(t)
	e := newEnv(t, envOpts{frontend: func(c *Config) {
		c.Tokenizer = func(string) *modeltok.Model { return tok }
		c.MMPlaceholders = map[string]uint32{"image": img}
	}})
	e.fake(1, "llama", 1, engine)

	chat := func(uuid string) []byte {
		return []byte(`{"model":"llama","max_tokens":2,"messages":[{"role":"user","content":[` +
			`{"type":"text","text":"what is this?"},{"type":"image_url","image_url":{"url":"data:image/png;base64,iVBORw0KGgo="},"uuid":"` + uuid + `"}]}]}`)
	}
	resp, body := e.post("/v1/chat/completions", chat("cat"))
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	mu.Lock()
	if tokenizeCalls != 1 || !bytes.Contains(forwarded, []byte(`{"type":"image_url","image_url":{"url":"data:image/png;base64,iVBORw0KGgo="},"uuid":"cat"}`)) {
		t.Fatalf("/tokenize asked %d times; the engine got %s", tokenizeCalls, forwarded)
	}
	mu.Unlock()

	// The engine caches the prompt with the image "cat" on blocks 2..6.
	catID, _ := blockhash.HashMMIdentifier("cat")
	es := router.EngineStored{Worker: kv.Worker{ID: 1}, Tokens: prompt, BlockSize: 16, MM: make([][]uint64, 8)}
	for b := range 8 {
		es.EngineHashes = append(es.EngineHashes, uint64(b+1))
		if b >= 2 && b <= 6 {
			es.MM[b] = []uint64{catID}
		}
	}
	if err := e.router.ApplyEngineStored(&es); err != nil {
		t.Fatal(err)
	}
	for uuid, want := range map[string]int{"cat": 8, "dog": 2, "": 2} {
		resp, body := e.post("/router/best_worker", chat(uuid))
		var out struct {
			Overlap int `json:"overlap_blocks"`
		}
		if resp.StatusCode != http.StatusOK || json.Unmarshal(body, &out) != nil || out.Overlap != want {
			t.Errorf("uuid %q: %d %s, want %d blocks credited", uuid, resp.StatusCode, body, want)
		}
	}
	e.settle()
}
