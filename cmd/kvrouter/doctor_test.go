package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/internal/doctor"
)

func runDoctor(t *testing.T, args ...string) (string, error) {
	t.Helper()
	root := newRootCmd()
	var out, stderr bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&stderr)
	root.SetArgs(append([]string{"doctor", "--duration", "1500ms"}, args...))
	err := root.Execute()
	t.Logf("stdout:\n%s\nstderr:\n%s", out.String(), stderr.String())
	return out.String(), err
}

// doctor takes serve's worker spec and, on an engine set up right, exits 0
// with every check ok in its JSON.
func TestDoctorCommandPassesOnTheMocker(t *testing.T) {
	cfg, e := mockEngine(t)
	out, err := runDoctor(t, "--json", "--probe-request",
		"--worker", "url="+e.HTTPURL+",events="+e.Ranks[0].Events+",replay="+e.Ranks[0].Replay+",model="+cfg.Server.Model)
	if err != nil {
		t.Fatalf("doctor failed on a healthy engine: %v", err)
	}
	var report doctor.Report
	if err := json.Unmarshal([]byte(out), &report); err != nil {
		t.Fatalf("--json output: %v", err)
	}
	if len(report.Checks) < 9 || report.Count(doctor.OK) != len(report.Checks) {
		t.Errorf("want every check ok, got %d of %d", report.Count(doctor.OK), len(report.Checks))
	}
	for _, c := range report.Checks {
		if c.Engine != "worker-1" {
			t.Errorf("check %s names engine %q, want serve's default name worker-1", c.Name, c.Engine)
		}
	}
}

// A failed check makes the command fail, and the text says what to fix. A
// wrong model= fails the models check alone: /tokenize and the probe use a
// model the engine serves.
func TestDoctorCommandFailsOnAWrongModel(t *testing.T) {
	_, e := mockEngine(t)
	out, err := runDoctor(t, "--worker", "url="+e.HTTPURL+",events="+e.Ranks[0].Events+",model=nope")
	if err == nil {
		t.Fatal("doctor passed with a model the engine does not serve")
	}
	for _, want := range []string{`fail  models     model="nope" is not served`, "fix: set model=kvrouter-mock", "ok    tokenize", "failed"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q", want)
		}
	}
}

func TestDoctorCommandNeedsAnEngine(t *testing.T) {
	if _, err := runDoctor(t); err == nil || !strings.Contains(err.Error(), "--worker") {
		t.Errorf("want an error naming --worker, got %v", err)
	}
}

// --config takes serve's file, engine names included.
func TestDoctorCommandReadsServesConfigFile(t *testing.T) {
	cfg, e := mockEngine(t)
	path := filepath.Join(t.TempDir(), "workers.json")
	file := fmt.Sprintf(`{"workers": [{"name": "gpu-a", "url": %q, "events": %q, "replay": %q, "model": %q, "dp_size": 1}]}`,
		e.HTTPURL, e.Ranks[0].Events, e.Ranks[0].Replay, cfg.Server.Model)
	if err := os.WriteFile(path, []byte(file), 0o600); err != nil {
		t.Fatal(err)
	}
	out, err := runDoctor(t, "--probe-request", "--config", path)
	if err != nil {
		t.Fatalf("doctor failed on a healthy engine: %v", err)
	}
	if !strings.HasPrefix(out, "gpu-a\n") || !strings.Contains(out, "ok    events") {
		t.Errorf("want the report of engine gpu-a with its events ok")
	}
}
