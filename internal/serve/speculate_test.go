package serve

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/testwait"
)

// chatTurn sends a chat completion and returns the answer's text and the
// prompt blocks the router found cached (nvext.overlap_blocks).
func chatTurn(t *testing.T, s *Server, msgs []map[string]string, hints map[string]any) (string, int) {
	t.Helper()
	nv := map[string]any{"extra_fields": []string{"worker_id"}}
	if hints != nil {
		nv["agent_hints"] = hints
	}
	status, body := postTo(t, s, "/v1/chat/completions", map[string]any{"model": "kvrouter-mock", "messages": msgs, "max_tokens": 40, "nvext": nv})
	var out struct {
		Choices []struct {
			Message struct {
				Content string `json:"content"`
			} `json:"message"`
		} `json:"choices"`
		NVExt struct {
			Overlap int `json:"overlap_blocks"`
		} `json:"nvext"`
	}
	if status != 200 || json.Unmarshal(body, &out) != nil || len(out.Choices) != 1 {
		t.Fatalf("chat turn: %d %s", status, body)
	}
	return out.Choices[0].Message.Content, out.NVExt.Overlap
}

func TestSpeculativePrefillCachesTheNextTurn(t *testing.T) {
	f := engineFleet(t)
	var log pathLog
	w := spec(1, f)
	w.URL = log.front(t, w.URL)
	s := startServer(t, w)

	user := strings.Repeat("tell me about the weather in a long and winding way ", 30)
	msgs := []map[string]string{{"role": "system", "content": "you are brief"}, {"role": "user", "content": user}}
	answer, _ := chatTurn(t, s, msgs, map[string]any{"speculative_prefill": true})
	testwait.Until(t, 5*time.Second, "the speculative prefill", func() bool { return len(log.bodiesOf("/v1/chat/completions")) == 2 })
	var sp struct {
		MaxTokens int                 `json:"max_tokens"`
		Messages  []map[string]string `json:"messages"`
		AddGen    *bool               `json:"add_generation_prompt"`
		Continue  *bool               `json:"continue_final_message"`
		NVExt     json.RawMessage     `json:"nvext"`
	}
	body := log.bodiesOf("/v1/chat/completions")[1]
	if err := json.Unmarshal([]byte(body), &sp); err != nil {
		t.Fatal(err)
	}
	last := sp.Messages[len(sp.Messages)-1]
	if sp.MaxTokens != 1 || len(sp.Messages) != 3 || last["role"] != "assistant" || last["content"] != answer ||
		sp.AddGen == nil || *sp.AddGen || sp.Continue == nil || *sp.Continue || sp.NVExt != nil {
		t.Fatalf("speculative prefill %s: want the turn's messages and its answer as a closed assistant message, max_tokens 1", body)
	}
	// The next turn starts with that prefix and finds it cached: more
	// blocks than the first turn's prompt alone.
	_, firstOverlap := chatTurn(t, s, msgs, nil) // the first turn's prompt again
	next := append(msgs, map[string]string{"role": "assistant", "content": answer}, map[string]string{"role": "user", "content": "and tomorrow?"})
	testwait.Until(t, 5*time.Second, "the next turn to find the speculated prefix", func() bool {
		_, overlap := chatTurn(t, s, next, nil)
		return overlap > firstOverlap
	})

	// Without the hint, a turn is followed by nothing.
	before := len(log.bodiesOf("/v1/chat/completions"))
	chatTurn(t, s, []map[string]string{{"role": "user", "content": "another conversation " + user}}, nil)
	if got := len(log.bodiesOf("/v1/chat/completions")); got != before+1 {
		t.Fatalf("%d requests reached the engine for a turn without the hint, want 1", got-before)
	}
}
