package serve

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/adapters/enginesource"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/mocker/fleet"
	"github.com/kvrouter/kvrouter/mocker/tokenizer"
)

// mmChat is a chat with a long system prompt, then a user turn holding an
// image (by its data, and its uuid when given) between two texts.
func mmChat(image, uuid string) []any {
	part := map[string]any{"type": "image_url", "image_url": map[string]any{"url": image}}
	if uuid != "" {
		part["uuid"] = uuid
	}
	return []any{
		map[string]any{"role": "system", "content": strings.Repeat("you describe pictures with care and never guess ", 12)},
		map[string]any{"role": "user", "content": []any{
			map[string]any{"type": "text", "text": "what is in this picture"},
			part,
			map[string]any{"type": "text", "text": "and who put it there?"},
		}},
	}
}

func postOK(t *testing.T, url string, body any) []byte {
	t.Helper()
	b, _ := json.Marshal(body)
	resp, err := http.Post(url, "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%s: %d %s", url, resp.StatusCode, out)
	}
	return out
}

// credited is what the router credits engine id (0: the engine it
// chooses) with for a chat: its cached blocks, of the prompt's blocks.
func credited(t *testing.T, s *Server, msgs []any, id uint64) (worker uint64, overlap, blocks int) {
	t.Helper()
	var d struct {
		WorkerID      uint64 `json:"worker_id"`
		OverlapBlocks int    `json:"overlap_blocks"`
		PromptBlocks  int    `json:"prompt_blocks"`
	}
	q := map[string]any{"model": "kvrouter-mock", "messages": msgs}
	if id != 0 {
		q["nvext"] = map[string]any{"backend_instance_id": id}
	}
	out := postOK(t, "http://"+s.Addr()+"/router/best_worker", q)
	if err := json.Unmarshal(out, &d); err != nil {
		t.Fatal(err)
	}
	return d.WorkerID, d.OverlapBlocks, d.PromptBlocks
}

// chatOn serves a chat on engine id and returns its prompt tokens and the
// tokens the engine found cached.
func chatOn(t *testing.T, s *Server, msgs []any, id uint64) (prompt, cached int) {
	t.Helper()
	var c struct {
		Usage struct {
			PromptTokens int `json:"prompt_tokens"`
			Details      struct {
				CachedTokens int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	out := postOK(t, "http://"+s.Addr()+"/v1/chat/completions", map[string]any{"model": "kvrouter-mock", "messages": msgs, "max_tokens": 1,
		"nvext": map[string]any{"backend_instance_id": id}})
	if err := json.Unmarshal(out, &c); err != nil {
		t.Fatal(err)
	}
	return c.Usage.PromptTokens, c.Usage.Details.CachedTokens
}

// Two chats that differ only in their image share only the blocks before
// the image's first placeholder block, for the router as for the engine;
// the same image (by uuid) matches the whole prompt; an image the router
// cannot identify (no uuid) is never credited beyond its first block,
// though the engine, which identifies it by its data, would reuse it.
func TestChatsWithImagesMatchOnlyTheirOwnImage(t *testing.T) {
	const perImage = 48
	engines := []*fleet.Fleet{}
	for range 2 {
		engines = append(engines, engineFleetWith(t, func(cfg *fleet.Config) { cfg.SpeedupRatio = 100; cfg.Server.MMTokensPerItem = perImage }))
	}
	s := startServerWith(t, Config{Router: router.DefaultConfig(), Workers: []WorkerSpec{spec(1, engines[0]), spec(2, engines[1])},
		HealthInterval: 50 * time.Millisecond, MMPlaceholders: map[string]uint32{"image": tokenizer.Image}})
	bs := router.DefaultConfig().BlockSize

	// Where the image starts in the prompt, from the engine's /tokenize.
	var tk struct {
		Tokens []uint32 `json:"tokens"`
	}
	if err := json.Unmarshal(postOK(t, engines[0].Engines()[0].HTTPURL+"/tokenize", map[string]any{"messages": mmChat("data:image/png;base64,AAAA", "")}), &tk); err != nil {
		t.Fatal(err)
	}
	first := -1
	for i, id := range tk.Tokens {
		if id == tokenizer.Image {
			first = i
			break
		}
	}
	before := first / bs // blocks before the image's first block
	whole := (len(tk.Tokens) - 1) / bs
	if first < 0 || before < 2 || whole <= before+perImage/bs {
		t.Fatalf("the test's chat does not have text, then an image, then text: image at %d of %d tokens", first, len(tk.Tokens))
	}

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	serve := func(msgs []any, engine uint64) int {
		stored := s.Sources(engine)[0].Stats().BlocksStored
		_, cached := chatOn(t, s, msgs, engine)
		if err := s.Sources(engine)[0].WaitFor(ctx, func(st enginesource.Stats) bool { return st.BlocksStored > stored }); err != nil {
			t.Fatalf("engine %d's KV events never reached the router: %v", engine, err)
		}
		return cached
	}
	serve(mmChat("data:image/png;base64,AAAA", "cat"), 1)
	serve(mmChat("data:image/png;base64,CCCC", ""), 2)

	if w, overlap, _ := credited(t, s, mmChat("data:image/png;base64,AAAA", "cat"), 0); w != 1 || overlap != whole {
		t.Errorf("the same chat again went to engine %d with %d blocks credited, want engine 1 with %d", w, overlap, whole)
	}
	for _, tc := range []struct {
		name   string
		msgs   []any
		engine uint64
		want   int // router blocks credited on engine
		reused int // tokens the engine finds cached
	}{
		{"same image by uuid", mmChat("data:image/png;base64,AAAA", "cat"), 1, whole, whole * bs},
		{"another image", mmChat("data:image/png;base64,BBBB", "dog"), 1, before, before * bs},
		{"unknown identifier", mmChat("data:image/png;base64,CCCC", ""), 2, before, whole * bs},
	} {
		w, overlap, blocks := credited(t, s, tc.msgs, tc.engine)
		if w != tc.engine || overlap != tc.want || blocks != len(tk.Tokens)/bs {
			t.Errorf("%s: routed to %d with %d of %d blocks credited, want %d with %d of %d", tc.name, w, overlap, blocks, tc.engine, tc.want, len(tk.Tokens)/bs)
		}
		if _, cached := chatOn(t, s, tc.msgs, tc.engine); cached != tc.reused {
			t.Errorf("%s: engine %d reused %d tokens, want %d", tc.name, tc.engine, cached, tc.reused)
		}
	}
}
