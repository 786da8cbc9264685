package sim

import (
	"bytes"
	"encoding/json"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/index"
)

// The routers of a run keep the one-goroutine index, and it decides as the
// sharded one: a sweep gives the same bytes with either (a memory cap
// that is never reached keeps the sharded index).
func TestOneGoroutineIndexKeepsEveryDecision(t *testing.T) {
	w := synthetic(t, 240)
	run := func(sharded bool) []byte {
		cfg := smallConfig()
		cfg.Engine.NumGPUBlocks = 512 // engines evict: Removed events matter
		if !cfg.oneGoroutineIndex(cfg.Workers, cfg.Router.IndexBudgetPairs) {
			t.Fatal("the test's fleet does not take the one-goroutine index")
		}
		if sharded {
			cfg.Router.MaxIndexedPairs = 1 << 40
		}
		res, err := Sweep(SweepConfig{
			Sim: cfg, Modes: []string{"kv", "llm-d-precise"}, ArrivalSpeedups: []float64{1, 4, 8},
			SLOTTFTP90: 200 * time.Millisecond, BisectSteps: 0, Parallel: 1,
		}, w)
		if err != nil {
			t.Fatal(err)
		}
		res.WallS = 0
		b, err := json.Marshal(res)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	if a, b := run(false), run(true); !bytes.Equal(a, b) {
		t.Fatalf("one-goroutine and sharded indexes decide differently:\n%s\n%s", a, b)
	}
}

// Fleets the one-goroutine index cannot hold keep the sharded one.
func TestOneGoroutineIndexOnlyWhereItHolds(t *testing.T) {
	cfg := smallConfig()
	if !cfg.oneGoroutineIndex(64, 0) || cfg.oneGoroutineIndex(65, 0) {
		t.Fatal("64 ranks fit, 65 do not")
	}
	cfg.DPSize = 2
	if cfg.oneGoroutineIndex(33, 0) {
		t.Fatal("33 engines of 2 ranks do not fit")
	}
	cfg.DPSize = 1
	if cfg.oneGoroutineIndex(4, uint64(4*index.RankBound(cfg.Engine.NumGPUBlocks))-1) {
		t.Fatal("a budget the ranks could reach needs the sharded index")
	}
	cfg.Engine.NumCPUBlocks = 100
	if cfg.oneGoroutineIndex(4, 0) {
		t.Fatal("host-tier events need the sharded index")
	}
	cfg.IgnoreLowerTiers = true
	if !cfg.oneGoroutineIndex(4, 0) {
		t.Fatal("host-tier events dropped before the index: the one-goroutine index holds")
	}
}
