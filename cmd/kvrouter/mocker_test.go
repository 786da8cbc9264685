package main

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestMockerRoles(t *testing.T) {
	ports := []string{"--http-port", "0", "--kv-events-port", "0", "--kv-events-replay-port", "0"}
	broken := filepath.Join(t.TempDir(), "tokenizer.json")
	if err := os.WriteFile(broken, []byte(`{"model": {"type": "Unigram"}}`), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		args []string
		want string // in the error, or else in the table
		err  bool
	}{
		{"one role for all", []string{"--role", "decode", "--num-workers", "2"}, "engine-1  decode", false},
		{"one role per engine", []string{"--role", "prefill, decode", "--num-workers", "2"}, "engine-1  decode", false},
		{"default", nil, "ENGINE    RANK", false},
		{"unknown role", []string{"--role", "encode"}, "role must be prefill, decode or both", true},
		{"roles and engines differ", []string{"--role", "prefill,decode,decode", "--num-workers", "2"}, "3 roles for 2 engines", true},
		{"real tokenizer", []string{"--tokenizer", "../../adapters/hftokenizer/testdata/qwen3"}, "ENGINE    RANK", false},
		{"tokenizer missing", []string{"--tokenizer", "/nonexistent/tokenizer.json"}, "/nonexistent/tokenizer.json", true},
		{"tokenizer that does not load", []string{"--tokenizer", broken}, broken, true},
		{"hybrid model", []string{"--kv-cache-groups", "sliding:32:4096,full:16,mamba:64"}, "KV-cache groups sliding_window:32:4096,full_attention:16,mamba:64, by group_idx", false},
		{"hybrid model's block size", []string{"--kv-cache-groups", "sliding_window:16:4096,full_attention:32"}, "blocks of 32 tokens", false},
		{"hybrid model against --block-size", []string{"--kv-cache-groups", "full_attention:32", "--block-size", "16"}, "gives the full_attention group 32-token blocks, --block-size 16", true},
		{"hybrid model without full attention", []string{"--kv-cache-groups", "sliding_window:32:4096"}, "need a full-attention group", true},
		{"unequal engines", []string{"--fleet", "1x1,1x0.5:0.5"}, "engine-1", false},
		{"unequal engines named", []string{"--fleet", "2x1,1x0.5:0.5"}, "--fleet 2x1,1x0.5:0.5", false},
		{"fleet and engine count differ", []string{"--fleet", "2x1", "--num-workers", "3"}, "disagree", true},
		{"negative bandwidth", []string{"--role", "decode", "--kv-transfer-bandwidth", "-1"}, "bandwidth must be positive", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := newRootCmd()
			var out bytes.Buffer
			root.SetOut(&out)
			root.SetErr(&out)
			root.SetArgs(append(append([]string{"mocker"}, ports...), tc.args...))
			// Already cancelled: the mocker starts, prints its table and stops.
			ctx, cancel := context.WithCancel(context.Background())
			cancel()
			err := root.ExecuteContext(ctx)
			switch {
			case tc.err && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("error %v, want one with %q", err, tc.want)
			case !tc.err && (err != nil || !strings.Contains(out.String(), tc.want)):
				t.Fatalf("error %v, output:\n%s\nwant %q in it", err, out.String(), tc.want)
			}
		})
	}
}

// The file --serve-config writes is one serve --config reads, naming the
// engines the mocker printed, ports picked with 0 included.
func TestMockerServeConfig(t *testing.T) {
	path := filepath.Join(t.TempDir(), "fleet.json")
	root := newRootCmd()
	var out bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&out)
	root.SetArgs([]string{"mocker", "--num-workers", "2", "--data-parallel-size", "2", "--http-port", "0", "--kv-events-port", "0",
		"--kv-events-replay-port", "0", "--serve-config", path})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := root.ExecuteContext(ctx); err != nil {
		t.Fatal(err)
	}
	workers, err := loadWorkers(path, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(workers) != 2 {
		t.Fatalf("%d workers in %s", len(workers), path)
	}
	for _, w := range workers {
		if w.DPSize != 2 || w.Dump != w.URL+"/kv_events/dump" || w.Model == "" {
			t.Fatalf("worker %+v", w)
		}
		for _, endpoint := range []string{w.URL, w.Events, w.Replay} {
			if strings.HasSuffix(endpoint, ":0") || !strings.Contains(out.String(), strings.TrimPrefix(strings.TrimPrefix(endpoint, "http://"), "tcp://")) {
				t.Fatalf("endpoint %q is not one the mocker printed:\n%s", endpoint, out.String())
			}
		}
	}
}
