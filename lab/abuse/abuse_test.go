package abuse

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"
)

// A quick pass of the suite: the scenarios the router must pass, and the
// label flood at a small size, whose verdict depends on the label bound
// and is only checked for its figures.
func TestSuiteSmoke(t *testing.T) {
	if testing.Short() {
		t.Skip("starts routers and engines")
	}
	cfg := DefaultConfig()
	cfg.Scenarios = []string{"engine-hang", "engine-short-body", "label-flood", "cancel-storm"}
	cfg.Requests, cfg.LabelModels, cfg.CancelClients = 40, 100, 50
	cfg.HeaderTimeout = 500 * time.Millisecond
	start := time.Now()
	res, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if took := time.Since(start); took > 30*time.Second {
		t.Errorf("the smoke run took %v", took)
	}
	if len(res.Verdicts) != len(cfg.Scenarios) {
		t.Fatalf("%d verdicts for %d scenarios", len(res.Verdicts), len(cfg.Scenarios))
	}
	for _, v := range res.Verdicts {
		if v.Error != "" {
			t.Errorf("%s could not run: %s", v.Scenario, v.Error)
		}
		if v.Scenario != "label-flood" && !v.Pass {
			t.Errorf("%s: %s (want %s)", v.Scenario, v.Measured, v.Want)
		}
	}
	labels := res.Verdicts[2]
	if labels.Figures["series_after"] <= labels.Figures["series_before"] || labels.Measured == "" {
		t.Errorf("label flood measured nothing: %+v", labels)
	}
	table := Table(res)
	for _, name := range cfg.Scenarios {
		if !strings.Contains(table, name) {
			t.Errorf("the table lacks %s:\n%s", name, table)
		}
	}
	b, err := JSON(res)
	if err != nil {
		t.Fatal(err)
	}
	var back Results
	if err := json.Unmarshal(b, &back); err != nil || len(back.Verdicts) != len(res.Verdicts) {
		t.Fatalf("JSON does not round-trip: %v", err)
	}
}

func TestUnknownScenario(t *testing.T) {
	if _, err := Run(context.Background(), Config{Scenarios: []string{"engine-hang", "nope"}}); err == nil || !strings.Contains(err.Error(), `"nope"`) {
		t.Fatalf("err = %v", err)
	}
}
