package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func runCmd(t *testing.T, args ...string) (string, error) {
	t.Helper()
	root := newRootCmd()
	var out, errOut bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&errOut)
	root.SetArgs(args)
	err := root.Execute()
	return out.String(), err
}

// writeTrace writes a Mooncake JSONL trace of these lines to a temporary
// file and returns its path.
func writeTrace(t *testing.T, lines string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "trace.jsonl")
	if err := os.WriteFile(path, []byte(lines), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

func TestBenchIndexCommand(t *testing.T) {
	path := writeTrace(t, `{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}
{"timestamp": 1, "input_length": 1500, "output_length": 5, "hash_ids": [0, 1, 2]}
{"timestamp": 2, "input_length": 700, "output_length": 5, "hash_ids": [0, 3]}
`)
	out, err := runCmd(t, "bench", "index", "--trace", path, "--workers", "4", "--group-size", "2",
		"--max-requests", "50", "--duration", "0", "--json", "--quiet")
	if err != nil {
		t.Fatal(err)
	}
	var rep map[string]any
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatalf("output is not JSON: %v\n%s", err, out)
	}
	for _, k := range []string{"ops_per_sec", "block_ops_per_sec", "find_matches_p50_us", "find_matches_p99_us",
		"apply_p99_us", "requests", "indexed_pairs", "bytes_per_pair", "heap_inuse_bytes", "hit_rate",
		"workers", "threads", "shards", "seed", "duration_s", "dynamo_block_ops_per_sec", "dynamo_block_ops",
		"trace_length_factor", "trace_duplication_factor"} {
		if _, ok := rep[k]; !ok {
			t.Errorf("report lacks %q", k)
		}
	}
	if rep["requests"].(float64) != 50 {
		t.Errorf("requests = %v, want 50", rep["requests"])
	}

	// Dynamo's knobs reach the harness: two copies of ids stretched by 3.
	out, err = runCmd(t, "bench", "index", "--trace", path, "--workers", "2", "--group-size", "2", "--num-gpu-blocks", "64",
		"--block-size", "512", "--trace-length-factor", "3", "--trace-duplication-factor", "2", "--max-requests", "6",
		"--duration", "0", "--threads", "1", "--json", "--quiet")
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatalf("output is not JSON: %v\n%s", err, out)
	}
	// Stretched, the three prompts are 6, 9 and 6 ids of which only the
	// last block is cut: 5 + 8 + 5 blocks, offered once in each copy.
	if rep["capacity_blocks"].(float64) != 64 || rep["trace_length_factor"].(float64) != 3 ||
		rep["trace_duplication_factor"].(float64) != 2 || rep["blocks_looked_up"].(float64) != 36 ||
		rep["dynamo_block_ops"].(float64) != rep["blocks_looked_up"].(float64)+rep["blocks_stored"].(float64) {
		t.Errorf("Dynamo knobs: %v", rep)
	}

	out, err = runCmd(t, "bench", "index", "--trace", path, "--workers", "2", "--group-size", "2", "--max-requests", "6",
		"--duration", "0", "--pregenerate", "--json", "--quiet")
	if err != nil {
		t.Fatal(err)
	}
	rep = nil
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatalf("output is not JSON: %v\n%s", err, out)
	}
	if rep["pregenerated"] != true || rep["requests"].(float64) != 6 || rep["overlap_mismatches"].(float64) != 0 {
		t.Errorf("pregenerated run: %v", rep)
	}
	out, err = runCmd(t, "bench", "index", "--trace", path, "--max-requests", "3", "--duration", "0", "--pregenerate", "--quiet")
	if err != nil || !strings.Contains(out, "timed, after") {
		t.Errorf("pregenerated table output: %v\n%s", err, out)
	}

	out, err = runCmd(t, "bench", "index", "--trace", path, "--max-requests", "10", "--quiet")
	if err != nil || !strings.Contains(out, "block ops/s") || !strings.Contains(out, "Dynamo block ops/s") {
		t.Errorf("table output: %v\n%s", err, out)
	}
	if _, err := runCmd(t, "bench", "index", "--quiet"); err == nil {
		t.Error("no error without --trace")
	}
	if _, err := runCmd(t, "bench", "index", "--trace", filepath.Join(t.TempDir(), "none"), "--quiet"); err == nil {
		t.Error("no error for a missing trace")
	}
}

func TestVersionCommand(t *testing.T) {
	out, err := runCmd(t, "version")
	if err != nil || !strings.HasPrefix(out, "kvrouter ") {
		t.Errorf("version: %v %q", err, out)
	}
}
