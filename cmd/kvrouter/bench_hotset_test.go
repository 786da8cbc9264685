package main

import (
	"strings"
	"testing"
)

func TestBenchHotSetCommand(t *testing.T) {
	out, err := runCmd(t, "bench", "hotset", "--quiet", "--clients", "4", "--modes", "kv,dynamo-kv", "--speedup", "20",
		"--history-tokens", "512", "--conversations", "2", "--duration", "300ms", "--warmup", "0s")
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 3 || !strings.Contains(lines[0], "requests engine 1 / 2") || !strings.HasPrefix(lines[1], "4 ") || !strings.Contains(lines[2], "dynamo-kv") {
		t.Fatalf("unexpected table:\n%s", out)
	}
	for _, bad := range [][]string{{"--modes", "fastest"}, {"--clients", "0"}, {"--history-tokens", "0"}} {
		if _, err := runCmd(t, append([]string{"bench", "hotset", "--quiet"}, bad...)...); err == nil {
			t.Errorf("%v: no error", bad)
		}
	}
}
