package main

import (
	"encoding/json"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/lab/bench"
)

// TestBenchOverheadTextPrompts runs a tiny load of text and chat prompts:
// both tokenizer paths must run (the command itself fails when a run's
// tokenize counter shows the other path) and be reported side by side.
func TestBenchOverheadTextPrompts(t *testing.T) {
	dir := filepath.Join("..", "..", "adapters", "hftokenizer", "testdata", "llama3")
	for _, p := range []string{"text", "chat"} {
		t.Run(p, func(t *testing.T) {
			out, err := runCmd(t, "bench", "overhead", "--engines", "in-process", "--prompt", p, "--tokenizer", dir, "--workers", "2", "--concurrency", "2",
				"--isl", "300", "--osl", "2", "--short-isl", "32", "--short-concurrency", "2", "--warmup", "50ms", "--duration", "200ms", "--quiet")
			if err != nil {
				t.Fatalf("%v\n%s", err, out)
			}
			for _, want := range []string{
				"routed, tokenized in-process", "routed, engine /tokenize",
				"short routed, tokenized in-process", "short routed, engine /tokenize",
				"kvrouter_frontend_tokenize_total of the in_process run: map[in_process:",
				"kvrouter_frontend_tokenize_total of the engine run: map[engine:",
				"engine drift",
			} {
				if !strings.Contains(out, want) {
					t.Errorf("no %q in\n%s", want, out)
				}
			}
		})
	}
	if _, err := runCmd(t, "bench", "overhead", "--prompt", "text", "--quiet"); err == nil || !strings.Contains(err.Error(), "need a tokenizer") {
		t.Fatalf("text prompts without a tokenizer: %v", err)
	}
}

// --ui-page keeps a dashboard polling through the routed phases: it must
// have polled and been sent decisions, or the figure it labels is not
// what it says.
func TestBenchOverheadWithDashboardOpen(t *testing.T) {
	out, err := runCmd(t, "bench", "overhead", "--engines", "in-process", "--ui-page", "--workers", "2", "--concurrency", "2",
		"--isl", "64", "--osl", "2", "--short-isl", "32", "--short-concurrency", "2", "--warmup", "50ms", "--duration", "1200ms", "--quiet")
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	m := regexp.MustCompile(`dashboard open during the routed phases: (\d+) polls, (\d+) decisions sent`).FindStringSubmatch(out)
	if m == nil || m[1] == "0" || m[2] == "0" {
		t.Fatalf("the dashboard did not poll or saw no decision:\n%s", out)
	}
	// The frontend's own time leaves the admission queue out, so it is
	// never above the time the frontend held a request.
	held := regexp.MustCompile(`held a request before the engine got it: p50 ([\d.]+) ms, p99 ([\d.]+) ms`).FindStringSubmatch(out)
	own := regexp.MustCompile(`the frontend's own time: p50 ([\d.]+) ms, p99 ([\d.]+) ms`).FindStringSubmatch(out)
	if held == nil || own == nil {
		t.Fatalf("no frontend times:\n%s", out)
	}
	for i := 1; i <= 2; i++ {
		h, _ := strconv.ParseFloat(held[i], 64)
		o, _ := strconv.ParseFloat(own[i], 64)
		if o > h || h <= 0 {
			t.Errorf("frontend held %v ms, own time %v ms", h, o)
		}
	}
}

// By default the engines run as a kvrouter mocker child process (this test
// binary standing in for kvrouter, see TestMain): every phase must carry
// load and read the engines' pacing from the child's metrics. The clients
// run in child processes of their own here (--clients process), which must
// bring back every phase's figures.
func TestBenchOverheadEnginesInAChildProcess(t *testing.T) {
	t.Setenv(cliEnv, "1")
	out, err := runCmd(t, "bench", "overhead", "--clients", "process", "--clients-nice", "5", "--workers", "2", "--concurrency", "2", "--isl", "64", "--osl", "2",
		"--short-isl", "32", "--short-concurrency", "2", "--warmup", "50ms", "--duration", "300ms", "--quiet", "--json")
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	var res bench.OverheadResult
	if err := json.Unmarshal([]byte(out), &res); err != nil {
		t.Fatal(err)
	}
	if res.Config.EngineProcess == nil || res.Config.EngineProcess.Nice != 10 {
		t.Fatalf("engines not in a child process: %+v", res.Config)
	}
	if res.Config.ClientProcess == nil || res.Config.ClientProcess.Nice != 5 {
		t.Fatalf("clients not in a child process: %+v", res.Config)
	}
	for name, p := range map[string]bench.Phase{"direct": res.Direct, "routed": res.Routed, "short direct": res.ShortDirect, "short routed": res.ShortRouted} {
		if p.Requests == 0 || p.Errors != 0 {
			t.Errorf("%s: %d requests, %d errors", name, p.Requests, p.Errors)
		}
		// The drift is read from the child's counters: with no reading it
		// would be exactly 0, and a step never takes less wall time than
		// its model time by more than the clock's rounding.
		if p.EngineDrift == 0 || p.EngineDrift < -0.01 {
			t.Errorf("%s: engine drift %v", name, p.EngineDrift)
		}
	}
	// Each part of the frontend's time is a part of every request's, so
	// no percentile of a part exceeds the same percentile of the whole.
	for name, p := range map[string]bench.Phase{"routed": res.Routed, "short routed": res.ShortRouted} {
		s := p.FrontendSplit
		if s == nil {
			t.Fatalf("%s: no split of the frontend's time", name)
		}
		for part, v := range map[string][2]float64{"read": {s.ReadP50ms, s.ReadP99ms}, "tokenize": {s.TokenizeP50ms, s.TokenizeP99ms},
			"routing": {s.RoutingP50ms, s.RoutingP99ms}, "hashing": {s.HashP50ms, s.HashP99ms}, "find_matches": {s.FindP50ms, s.FindP99ms},
			"scheduling": {s.ScheduleP50ms, s.ScheduleP99ms}, "other": {s.OtherP50ms, s.OtherP99ms}} {
			if v[0] < 0 || v[0] > p.FrontendP50ms || v[1] > p.FrontendP99ms {
				t.Errorf("%s: %s p50 %v / p99 %v against the frontend's %v / %v", name, part, v[0], v[1], p.FrontendP50ms, p.FrontendP99ms)
			}
		}
		for part, p99 := range map[string]float64{"hashing": s.HashP99ms, "find_matches": s.FindP99ms, "scheduling": s.ScheduleP99ms} {
			if p99 > s.RoutingP99ms {
				t.Errorf("%s: %s p99 %v above routing's %v", name, part, p99, s.RoutingP99ms)
			}
		}
		// Scoring and booking take microseconds, never nothing: 0 would
		// mean the frontend's scheduling_ms went unread.
		if s.ScheduleP99ms <= 0 {
			t.Errorf("%s: scheduling p99 %v", name, s.ScheduleP99ms)
		}
	}
	if res.Direct.FrontendSplit != nil {
		t.Errorf("the direct phase reports a frontend split")
	}
	if _, err := runCmd(t, "bench", "overhead", "--engines", "gpu", "--quiet"); err == nil || !strings.Contains(err.Error(), "--engines must be") {
		t.Fatalf("--engines gpu: %v", err)
	}
	if _, err := runCmd(t, "bench", "overhead", "--clients", "elsewhere", "--quiet"); err == nil || !strings.Contains(err.Error(), "--clients must be") {
		t.Fatalf("--clients elsewhere: %v", err)
	}
}
