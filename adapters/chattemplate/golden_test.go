package chattemplate

import (
	"bufio"
	"compress/gzip"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

type golden struct {
	Name                string            `json:"name"`
	Messages            []json.RawMessage `json:"messages"`
	AddGenerationPrompt bool              `json:"add_generation_prompt"`
	Tools               json.RawMessage   `json:"tools"`
	Kwargs              map[string]any    `json:"kwargs"`
	Expected            *string           `json:"expected"`
	Error               string            `json:"error"`
}

var models = []string{"llama3", "llama3_1", "qwen3", "deepseek_v3", "gemma3"}

// loadModel builds the tokenizer_config.json the goldens were rendered from
// out of the stored template and special tokens.
func loadModel(t testing.TB, model string) *Template {
	t.Helper()
	dir := filepath.Join("testdata", model)
	src, err := os.ReadFile(filepath.Join(dir, "template.jinja"))
	if err != nil {
		t.Fatal(err)
	}
	special, err := os.ReadFile(filepath.Join(dir, "special_tokens.json"))
	if err != nil {
		t.Fatal(err)
	}
	cfg := map[string]any{}
	if err := json.Unmarshal(special, &cfg); err != nil {
		t.Fatal(err)
	}
	cfg["chat_template"] = string(src)
	b, _ := json.Marshal(cfg)
	tmpl, err := Parse(b)
	if err != nil {
		t.Fatalf("%s: %v", model, err)
	}
	return tmpl
}

func loadGoldens(t testing.TB, model string) []golden {
	t.Helper()
	f, err := os.Open(filepath.Join("testdata", model, "golden.jsonl.gz"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	zr, err := gzip.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	var out []golden
	sc := bufio.NewScanner(zr)
	sc.Buffer(nil, 1<<24)
	for sc.Scan() {
		var g golden
		if err := json.Unmarshal(sc.Bytes(), &g); err != nil {
			t.Fatal(err)
		}
		out = append(out, g)
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

func TestGoldens(t *testing.T) {
	for _, model := range models {
		tmpl := loadModel(t, model)
		for _, g := range loadGoldens(t, model) {
			t.Run(model+"/"+g.Name, func(t *testing.T) {
				got, err := tmpl.Render(g.Messages, Options{AddGenerationPrompt: g.AddGenerationPrompt, Tools: g.Tools, Kwargs: g.Kwargs})
				if g.Expected == nil {
					if err == nil {
						t.Fatalf("want error %q, got output %q", g.Error, got)
					}
					// A raise_exception message must reach the client intact;
					// other errors only need to be errors.
					if !strings.Contains(g.Error, "TypeError") && !strings.Contains(g.Error, "Cannot") && !strings.Contains(err.Error(), g.Error) {
						t.Fatalf("want error containing %q, got %v", g.Error, err)
					}
					return
				}
				if err != nil {
					t.Fatalf("unexpected error: %v", err)
				}
				if got != *g.Expected {
					t.Fatalf("mismatch\n got: %q\nwant: %q", got, *g.Expected)
				}
			})
		}
	}
}
