package modeltok

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/adapters/chattemplate"
)

const testdata = "../hftokenizer/testdata"

func TestLoad(t *testing.T) {
	m, err := Load(filepath.Join(testdata, "llama3_1"))
	if err != nil || !m.HasChatTemplate() {
		t.Fatalf("llama3_1: %v, chat template %v", err, m != nil && m.HasChatTemplate())
	}
	ids, text, err := m.EncodeChat([]json.RawMessage{json.RawMessage(`{"role":"user","content":"Hi"}`)}, chattemplate.Options{AddGenerationPrompt: true}, false)
	if err != nil || !strings.HasPrefix(text, "<|begin_of_text|>") || ids[0] != 128000 {
		t.Fatalf("chat: %v %q %v", err, text, ids)
	}
	if ids, err := m.EncodeText("Hello", true); err != nil || len(ids) != 2 || ids[0] != 128000 {
		t.Fatalf("text: %v %v", ids, err)
	}

	// A tokenizer without a tokenizer_config.json has no chat template.
	dir := t.TempDir()
	b, err := os.ReadFile(filepath.Join(testdata, "qwen3", "tokenizer.json.gz"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "tokenizer.json.gz"), b, 0o644); err != nil {
		t.Fatal(err)
	}
	bare, err := Load(dir)
	if err != nil || bare.HasChatTemplate() {
		t.Fatalf("bare tokenizer: %v", err)
	}
	if _, _, err := bare.EncodeChat(nil, chattemplate.Options{}, false); !errors.Is(err, ErrNoChatTemplate) {
		t.Fatalf("chat without a template: %v", err)
	}

	// A broken tokenizer_config.json is an error naming the tokenizer.
	if err := os.WriteFile(filepath.Join(dir, "tokenizer_config.json"), []byte("{broken"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Load(dir); err == nil || !strings.Contains(err.Error(), dir) {
		t.Fatalf("broken config: %v", err)
	}
	if _, err := Load(filepath.Join(dir, "missing")); err == nil || !strings.Contains(err.Error(), "missing") {
		t.Fatalf("missing path: %v", err)
	}
}
