package main

import (
	"fmt"
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
	if w, err := parseWorker("url=http://h:8000,device=cpu"); err != nil || w.Device != "cpu" {
		t.Fatalf("device: %+v %v", w, err)
	}
	for _, bad := range []string{"url", "dp=two", "colour=blue", "role=prefil", "url=http://h:8000,device=c p u"} {
		if _, err := parseWorker(bad); err == nil {
			t.Fatalf("%q accepted", bad)
		}
	}
}

// DYN_ENCODER_CUDA_TO_CPU_RATIO is Dynamo's only spelling of the ratio;
// where Dynamo falls back to 8 on a value it cannot read, kvrouter stops.
func TestCUDAToCPURatio(t *testing.T) {
	for _, tc := range []struct {
		env  map[string]string
		args []string
		want int
		err  string
	}{
		{nil, nil, 8, ""},
		{map[string]string{"DYN_ENCODER_CUDA_TO_CPU_RATIO": "3"}, nil, 3, ""},
		{map[string]string{"DYN_ENCODER_CUDA_TO_CPU_RATIO": "3"}, []string{"--encoder-cuda-to-cpu-ratio", "5"}, 5, ""},
		{map[string]string{"DYN_ENCODER_CUDA_TO_CPU_RATIO": "eight"}, nil, 0, `DYN_ENCODER_CUDA_TO_CPU_RATIO="eight"`},
		{map[string]string{"DYN_ENCODER_CUDA_TO_CPU_RATIO": "2.5"}, nil, 0, `DYN_ENCODER_CUDA_TO_CPU_RATIO="2.5"`},
		{map[string]string{"DYN_ENCODER_CUDA_TO_CPU_RATIO": "0"}, nil, 0, "want a whole number ≥ 1"},
		{nil, []string{"--encoder-cuda-to-cpu-ratio", "-2"}, 0, "DYN_ENCODER_CUDA_TO_CPU_RATIO"},
	} {
		t.Run(fmt.Sprint(tc.env, tc.args), func(t *testing.T) {
			rf, fs, _, err := parseRouterFlags(t, tc.env, tc.args...)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Errorf("error %v, want one naming %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if cfg, _ := rf.config(fs, func(string) {}); cfg.NonCPUToCPURatio != tc.want {
				t.Errorf("ratio %d, want %d", cfg.NonCPUToCPURatio, tc.want)
			}
		})
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

func TestDynamoCostFlags(t *testing.T) {
	t.Run("defaults", testDynamoCostDefaults)
	rf, fs, _, err := parseRouterFlags(t, map[string]string{
		"DYN_ROUTER_HOST_CACHE_HIT_WEIGHT": "0.5", "DYN_ROUTER_DISK_CACHE_HIT_WEIGHT": "0.1",
		"DYN_SHARED_CACHE_TYPE": "hicache", "DYN_SHARED_CACHE_MULTIPLIER": "0.3",
		"DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT_DECAY": "2", "DYN_ROUTER_DECODE_ACTIVE_REQUEST_WEIGHT": "4",
	}, "--router-disk-cache-hit-weight", "0.2")
	if err != nil {
		t.Fatal(err)
	}
	cfg, _ := rf.config(fs, func(string) {})
	p, _, err := sched.Resolve(cfg.Routing, sched.Overrides{})
	if err != nil {
		t.Fatal(err)
	}
	if p.HostHitWeight != 0.5 || p.DiskHitWeight != 0.2 || !p.SharedCache || p.SharedMultiplier != 0.3 || p.CreditDecay != 2 || p.DecodeRequestWeight != 4 {
		t.Fatalf("params %+v", p)
	}
}

func testDynamoCostDefaults(t *testing.T) {
	rf, fs, _, err := parseRouterFlags(t, nil)
	if err != nil {
		t.Fatal(err)
	}
	cfg, _ := rf.config(fs, func(string) {})
	p, _, _ := sched.Resolve(cfg.Routing, sched.Overrides{})
	if p.HostHitWeight != 0.75 || p.DiskHitWeight != 0.25 || p.SharedCache || p.SharedMultiplier != 0.5 || p.CreditDecay != 0 || p.DecodeRequestWeight != 0 {
		t.Fatalf("Dynamo's defaults: %+v", p)
	}
	for _, bad := range [][]string{
		{"--shared-cache-type", "mooncake"}, {"--router-host-cache-hit-weight", "2"}, {"--router-kv-overlap-score-credit-decay", "-1"},
	} {
		rf, fs, _, err := parseRouterFlags(t, nil, bad...)
		if err == nil {
			cfg, _ := rf.config(fs, func(string) {})
			_, _, err = sched.Resolve(cfg.Routing, sched.Overrides{})
		}
		if err == nil {
			t.Errorf("%v accepted", bad)
		}
	}
}

func TestPrefillLoadModelFlag(t *testing.T) {
	rf, fs, _, err := parseRouterFlags(t, map[string]string{"DYN_ROUTER_PREFILL_LOAD_MODEL": "learned"})
	if err != nil {
		t.Fatal(err)
	}
	if cfg, err := rf.config(fs, func(string) {}); err != nil || cfg.PrefillLoadModel != "learned" {
		t.Fatalf("%q %v", cfg.PrefillLoadModel, err)
	}
	if _, _, _, err := parseRouterFlags(t, nil, "--router-prefill-load-model", "aic"); err == nil || !strings.Contains(err.Error(), "learned") {
		t.Fatalf("aic: %v, want a refusal naming learned", err)
	}
}
