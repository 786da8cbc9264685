package main

import (
	"encoding/json"
	"strings"
	"testing"
)

func TestBenchRouteCommand(t *testing.T) {
	small := []string{"--isl", "512", "--workers", "4", "--iterations", "200", "--conversations", "2",
		"--system-tokens", "128", "--inflight", "8", "--quiet"}
	out, err := runCmd(t, append([]string{"bench", "route", "--json"}, small...)...)
	if err != nil {
		t.Fatal(err)
	}
	var rep map[string]any
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatalf("output is not JSON: %v\n%s", err, out)
	}
	for _, k := range []string{"route_p50_us", "route_p99_us", "route_mean_us", "hash_p50_us", "find_matches_p50_us",
		"schedule_p50_us", "score_p50_us", "book_p50_us", "free_p50_us", "mean_split_us", "decisions_per_sec", "hit_rate", "indexed_pairs", "iterations", "workers", "isl", "seed"} {
		if _, ok := rep[k]; !ok {
			t.Errorf("report lacks %q", k)
		}
	}
	if rep["iterations"].(float64) != 200 || rep["workers"].(float64) != 4 || rep["isl"].(float64) != 512 {
		t.Errorf("flags not applied: %v", rep)
	}
	if p50 := rep["route_p50_us"].(float64); p50 <= 0 {
		t.Errorf("route_p50_us = %v", p50)
	}

	for _, k := range []string{"hash", "find_matches", "score", "book", "free", "other"} {
		if _, ok := rep["mean_split_us"].(map[string]any)[k]; !ok {
			t.Errorf("mean split lacks %q", k)
		}
	}

	out, err = runCmd(t, "bench", "route", "--isl", "256", "--workers", "1000", "--iterations", "100", "--conversations", "1",
		"--system-tokens", "64", "--inflight", "8", "--router-predicted-ttl-secs", "0", "--quiet")
	if err != nil || !strings.Contains(out, "route p50 / p99") || !strings.Contains(out, "decisions/s") ||
		!strings.Contains(out, "mean hash / find / score / book / free") {
		t.Errorf("table output: %v\n%s", err, out)
	}
	for _, bad := range [][]string{{"--isl", "8"}, {"--inflight", "0"}, {"--system-tokens", "9000"}, {"--conversations", "0"}} {
		if _, err := runCmd(t, append([]string{"bench", "route", "--quiet"}, bad...)...); err == nil {
			t.Errorf("no error for %v", bad)
		}
	}
}
