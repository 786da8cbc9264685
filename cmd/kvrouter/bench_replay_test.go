package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/lab/workload"
)

func TestParseReplayModes(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want string
		err  string
	}{
		{"kv, round-robin", "kv,round-robin", ""},
		{"KV,dynamo-kv", "kv,dynamo-kv", ""},
		{"all", strings.Join(allReplayModes, ","), ""},
		{"kv,fastest", "", "unknown router mode"},
		{"direct", "", "name their worker"},
		{" , ", "", "names no mode"},
	} {
		got, err := parseModes(tc.in)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("parseModes(%q) error %v, want %q", tc.in, err, tc.err)
			}
			continue
		}
		if err != nil || strings.Join(got, ",") != tc.want {
			t.Errorf("parseModes(%q) = %v, %v; want %s", tc.in, got, err, tc.want)
		}
	}
}

func TestReplayWorkloadSkipsBadTraceLines(t *testing.T) {
	path := writeTrace(t, `{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}
{"timestamp": 1, "input_length": 600}
{"timestamp": 2, "input_length": 10, "output_length": 0, "hash_ids": [3]}
`)
	var warn bytes.Buffer
	reqs, _, err := loadWorkload(path, false, workload.DefaultSyntheticConfig(), 0, false, &warn)
	if err != nil {
		t.Fatal(err)
	}
	if len(reqs) != 2 || len(reqs[0].Tokens) != 600 || reqs[1].OSL != 1 {
		t.Fatalf("workload %d requests", len(reqs))
	}
	if !strings.Contains(warn.String(), "line 2") {
		t.Fatalf("warning %q does not name line 2", warn.String())
	}
	if _, _, err := loadWorkload(path, false, workload.DefaultSyntheticConfig(), 0, true, &warn); err == nil || !strings.Contains(err.Error(), "line 2") {
		t.Fatalf("strict: %v", err)
	}
}
