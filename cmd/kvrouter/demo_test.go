package main

import (
	"path/filepath"
	"strings"
	"testing"
)

func TestDemoCommand(t *testing.T) {
	// The synthetic workload: kv mode and round robin on fresh fleets.
	out, err := runCmd(t, "demo", "--trace", "", "--requests", "200")
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"synthetic", "kv ", "round-robin ", "hit rate", "0 refused", "kvrouter up", "bench route"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}

	// The default trace path is relative to the repository root; from this
	// package's directory it does not exist, so demo falls back.
	out, err = runCmd(t, "demo", "--requests", "100", "--workers", "2")
	if err != nil || !strings.Contains(out, "synthetic") || !strings.Contains(out, "50.0 / 50.0 %") {
		t.Errorf("fallback: %v\n%s", err, out)
	}

	// A named trace is replayed; a named trace that is missing is an error.
	path := writeTrace(t, `{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}
{"timestamp": 1, "input_length": 1500, "output_length": 5, "hash_ids": [0, 1, 2]}
{"timestamp": 2, "input_length": 700, "output_length": 5, "hash_ids": [0, 3]}
`)
	out, err = runCmd(t, "demo", "--trace", path, "--num-gpu-blocks", "1024")
	if err != nil || !strings.Contains(out, "first 3 requests of "+path) {
		t.Errorf("trace: %v\n%s", err, out)
	}
	if _, err := runCmd(t, "demo", "--trace", filepath.Join(t.TempDir(), "none")); err == nil {
		t.Error("no error for a missing trace named on the command line")
	}
	if _, err := runCmd(t, "demo", "--block-size", "24"); err == nil {
		t.Error("no error for a block size that does not divide 512")
	}
}
