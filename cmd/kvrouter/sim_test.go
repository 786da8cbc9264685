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
