package replay

import (
	"bytes"
	"context"
	"encoding/json"
	"image/png"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/lab/workload"
	"github.com/kvrouter/kvrouter/mocker/fleet"
)

func block(seed uint32, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = seed*100000 + uint32(i)
	}
	return out
}

func cat(parts ...[]uint32) []uint32 {
	var out []uint32
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

func TestCeilingHitRate(t *testing.T) {
	sys := block(1, 64) // 4 blocks of 16
	reqs := []workload.Request{
		{At: 0, Tokens: cat(sys, block(2, 32))},                   // 96 tokens, nothing seen
		{At: time.Second, Tokens: cat(sys, block(3, 16))},         // 80 tokens: the 4 system blocks hit
		{At: 2 * time.Second, Tokens: cat(sys, block(2, 32))},     // identical to the first: 5 of 6 blocks (last token computed)
		{At: 3 * time.Second, Tokens: cat(sys[:40], block(4, 8))}, // 48 tokens: 2 full blocks hit, the third differs
	}
	want := float64(0+64+80+32) / float64(96+80+96+48)
	if got := CeilingHitRate(reqs, 16); math.Abs(got-want) > 1e-12 {
		t.Fatalf("ceiling %v, want %v", got, want)
	}
	// Arrival order, not slice order, decides what was seen first.
	swapped := []workload.Request{reqs[2], reqs[1], reqs[0], reqs[3]}
	swapped[0].At, swapped[2].At = 0, 2*time.Second
	if got := CeilingHitRate(swapped, 16); math.Abs(got-want) > 1e-12 {
		t.Fatalf("ceiling over reordered requests %v, want %v", got, want)
	}
}

func TestDistAndPeaks(t *testing.T) {
	d := DistOf([]float64{5, 1, 4, 2, 3, 6, 7, 8, 9, 10})
	if d.Mean != 5.5 || d.P50 != 5 || d.P90 != 9 || d.P99 != 10 {
		t.Fatalf("dist %+v", d)
	}
	recs := []Record{
		{Worker: "a", SentMS: 0, E2EMS: 10},
		{Worker: "a", SentMS: 5, E2EMS: 10},
		{Worker: "a", SentMS: 10, E2EMS: 1}, // starts as the first ends
		{Worker: "b", SentMS: 0, E2EMS: 1},
		{Worker: "b", SentMS: 0, E2EMS: 1, Err: "failed"},
	}
	p := peakActive(recs)
	if p["a"] != 2 || p["b"] != 1 {
		t.Fatalf("peaks %v", p)
	}
}

// smallFleet keeps the end-to-end runs short: few, small engines that a
// shared-prefix workload overloads when routing ignores the caches.
func smallConfig() Config {
	cfg := DefaultConfig()
	cfg.Workers = 3
	cfg.Speedup = 20
	cfg.Fleet = fleet.DefaultConfig()
	cfg.Fleet.Engine.NumGPUBlocks = 2048
	return cfg
}

func sharedPrefixWorkload(t *testing.T) []workload.Request {
	syn := workload.DefaultSyntheticConfig()
	syn.Requests, syn.Groups, syn.SystemTokens, syn.QuestionTokens, syn.OutputTokens = 60, 3, 1024, 64, 8
	syn.Rate, syn.Turns, syn.ThinkTime = 20, 3, time.Second
	reqs, err := workload.Synthetic(syn)
	if err != nil {
		t.Fatal(err)
	}
	return reqs
}

// replaySharedPrefix replays the shared-prefix workload on a small fleet
// in each of modes and returns the results and the requests replayed.
func replaySharedPrefix(t *testing.T, modes ...string) (*Results, []workload.Request) {
	t.Helper()
	if testing.Short() {
		t.Skip("starts fleets")
	}
	cfg := smallConfig()
	cfg.Modes = modes
	reqs := sharedPrefixWorkload(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	res, err := Run(ctx, cfg, reqs)
	if err != nil {
		t.Fatal(err)
	}
	return res, reqs
}

func TestReplayModesEndToEnd(t *testing.T) {
	res, reqs := replaySharedPrefix(t, "kv", DynamoKV, "round-robin", "llm-d-precise", "sglang-cache-aware", "gie-approx-prefix")
	for _, mode := range res.Order {
		m := res.Modes[mode]
		if m.Requests != len(reqs) || m.Errors != 0 {
			t.Fatalf("%s: %d requests, %d errors (%s)", mode, m.Requests, m.Errors, m.FirstError)
		}
		if len(m.WorkerShare) != res.Config.Workers {
			t.Fatalf("%s: shares of %d workers, want %d: %v", mode, len(m.WorkerShare), res.Config.Workers, m.WorkerShare)
		}
		var sum float64
		for _, s := range m.WorkerShare {
			sum += s
		}
		if math.Abs(sum-1) > 1e-9 {
			t.Fatalf("%s: shares sum to %v", mode, sum)
		}
		for _, r := range res.Records(mode) {
			if r.OutputTokens != 8 || r.TTFTMS <= 0 || r.E2EMS < r.TTFTMS || r.Worker == "" {
				t.Fatalf("%s: bad record %+v", mode, r)
			}
		}
		if m.PrefixHitRate > m.CeilingHitRate+1e-9 {
			t.Fatalf("%s: hit rate %v above the ceiling %v", mode, m.PrefixHitRate, m.CeilingHitRate)
		}
	}
	// Sessions extend each other and share system prompts: a cache-aware
	// router must find far more of them cached than a cycle over workers.
	kv, rr := res.Modes["kv"], res.Modes["round-robin"]
	if kv.PrefixHitRate < 0.8*kv.CeilingHitRate {
		t.Errorf("kv hit rate %.3f, under 80%% of the ceiling %.3f", kv.PrefixHitRate, kv.CeilingHitRate)
	}
	if kv.PrefixHitRate <= rr.PrefixHitRate {
		t.Errorf("kv hit rate %.3f not above round-robin's %.3f", kv.PrefixHitRate, rr.PrefixHitRate)
	}

	dir := t.TempDir()
	res.Config.Workload = "synthetic"
	if err := WriteReport(dir, res); err != nil {
		t.Fatal(err)
	}
	var back struct {
		Modes map[string]map[string]json.RawMessage `json:"modes"`
	}
	b, err := os.ReadFile(filepath.Join(dir, "results.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	for _, key := range []string{"requests", "errors", "ttft_ms", "itl_ms", "e2e_ms", "output_tokens_per_s", "requests_per_s", "prefix_hit_rate", "ceiling_hit_rate", "worker_share", "peak_active"} {
		if _, ok := back.Modes["kv"][key]; !ok {
			t.Errorf("results.json lacks modes.kv.%s", key)
		}
	}
	for _, name := range []string{"ttft_cdf.png", "worker_load.png", "hit_rate.png"} {
		f, err := os.Open(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := png.Decode(f); err != nil {
			t.Errorf("%s: %v", name, err)
		}
		f.Close()
	}
	md, err := os.ReadFile(filepath.Join(dir, "report.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, mode := range res.Order {
		if !strings.Contains(string(md), "| "+mode+" |") {
			t.Errorf("report.md has no row for %s", mode)
		}
	}
}

func TestReplayTarget(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a fleet")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	fcfg := fleet.DefaultConfig()
	fcfg.SpeedupRatio, fcfg.HTTPPort, fcfg.KVEventsPort, fcfg.KVEventsReplayPort = 20, 0, 0, 0
	engines, err := fleet.Start(ctx, fcfg)
	if err != nil {
		t.Fatal(err)
	}
	defer engines.Close()
	cfg := smallConfig()
	cfg.Target = engines.Engines()[0].HTTPURL
	reqs := sharedPrefixWorkload(t)[:20]
	res, err := Run(ctx, cfg, reqs)
	if err != nil {
		t.Fatal(err)
	}
	m := res.Modes["target"]
	if m == nil || m.Requests != 20 || m.Errors != 0 {
		t.Fatalf("target run: %+v", m)
	}
	if res.Config.Model != fcfg.Server.Model {
		t.Fatalf("model %q, want the target's %q", res.Config.Model, fcfg.Server.Model)
	}
	// One engine sees every request: it reports the prefix hits itself.
	if m.PrefixHitRate <= 0 {
		t.Fatalf("no prefix hits reported by the engine")
	}
}

func TestReplayUnreachableTargetFailsFast(t *testing.T) {
	cfg := smallConfig()
	cfg.Target = "http://127.0.0.1:1"
	start := time.Now()
	_, err := Run(context.Background(), cfg, []workload.Request{{Tokens: []uint32{1, 2, 3}, OSL: 1}})
	if err == nil || !strings.Contains(err.Error(), "unreachable") {
		t.Fatalf("err = %v, want an unreachable target", err)
	}
	if time.Since(start) > 6*time.Second {
		t.Fatalf("took %v to give up", time.Since(start))
	}
}

// A pooled cache of the fleet's size loses what LRU evicts, the tail of a
// prompt before its prefix; with room for everything it is the infinite
// ceiling.
func TestPooledCeiling(t *testing.T) {
	a, c, d := block(1, 32), block(2, 16), block(3, 16) // 2, 1 and 1 blocks of 16
	rate := func(capacity int, prompts ...[]uint32) (hits, total int) {
		pc := NewPooledCeiling(16, capacity)
		for _, p := range prompts {
			pc.Add(p)
		}
		return pc.Tokens()
	}
	// Room for all: a's second use hits its first block (the last token is
	// always computed).
	if h, _ := rate(100, a, c, a); h != 16 {
		t.Fatalf("ample room: %d tokens hit, want 16", h)
	}
	// Room for 3 blocks: d evicts the least recent, a's tail, so a's
	// prefix still hits.
	if h, _ := rate(3, a, c, d, a); h != 16 {
		t.Fatalf("tail evicted first: %d tokens hit, want 16", h)
	}
	// Room for 2: c and d push a out entirely.
	if h, _ := rate(2, a, c, d, a); h != 0 {
		t.Fatalf("a evicted: %d tokens hit, want 0", h)
	}
	reqs := []workload.Request{{Tokens: cat(a, c)}, {At: time.Second, Tokens: cat(a, d)}, {At: 2 * time.Second, Tokens: cat(a, c, d)}}
	inf, pooled := NewCeiling(16), NewPooledCeiling(16, 1000)
	for _, r := range reqs {
		inf.Add(r.Tokens)
		pooled.Add(r.Tokens)
	}
	if inf.Rate() != pooled.Rate() || inf.Rate() != CeilingHitRate(reqs, 16) {
		t.Fatalf("with room for everything the pooled ceiling %.3f should be the infinite one %.3f", pooled.Rate(), inf.Rate())
	}
}

func TestParseSetup(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want Setup
		err  bool
	}{
		{in: "kv", want: Setup{Mode: "kv", Workers: 8, MinUncached: -1}},
		{in: "round-robin@4p4d", want: Setup{Mode: "round-robin", Workers: 8, Prefill: 4, Decode: 4, MinUncached: -1}},
		{in: "kv@6", want: Setup{Mode: "kv", Workers: 6, MinUncached: -1}},
		{in: "dynamo-kv@2p6d+uncached=512+no-reuse", want: Setup{Mode: "dynamo-kv", Workers: 8, Prefill: 2, Decode: 6, MinUncached: 512, NoReuse: true}},
		{in: "kv@0p4d", err: true},
		{in: "kv@4p", err: true},
		{in: "kv+no-reuse", err: true}, // options need a disaggregated layout
		{in: "kv@4p4d+uncached=-1", err: true},
		{in: "kv@4p4d+colour=blue", err: true},
		{in: "direct@4p4d", err: true},
		{in: "kv@4+replicas=2", want: Setup{Mode: "kv", Workers: 4, MinUncached: -1, Replicas: 2}},
		{in: "kv+replicas=0", err: true},
		{in: "kv+replicas=x", err: true},
		{in: "kv@4p4d+replicas=2", err: true},
	} {
		got, err := ParseSetup(tc.in, 8, 0, 0)
		if (err != nil) != tc.err || !tc.err && got != tc.want {
			t.Errorf("ParseSetup(%q) = %+v, %v; want %+v (error %v)", tc.in, got, err, tc.want, tc.err)
		}
	}
	if s, err := ParseSetup("kv", 8, 3, 5); err != nil || s.Prefill != 3 || s.Decode != 5 || s.Engines() != 8 {
		t.Errorf("default layout not taken: %+v %v", s, err)
	}
	if s, err := ParseSetup("kv@8", 8, 3, 5); err != nil || s.Disaggregated() {
		t.Errorf("an explicit aggregated layout kept the default P/D one: %+v %v", s, err)
	}
}

func TestReplayDisaggregatedSetups(t *testing.T) {
	res, reqs := replaySharedPrefix(t, "kv@1p1d", "kv@1p1d+no-reuse", "kv@1p1d+uncached=100000")
	for _, mode := range res.Order {
		m := res.Modes[mode]
		if m.Requests != len(reqs) || m.Errors != 0 || m.Disagg == nil {
			t.Fatalf("%s: %d requests, %d errors (%s), disagg %+v", mode, m.Requests, m.Errors, m.FirstError, m.Disagg)
		}
		if m.PrefixHitRate != m.Disagg.PrefillHitRate {
			t.Fatalf("%s: hit rate %v is not the prefill-side one %v", mode, m.PrefixHitRate, m.Disagg.PrefillHitRate)
		}
	}
	pd, local := res.Modes["kv@1p1d"].Disagg, res.Modes["kv@1p1d+uncached=100000"].Disagg
	if pd.Prefills["remote"] != len(reqs) || pd.TransferredBlocks == 0 || pd.TransferredBytes == 0 {
		t.Fatalf("disaggregated: %+v", pd)
	}
	// One decode engine holds every earlier turn: it pulls only what is
	// new, far less than the prompts' blocks.
	if prompt := promptBlocks(reqs, smallConfig().Fleet.Engine.BlockSize); pd.TransferredBlocks >= prompt/2 {
		t.Fatalf("pulled %d blocks of %d prompt blocks: the decode engine's cache was not reused", pd.TransferredBlocks, prompt)
	}
	if local.Prefills["short_uncached"] != len(reqs) || local.TransferredBlocks != 0 {
		t.Fatalf("every prompt under the threshold should prefill on the decode engine: %+v", local)
	}
	var md bytes.Buffer
	if err := Markdown(&md, res); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(md.String(), "| kv@1p1d+no-reuse | 1 + 1 |") {
		t.Fatalf("report lacks the disaggregation table:\n%s", md.String())
	}
}

func promptBlocks(reqs []workload.Request, bs int) int {
	n := 0
	for _, r := range reqs {
		n += len(r.Tokens) / bs
	}
	return n
}
