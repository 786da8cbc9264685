package chattemplate

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
)

func msgs(raw ...string) []json.RawMessage {
	out := make([]json.RawMessage, len(raw))
	for i, r := range raw {
		out[i] = json.RawMessage(r)
	}
	return out
}

func TestParseErrors(t *testing.T) {
	for _, tc := range []struct{ name, cfg, want string }{
		{"not json", `{`, "tokenizer config"},
		{"no template", `{"bos_token":"<s>"}`, "no chat_template"},
		{"wrong type", `{"chat_template":42}`, "neither a string nor a list"},
		{"unclosed block", `{"chat_template":"{% for m in messages %}{{ m.content }}"}`, `template "default"`},
		{"bad expression", `{"chat_template":"{{ (1 + }}"}`, `template "default"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Parse([]byte(tc.cfg))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("want error containing %q, got %v", tc.want, err)
			}
		})
	}
}

func TestNamedTemplates(t *testing.T) {
	cfg := `{"bos_token":{"content":"<s>","lstrip":false},"chat_template":[
		{"name":"default","template":"D{{ bos_token }}{{ messages|length }}"},
		{"name":"tool_use","template":"T{{ tools|length }}"}]}`
	tmpl, err := Parse([]byte(cfg))
	if err != nil {
		t.Fatal(err)
	}
	one := msgs(`{"role":"user","content":"hi"}`)
	for _, tc := range []struct {
		opts Options
		want string
	}{
		{Options{}, "D<s>1"},
		{Options{Tools: json.RawMessage(`[{"type":"function"}]`)}, "T1"},
		{Options{Tools: json.RawMessage(`[]`), TemplateName: "default"}, "D<s>1"},
	} {
		got, err := tmpl.Render(one, tc.opts)
		if err != nil || got != tc.want {
			t.Errorf("%+v: got %q, %v; want %q", tc.opts, got, err, tc.want)
		}
	}
	if _, err := tmpl.Render(one, Options{TemplateName: "rag"}); err == nil || !strings.Contains(err.Error(), `unknown template name "rag"`) {
		t.Fatalf("unknown name: got %v", err)
	}
}

func TestRenderErrors(t *testing.T) {
	tmpl := loadModel(t, "gemma3")
	for _, tc := range []struct {
		name string
		msgs []json.RawMessage
		opts Options
		want string
	}{
		{"non-object message", msgs(`"hello"`), Options{}, "message 0 is not a JSON object"},
		{"invalid json", msgs(`{"role":`), Options{}, "message 0"},
		{"tools not array", msgs(`{"role":"user","content":"x"}`), Options{Tools: json.RawMessage(`{}`)}, "tools is not a JSON array"},
		{"raise_exception", msgs(`{"role":"assistant","content":"x"}`), Options{}, "Conversation roles must alternate"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := tmpl.Render(tc.msgs, tc.opts)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("want error containing %q, got %v", tc.want, err)
			}
		})
	}
}

func TestConcurrentRender(t *testing.T) {
	tmpl := loadModel(t, "qwen3")
	g := loadGoldens(t, "qwen3")[0]
	done := make(chan error, 8)
	for range 8 {
		go func() {
			for range 50 {
				got, err := tmpl.Render(g.Messages, Options{AddGenerationPrompt: g.AddGenerationPrompt})
				if err == nil && got != *g.Expected {
					err = fmt.Errorf("got %q", got)
				}
				if err != nil {
					done <- err
					return
				}
			}
			done <- nil
		}()
	}
	for range 8 {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
}

// FuzzRender feeds arbitrary messages to every model's template: Render may
// fail but must never panic.
func FuzzRender(f *testing.F) {
	var tmpls []*Template
	for _, m := range models {
		tmpls = append(tmpls, loadModel(f, m))
	}
	f.Add(`{"role":"user","content":"hi"}`, `[]`)
	f.Add(`{"role":"assistant","content":null,"tool_calls":[{"function":{"name":"f","arguments":"{\"a\":[1,{}]}"}}]}`, `[{"type":"function"}]`)
	f.Add(`{"role":"user","content":[{"type":"text","text":1},{"type":"image"}]}`, `null`)
	f.Add(`{"role":7,"content":{"a":1},"reasoning_content":[]}`, `[1,"x",null]`)
	f.Fuzz(func(t *testing.T, msg, tools string) {
		for _, tmpl := range tmpls {
			_, _ = tmpl.Render(msgs(msg, msg), Options{AddGenerationPrompt: true, Tools: json.RawMessage(tools)})
		}
	})
}

func BenchmarkRenderLlama3TwentyMessages(b *testing.B) {
	tmpl := loadModel(b, "llama3")
	var conv []json.RawMessage
	for i := range 20 {
		role := "user"
		if i%2 == 1 {
			role = "assistant"
		}
		m, _ := json.Marshal(map[string]string{"role": role, "content": fmt.Sprintf("Message %d: a sentence of ordinary length to render.", i)})
		conv = append(conv, m)
	}
	b.ReportAllocs()
	for b.Loop() {
		if _, err := tmpl.Render(conv, Options{AddGenerationPrompt: true}); err != nil {
			b.Fatal(err)
		}
	}
}
