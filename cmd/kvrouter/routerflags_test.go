package main

import (
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"

	"github.com/kvrouter/kvrouter/core/sched"
)

func parseRouterFlags(t *testing.T, env map[string]string, args ...string) (*routerFlags, *pflag.FlagSet, []string, error) {
	t.Helper()
	for k, v := range env {
		t.Setenv(k, v)
	}
	rf := newRouterFlags()
	fs := pflag.NewFlagSet("test", pflag.ContinueOnError)
	rf.register(fs)
	if err := fs.Parse(args); err != nil {
		t.Fatal(err)
	}
	if err := applyEnv(fs); err != nil {
		return nil, nil, nil, err
	}
	var warnings []string
	_, err := rf.config(fs, func(w string) { warnings = append(warnings, w) })
	return rf, fs, warnings, err
}

func TestRouterFlagsAndEnvironment(t *testing.T) {
	rf, fs, warn, err := parseRouterFlags(t, map[string]string{"DYN_ROUTER_TEMPERATURE": "0.5", "DYN_ROUTER_MODE": "random"},
		"--router-mode", "round-robin", "--router-queue-threshold", "none", "--no-router-kv-events", "--router-ttl-secs", "30")
	if err != nil {
		t.Fatal(err)
	}
	cfg, _ := rf.config(fs, func(string) {})
	if cfg.Mode != sched.ModeRoundRobin {
		t.Fatalf("the command line must beat the environment: mode %q", cfg.Mode)
	}
	if *cfg.Routing.Temperature != 0.5 || cfg.QueueThreshold != nil || cfg.KVEvents || cfg.ApproxTTL != 30*time.Second || len(warn) != 0 {
		t.Fatalf("config %+v warnings %v", cfg, warn)
	}

	_, _, warn, err = parseRouterFlags(t, map[string]string{"DYN_OVERLAP_SCORE_WEIGHT": "0"})
	if err != nil || len(warn) != 1 || !strings.Contains(warn[0], "deprecated") {
		t.Fatalf("legacy weight from the environment: %v %v", warn, err)
	}
	if _, _, _, err := parseRouterFlags(t, map[string]string{"DYN_ROUTER_EVENT_THREADS": "many"}); err == nil {
		t.Fatal("a malformed environment value must be an error")
	}
	if _, _, _, err := parseRouterFlags(t, nil, "--router-mode", "psychic"); err == nil {
		t.Fatal("unknown mode accepted")
	}
}

func TestParseWorker(t *testing.T) {
	w, err := parseWorker("url=http://h:8000,events=tcp://h:5557,replay=tcp://h:5558,dp=2,model=m,id=7,kv-blocks=100,max-batched-tokens=64,role=prefill")
	if err != nil || w.URL != "http://h:8000" || w.DPSize != 2 || w.ID != 7 || w.KVBlocks != 100 || w.MaxBatchedTokens != 64 || w.Replay != "tcp://h:5558" || w.Role != "prefill" {
		t.Fatalf("%+v %v", w, err)
	}
	for _, bad := range []string{"url", "dp=two", "colour=blue", "role=prefil"} {
		if _, err := parseWorker(bad); err == nil {
			t.Fatalf("%q accepted", bad)
		}
	}
}

func TestKVEventsGraceFlag(t *testing.T) {
	rf, fs, _, err := parseRouterFlags(t, nil)
	if err != nil {
		t.Fatal(err)
	}
	if cfg, _ := rf.config(fs, func(string) {}); cfg.KVEventsGrace != 10*time.Second {
		t.Fatalf("default grace %v, want 10s", cfg.KVEventsGrace)
	}
	rf, fs, _, err = parseRouterFlags(t, map[string]string{"DYN_ROUTER_KV_EVENTS_GRACE_SECS": "2.5"})
	if err != nil {
		t.Fatal(err)
	}
	if cfg, _ := rf.config(fs, func(string) {}); cfg.KVEventsGrace != 2500*time.Millisecond {
		t.Fatalf("grace from the environment %v, want 2.5s", cfg.KVEventsGrace)
	}
}
