package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
)

// The names scripts read: modes.<mode>.goodput_rps, points[] with
// arrival_speedup, ttft_ms, itl_ms and hit_rate, wall_s and model_s; the
// file and --json print the same document.
func TestSimCommandWritesResults(t *testing.T) {
	dir := t.TempDir()
	var stdout, stderr bytes.Buffer
	cmd := newRootCmd()
	cmd.SetOut(&stdout)
	cmd.SetErr(&stderr)
	cmd.SetArgs([]string{"sim", "--synthetic", "--synthetic-requests", "120", "--workers", "2", "--modes", "kv,round-robin",
		"--arrival-speedup", "1,4", "--slo-ttft-p90", "1s", "--bisect-steps", "1", "--seed", "5", "--out", dir, "--json"})
	if err := cmd.Execute(); err != nil {
		t.Fatalf("%v\n%s", err, stderr.String())
	}
	var res struct {
		Modes map[string]struct {
			GoodputRPS *float64 `json:"goodput_rps"`
			Points     []struct {
				ArrivalSpeedup float64 `json:"arrival_speedup"`
				TTFT           struct {
					Mean, P50, P90, P99 *float64
				} `json:"ttft_ms"`
				ITL struct {
					P50, P90 *float64
				} `json:"itl_ms"`
				HitRate *float64 `json:"hit_rate"`
			} `json:"points"`
		} `json:"modes"`
		WallS  *float64 `json:"wall_s"`
		ModelS *float64 `json:"model_s"`
	}
	if err := json.Unmarshal(stdout.Bytes(), &res); err != nil {
		t.Fatalf("--json: %v\n%s", err, stdout.String())
	}
	if len(res.Modes) != 2 || res.WallS == nil || res.ModelS == nil || *res.ModelS <= 0 {
		t.Fatalf("results: %s", stdout.String())
	}
	for name, m := range res.Modes {
		if m.GoodputRPS == nil || len(m.Points) != 2 || m.Points[1].ArrivalSpeedup != 4 {
			t.Fatalf("%s: %s", name, stdout.String())
		}
		for _, p := range m.Points {
			if p.TTFT.Mean == nil || p.TTFT.P50 == nil || p.TTFT.P90 == nil || p.TTFT.P99 == nil || p.ITL.P50 == nil || p.ITL.P90 == nil || p.HitRate == nil {
				t.Fatalf("%s: a point lacks a field: %s", name, stdout.String())
			}
		}
	}
	file, err := os.ReadFile(filepath.Join(dir, "results.json"))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(file, stdout.Bytes()) {
		t.Fatal("results.json and --json differ")
	}
	for _, f := range []string{"report.md", "ttft_vs_load.png", "itl_vs_load.png", "hit_rate_vs_load.png"} {
		if st, err := os.Stat(filepath.Join(dir, f)); err != nil || st.Size() == 0 {
			t.Fatalf("%s: %v", f, err)
		}
	}
	if !bytes.Contains(stderr.Bytes(), []byte("kv ")) {
		t.Fatalf("no progress on stderr: %s", stderr.String())
	}
}

func TestBenchSimReportsSpeed(t *testing.T) {
	var stdout, stderr bytes.Buffer
	cmd := newRootCmd()
	cmd.SetOut(&stdout)
	cmd.SetErr(&stderr)
	cmd.SetArgs([]string{"bench", "sim", "--synthetic", "--synthetic-requests", "60", "--workers", "2", "--json", "--quiet"})
	if err := cmd.Execute(); err != nil {
		t.Fatalf("%v\n%s", err, stderr.String())
	}
	var res simBenchResult
	if err := json.Unmarshal(stdout.Bytes(), &res); err != nil {
		t.Fatal(err)
	}
	if res.Requests != 60 || res.ModelS <= 0 || res.WallS <= 0 || res.Speed <= 0 || res.PeakRSSMB <= 0 || res.TTFTP90MS <= 0 {
		t.Fatalf("%+v", res)
	}
}

// The disaggregated fleet's flags reach results.json: config.disagg with
// serve's and the mocker's names, and each point's disagg figures.
func TestSimCommandDisaggregated(t *testing.T) {
	run := func(args ...string) ([]byte, error) {
		var stdout, stderr bytes.Buffer
		cmd := newRootCmd()
		cmd.SetOut(&stdout)
		cmd.SetErr(&stderr)
		cmd.SetArgs(append([]string{"sim", "--synthetic", "--synthetic-requests", "120", "--modes", "kv",
			"--arrival-speedup", "1", "--bisect-steps", "0", "--quiet", "--json"}, args...))
		err := cmd.Execute()
		return stdout.Bytes(), err
	}
	out, err := run("--prefill-workers", "1", "--decode-workers", "2", "--disagg-min-uncached-tokens", "64",
		"--no-router-assume-kv-reuse", "--kv-bytes-per-token", "1000", "--kv-transfer-bandwidth", "1e9")
	if err != nil {
		t.Fatal(err)
	}
	var res struct {
		Config struct {
			Workers int `json:"workers"`
			Disagg  *struct {
				PrefillWorkers    int     `json:"prefill_workers"`
				DecodeWorkers     int     `json:"decode_workers"`
				MinUncachedTokens int     `json:"disagg_min_uncached_tokens"`
				NoAssumeKVReuse   bool    `json:"no_router_assume_kv_reuse"`
				KVBytesPerToken   int     `json:"kv_bytes_per_token"`
				Bandwidth         float64 `json:"kv_transfer_bandwidth"`
			} `json:"disagg"`
		} `json:"config"`
		Modes map[string]struct {
			Points []struct {
				Disagg *struct {
					Remote       int                    `json:"remote_prefills"`
					Transferred  float64                `json:"transferred_blocks_per_request"`
					Bytes        float64                `json:"transferred_bytes_per_request"`
					PrefillTTFT  struct{ P90 *float64 } `json:"prefill_ttft_ms"`
					LocalPrefill struct {
						Short *int `json:"short_uncached"`
					} `json:"local_prefills"`
				} `json:"disagg"`
			} `json:"points"`
		} `json:"modes"`
	}
	if err := json.Unmarshal(out, &res); err != nil {
		t.Fatal(err)
	}
	d := res.Config.Disagg
	if d == nil || res.Config.Workers != 3 || d.PrefillWorkers != 1 || d.DecodeWorkers != 2 || d.MinUncachedTokens != 64 ||
		!d.NoAssumeKVReuse || d.KVBytesPerToken != 1000 || d.Bandwidth != 1e9 {
		t.Fatalf("config: %s", out)
	}
	p := res.Modes["kv"].Points[0].Disagg
	if p == nil || p.Remote == 0 || p.Transferred <= 0 || p.Bytes != p.Transferred*16*1000 || p.PrefillTTFT.P90 == nil || p.LocalPrefill.Short == nil {
		t.Fatalf("point: %s", out)
	}
	for _, bad := range [][]string{
		{"--prefill-workers", "2"},
		{"--prefill-workers", "2", "--decode-workers", "2", "--workers", "4"},
		{"--prefill-workers", "2", "--decode-workers", "2", "--kv-transfer-bandwidth", "0"},
	} {
		if _, err := run(bad...); err == nil {
			t.Errorf("%v accepted", bad)
		}
	}
}

// --router-replicas runs replicas and reports their agreement with a
// single router in results.json; the flags refuse what they cannot run.
func TestSimCommandRouterReplicas(t *testing.T) {
	run := func(args ...string) (string, error) {
		var stdout, stderr bytes.Buffer
		cmd := newRootCmd()
		cmd.SetOut(&stdout)
		cmd.SetErr(&stderr)
		cmd.SetArgs(append([]string{"sim", "--synthetic", "--synthetic-requests", "120", "--workers", "2", "--modes", "kv",
			"--arrival-speedup", "2", "--bisect-steps", "0", "--quiet", "--json"}, args...))
		err := cmd.Execute()
		return stdout.String(), err
	}
	dir := t.TempDir()
	out, err := run("--router-replicas", "3", "--replica-sync-delay", "10ms", "--out", dir)
	if err != nil {
		t.Fatal(err)
	}
	if md, err := os.ReadFile(filepath.Join(dir, "report.md")); err != nil || !bytes.Contains(md, []byte("3 router replicas")) || !bytes.Contains(md, []byte("| 2 | 120 |")) {
		t.Fatalf("report.md lacks the replicas' table: %v\n%s", err, md)
	}
	var res struct {
		Modes map[string]struct {
			Points []struct {
				Replicas *struct {
					Replicas       int      `json:"replicas"`
					Decisions      int      `json:"decisions"`
					IdenticalShare *float64 `json:"identical_share"`
					Messages       int      `json:"sync_messages"`
				} `json:"replicas"`
			} `json:"points"`
		} `json:"modes"`
		Config struct {
			Replicas *struct {
				Replicas    int     `json:"replicas"`
				Sync        bool    `json:"sync"`
				SyncDelayMS float64 `json:"sync_delay_ms"`
			} `json:"replicas"`
		} `json:"config"`
	}
	if err := json.Unmarshal([]byte(out), &res); err != nil {
		t.Fatal(err)
	}
	c := res.Config.Replicas
	if c == nil || c.Replicas != 3 || !c.Sync || c.SyncDelayMS != 10 {
		t.Fatalf("config.replicas: %s", out)
	}
	p := res.Modes["kv"].Points[0].Replicas
	if p == nil || p.Replicas != 3 || p.Decisions != 120 || p.IdenticalShare == nil || p.Messages != 360 {
		t.Fatalf("points[0].replicas: %s", out)
	}
	if out, err = run("--router-replicas", "3", "--replica-sync-delay", "off"); err != nil || !bytes.Contains([]byte(out), []byte(`"sync": false`)) || !bytes.Contains([]byte(out), []byte(`"spread": "request"`)) {
		t.Fatalf("off: %v\n%s", err, out)
	}
	if out, err = run("--router-replicas", "3", "--replica-spread", "session"); err != nil || !bytes.Contains([]byte(out), []byte(`"spread": "session"`)) {
		t.Fatalf("session: %v\n%s", err, out)
	}
	for _, bad := range [][]string{
		{"--replica-sync-delay", "10ms"},
		{"--router-replicas", "0"},
		{"--router-replicas", "2", "--replica-sync-delay", "soon"},
		{"--router-replicas", "2", "--replica-sync-delay", "-1ms"},
		{"--replica-spread", "burst"},
		{"--router-replicas", "2", "--replica-spread", "sticky"},
	} {
		if _, err := run(bad...); err == nil {
			t.Fatalf("%v: no error", bad)
		}
	}
}

// --trace-spread-batches spaces a batch logged at one timestamp over the
// gap that follows it (the last batch over the mean gap), so the run
// offers the same requests over a longer span; other workloads refuse it.
func TestSimSpreadsTraceBatches(t *testing.T) {
	path := writeTrace(t, `{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}
{"timestamp": 3000, "input_length": 1500, "output_length": 5, "hash_ids": [0, 1, 2]}
{"timestamp": 3000, "input_length": 700, "output_length": 5, "hash_ids": [0, 3]}
`)
	rate := func(extra ...string) float64 {
		t.Helper()
		out, err := runCmd(t, append([]string{"sim", "--trace", path, "--workers", "2", "--modes", "kv",
			"--arrival-speedup", "1", "--bisect-steps", "0", "--json", "--quiet"}, extra...)...)
		if err != nil {
			t.Fatal(err)
		}
		var res struct {
			Modes map[string]struct {
				Points []struct {
					ArrivalRPS float64 `json:"arrival_rps"`
				} `json:"points"`
			} `json:"modes"`
		}
		if err := json.Unmarshal([]byte(out), &res); err != nil || len(res.Modes["kv"].Points) != 1 {
			t.Fatalf("%v: %s", err, out)
		}
		return res.Modes["kv"].Points[0].ArrivalRPS
	}
	if at, spread := rate(), rate("--trace-spread-batches"); at != 1 || spread != 3/4.5 {
		t.Fatalf("arrival rate %v at the logged instants, %v spread; want 1 (3 requests over 3 s) and 0.667 (over 4.5 s)", at, spread)
	}
	if _, err := runCmd(t, "sim", "--synthetic", "--trace-spread-batches", "--json"); err == nil {
		t.Fatal("--trace-spread-batches accepted without a trace")
	}
}
