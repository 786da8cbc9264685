package main

import (
	"path/filepath"
	"strings"
	"testing"
)

func TestTokenizeCommand(t *testing.T) {
	dir := filepath.Join("..", "..", "adapters", "hftokenizer", "testdata", "llama3_1")
	out, err := runCmd(t, "tokenize", "--tokenizer", dir, "--text", "Hello")
	if err != nil || strings.TrimSpace(out) != "[128000,9906]" {
		t.Errorf("default: %v %q", err, out)
	}
	out, err = runCmd(t, "tokenize", "--tokenizer", dir, "--text", "Hello", "--add-special-tokens=false")
	if err != nil || strings.TrimSpace(out) != "[9906]" {
		t.Errorf("without special tokens: %v %q", err, out)
	}
	out, err = runCmd(t, "tokenize", "--tokenizer", filepath.Join(dir, "tokenizer.json"), "--text", "")
	if err != nil || strings.TrimSpace(out) != "[128000]" {
		t.Errorf("tokenizer.json path, empty text: %v %q", err, out)
	}
	if _, err := runCmd(t, "tokenize", "--tokenizer", t.TempDir(), "--text", "x"); err == nil {
		t.Error("a directory without tokenizer.json is accepted")
	}
}
