package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/adapters/chattemplate"
	"github.com/kvrouter/kvrouter/adapters/modeltok"
)

// TokenizeResult is one tokenizer's speed on one core.
type TokenizeResult struct {
	Tokenizer string `json:"tokenizer"`
	// Tokens and Bytes are those of the benchmark text.
	Tokens int `json:"tokens"`
	Bytes  int `json:"bytes"`
	// FirstMS is the first encode after loading: no word cached yet.
	FirstMS float64 `json:"first_ms"`
	// EncodeMS are the later encodes of the same text.
	EncodeMS     Dist    `json:"encode_ms"`
	MBPerS       float64 `json:"mb_per_s"`
	TokensPerS   float64 `json:"tokens_per_s"`
	ChatMessages int     `json:"chat_messages,omitempty"`
	// ChatRenderUS renders a conversation of ChatMessages messages with the
	// model's chat template; absent without one.
	ChatRenderUS *Dist `json:"chat_render_us,omitempty"`
	// JS is the JavaScript reference on the same text, when asked for and
	// it could run; JSSkipped says why it did not.
	JS        *JSReference `json:"js_reference,omitempty"`
	JSSkipped string       `json:"js_reference_skipped,omitempty"`
}

// Dist summarises timings.
type Dist struct {
	Mean float64 `json:"mean"`
	P50  float64 `json:"p50"`
	P99  float64 `json:"p99"`
}

func distOf(xs []float64) Dist {
	slices.Sort(xs)
	sum := 0.0
	for _, x := range xs {
		sum += x
	}
	at := func(q float64) float64 { return xs[min(len(xs)-1, int(q*float64(len(xs))))] }
	return Dist{Mean: sum / float64(len(xs)), P50: at(0.5), P99: at(0.99)}
}

// RunTokenize times m on text, iterations times, on the calling goroutine,
// and renders a conversation of messages messages that many times.
func RunTokenize(name string, m *modeltok.Model, text string, iterations, messages int) (TokenizeResult, error) {
	t0 := time.Now()
	ids, err := m.EncodeText(text, true)
	if err != nil {
		return TokenizeResult{}, err
	}
	res := TokenizeResult{Tokenizer: name, Tokens: len(ids), Bytes: len(text), FirstMS: ms(time.Since(t0))}
	// The later encodes are whole, without the prefix cache: for a
	// tokenizer whose newlines are added tokens (Gemma 3) the same text
	// again would resume from its last line and time nothing but the scan.
	times := make([]float64, iterations)
	var total time.Duration
	for i := range times {
		t := time.Now()
		if _, err := m.Tokenizer().Encode(text, true); err != nil {
			return res, err
		}
		d := time.Since(t)
		total += d
		times[i] = ms(d)
	}
	res.EncodeMS = distOf(times)
	res.MBPerS = float64(len(text)) * float64(iterations) / total.Seconds() / 1e6
	res.TokensPerS = float64(len(ids)) * float64(iterations) / total.Seconds()
	if !m.HasChatTemplate() || messages <= 0 {
		return res, nil
	}
	conv := conversation(messages)
	opts := chattemplate.Options{AddGenerationPrompt: true}
	renders := make([]float64, iterations)
	for i := range renders {
		t := time.Now()
		if _, _, err := m.EncodeChat(conv, opts, false); err != nil {
			return res, fmt.Errorf("chat template: %w", err)
		}
		renders[i] = float64(time.Since(t).Nanoseconds()) / 1e3
	}
	// The render alone, without the encode of its text.
	renderOnly := make([]float64, iterations)
	for i := range renderOnly {
		t := time.Now()
		if err := m.RenderChat(conv, opts); err != nil {
			return res, err
		}
		renderOnly[i] = float64(time.Since(t).Nanoseconds()) / 1e3
	}
	d := distOf(renderOnly)
	res.ChatMessages, res.ChatRenderUS = messages, &d
	return res, nil
}

// conversation is a system prompt and alternating user and assistant turns.
func conversation(n int) []json.RawMessage {
	out := make([]json.RawMessage, 0, n)
	out = append(out, json.RawMessage(`{"role":"system","content":"You are a concise assistant for operators of LLM fleets."}`))
	for i := 1; i < n; i++ {
		role := "user"
		if i%2 == 0 {
			role = "assistant"
		}
		b, _ := json.Marshal(map[string]string{"role": role, "content": fmt.Sprintf("Turn %d: how does prefix caching change the time to first token of request %d?", i, i*31)})
		out = append(out, b)
	}
	return out
}

func ms(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e6 }

// JSReference is the JavaScript reference tokenizer (@lenml/tokenizers, the
// one the goldens come from) timed on the same text in the same run, by
// scripts/tokenizer-goldens/bench.mjs.
type JSReference struct {
	Reference string  `json:"reference"`
	Node      string  `json:"node"`
	Tokens    int     `json:"tokens"`
	Bytes     int     `json:"bytes"`
	FirstMS   float64 `json:"first_ms"`
	// Warmup encodes ran before the timed ones, for V8 to optimise.
	Warmup     int     `json:"warmup"`
	EncodeMS   Dist    `json:"encode_ms"`
	MBPerS     float64 `json:"mb_per_s"`
	TokensPerS float64 `json:"tokens_per_s"`
}

// JSReferenceScript is the script RunJSReference runs, in the directory it
// is given (which holds its node_modules).
const JSReferenceScript = "bench.mjs"

// RunJSReference times the JavaScript reference on text with the tokenizer
// at path, iterations encodes after a warm-up, in a node child process
// (which inherits this process's CPU affinity, so `taskset` pins both).
// skipped, with a nil error, says why it could not run: no node, or dir
// without the script or its dependencies. A token count different from
// tokens (kvrouter's) is an error: the two did not encode the same text
// the same way, so their times are not comparable.
func RunJSReference(ctx context.Context, dir, path, text string, tokens, iterations int) (ref *JSReference, skipped string, err error) {
	node, err := exec.LookPath("node")
	if err != nil {
		return nil, "node is not installed", nil
	}
	script := filepath.Join(dir, JSReferenceScript)
	if _, err := os.Stat(script); err != nil {
		return nil, fmt.Sprintf("no %s in %s", JSReferenceScript, dir), nil
	}
	if _, err := os.Stat(filepath.Join(dir, "node_modules", "@lenml", "tokenizers")); err != nil {
		return nil, fmt.Sprintf("no node_modules/@lenml/tokenizers in %s (run npm ci there)", dir), nil
	}
	abs, err := filepath.Abs(path)
	if err != nil {
		return nil, "", err
	}
	cmd := exec.CommandContext(ctx, node, script, abs, strconv.Itoa(iterations))
	cmd.Stdin = strings.NewReader(text)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, "", fmt.Errorf("%s: %w: %s", JSReferenceScript, err, strings.TrimSpace(stderr.String()))
	}
	ref = new(JSReference)
	if err := json.Unmarshal(out, ref); err != nil {
		return nil, "", fmt.Errorf("%s printed %q: %w", JSReferenceScript, out, err)
	}
	if ref.Tokens != tokens || ref.Bytes != len(text) {
		return nil, "", fmt.Errorf("the JavaScript reference encoded %d bytes into %d tokens, kvrouter %d bytes into %d: not the same work", ref.Bytes, ref.Tokens, len(text), tokens)
	}
	return ref, "", nil
}
