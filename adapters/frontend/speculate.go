package frontend

import (
	"context"
	"encoding/json"
	"io"
	"maps"
	"net/http"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
)

// maxSpeculative bounds the speculative prefills in flight at once; a
// turn ending beyond it is not followed by one (it is only a prediction).
const maxSpeculative = 64

// speculativeTimeout bounds one speculative prefill.
const speculativeTimeout = 60 * time.Second

// answerText is the text of a non-streamed answer's one choice: its
// message content (chat) or text (completions); ok is false for anything
// else (several choices, tool calls only, not JSON).
func answerText(data []byte) (string, bool) {
	var a struct {
		Choices []struct {
			Text    *string `json:"text"`
			Message *struct {
				Content *string `json:"content"`
			} `json:"message"`
		} `json:"choices"`
	}
	if json.Unmarshal(data, &a) != nil || len(a.Choices) != 1 {
		return "", false
	}
	switch ch := a.Choices[0]; {
	case ch.Message != nil && ch.Message.Content != nil:
		return *ch.Message.Content, true
	case ch.Text != nil:
		return *ch.Text, true
	}
	return "", false
}

// speculate runs after a turn with agent_hints.speculative_prefill ended
// well: it prefills the next turn's predicted prefix (the prompt and the
// answer, the answer closed as the chat template ends a turn) on the same
// engine with one output token, booked with the router as any request, so
// that the next turn finds it cached. It runs in the background; a busy
// engine, a full budget or any failure just skips it.
func (c *call) speculate(answer string) {
	f := c.f
	select {
	case f.speculative <- struct{}{}:
	default:
		f.m.speculative.WithLabelValues("skipped").Inc()
		return
	}
	target := kv.Worker{ID: c.worker.ID, DPRank: c.decision.Worker.DPRank}
	go func() {
		defer func() { <-f.speculative }()
		ctx, cancel := context.WithTimeout(context.WithoutCancel(c.ctx), speculativeTimeout)
		defer cancel()
		f.m.speculative.WithLabelValues(c.prefillNext(ctx, target, answer)).Inc()
	}()
}

// prefillNext sends the next turn's prefix to target and says how it went,
// as the metric's result label.
func (c *call) prefillNext(ctx context.Context, target kv.Worker, answer string) string {
	f := c.f
	next := maps.Clone(c.top)
	for _, k := range []string{"stream", "stream_options", "n", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice", "response_format"} {
		delete(next, k)
	}
	next["max_tokens"] = json.RawMessage("1")
	next, tokens, items, err := c.withAnswer(ctx, next, answer, true)
	if err != nil {
		return "failed"
	}
	req := router.Request{ID: f.newID(), Model: c.base, LoRA: c.lora, Tokens: tokens, MM: items, Target: &target}
	d, err := f.cfg.Router.BestWorker(ctx, &req)
	if err != nil {
		return "skipped" // the engine is busy or gone
	}
	defer f.cfg.Router.Free(req.ID)
	wk, ok := findWorker(f.cfg.Workers(), d.Worker.ID)
	if !ok {
		return "skipped"
	}
	body, err := engineBody(next, nil, nil, wk, d.Worker.DPRank)
	if err != nil {
		return "failed"
	}
	ereq, err := body.post(ctx, strings.TrimRight(wk.BaseURL, "/")+c.ep.path)
	if err != nil {
		return "failed"
	}
	ereq.Header.Set("X-Request-Id", req.ID)
	resp, err := f.cfg.Client.Do(ereq)
	if err != nil {
		return "failed"
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
	f.cfg.Router.MarkPrefillCompleted(req.ID)
	if resp.StatusCode != http.StatusOK {
		f.log.Warn("speculative prefill refused", "worker", wk.Name, "status", resp.StatusCode)
		return "failed"
	}
	return "sent"
}
