package fleet

import (
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/mocker/engine"
)

func TestParseSpecs(t *testing.T) {
	got, err := ParseSpecs("2x1, 1x0.5:0.25,1x2,2x0.125:cpu,1x0.25:0.5:cpu")
	want := []EngineSpec{{1, 1, false}, {1, 1, false}, {0.5, 0.25, false}, {2, 1, false}, {0.125, 1, true}, {0.125, 1, true}, {0.25, 0.5, true}}
	if err != nil || !slices.Equal(got, want) {
		t.Fatalf("%v %v, want %v", got, err, want)
	}
	if s := SpecsString(got); s != "2x1,1x0.5:0.25,1x2,2x0.125:cpu,1x0.25:0.5:cpu" {
		t.Errorf("SpecsString %q", s)
	}
	for _, bad := range []string{"", "4", "0x1", "4x0", "4x-1", "4x1:0", "4xfast", "4x1:NaN", "4x+Inf", "200000x1", "4x1:gpu", "4x1:0.5:gpu", "4x1:cpu:0.5", "4x:cpu"} {
		if _, err := ParseSpecs(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
	cfg := EngineSpec{Speed: 0.5, KV: 0.5}.Apply(engine.Config{NumGPUBlocks: 101})
	if cfg.Speed != 0.5 || cfg.NumGPUBlocks != 51 {
		t.Errorf("applied %+v", cfg)
	}
}

// An engine at half speed takes twice the model time for the same step.
func TestHalfSpeedEngineStepsTwiceAsLong(t *testing.T) {
	step := func(speed float64) int64 {
		cfg := engine.DefaultConfig()
		cfg.Speed = speed
		e, err := engine.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		if err := e.Add(engine.Request{ID: "r", Tokens: make([]uint32, 1000), MaxTokens: 2}); err != nil {
			t.Fatal(err)
		}
		return int64(e.Step().Duration)
	}
	full, half := step(1), step(0.5)
	if full <= 0 || half != 2*full {
		t.Fatalf("full %d ns, half %d ns", full, half)
	}
	if _, err := engine.New(engine.Config{BlockSize: 16, NumGPUBlocks: 1, MaxNumSeqs: 1, MaxNumBatchedTokens: 1, Speed: -1}); err == nil {
		t.Fatal("negative speed accepted")
	}
}

func TestEngineConfigBySpec(t *testing.T) {
	cfg := DefaultConfig()
	cfg.NumWorkers, cfg.Engine.NumGPUBlocks = 3, 1000
	cfg.Specs = []EngineSpec{{Speed: 1, KV: 1}, {Speed: 0.5, KV: 0.5}}
	if e := cfg.EngineConfig(1); e.NumGPUBlocks != 500 || e.Speed != 0.5 {
		t.Errorf("engine 1: %+v", e)
	}
	if e := cfg.EngineConfig(2); e.NumGPUBlocks != 1000 || e.Speed != 0 {
		t.Errorf("engine past the specs: %+v", e)
	}
}
