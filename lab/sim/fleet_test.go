package sim

import (
	"math"
	"testing"

	"github.com/kvrouter/kvrouter/mocker/fleet"
)

func mustSpecs(t testing.TB, s string) []fleet.EngineSpec {
	t.Helper()
	sp, err := fleet.ParseSpecs(s)
	if err != nil {
		t.Fatal(err)
	}
	return sp
}

// The bounds of an unequal fleet count each engine by its speed: four
// engines at full speed and four at half bound the rate as six equal
// engines do; halving four engines' KV leaves the largest engine's block
// cost, so the bound of eight equal engines.
func TestUnequalFleetBounds(t *testing.T) {
	w := synthetic(t, 120)
	cfg := smallConfig()
	c := ceilingOf(w, cfg.Engine.BlockSize)
	bound := func(sim Config, workers int) float64 {
		speed, maxBlocks, _ := sim.fleetSize(workers)
		eng := sim.Engine
		eng.NumGPUBlocks = maxBlocks
		return unequalEngineBound(c, w, eng, speed)
	}
	slow := cfg
	slow.Specs = mustSpecs(t, "4x1,4x0.5")
	if got, want := bound(slow, 8), EngineBoundRPS(c, w, cfg.Engine, 6); math.Abs(got-want) > want*1e-12 {
		t.Errorf("4 full + 4 half speed: bound %g, want 6 engines' %g", got, want)
	}
	small := cfg
	small.Specs = mustSpecs(t, "4x1,4x1:0.5")
	speed, maxBlocks, total := small.fleetSize(8)
	if speed != 8 || maxBlocks != cfg.Engine.NumGPUBlocks || total != 6*cfg.Engine.NumGPUBlocks {
		t.Errorf("half-KV fleet: speed %v, max blocks %d, total %d", speed, maxBlocks, total)
	}
	if got, want := bound(small, 8), EngineBoundRPS(c, w, cfg.Engine, 8); math.Abs(got-want) > want*1e-12 {
		t.Errorf("half KV: bound %g, want %g", got, want)
	}
	if got, want := PrefillBoundRPS(c, w.Len(), 6, cfg.Engine.MaxNumBatchedTokens), 6.0/8*PrefillBoundRPS(c, w.Len(), 8, cfg.Engine.MaxNumBatchedTokens); math.Abs(got-want) > want*1e-6 {
		t.Errorf("prefill bound %g, want %g", got, want)
	}
}

// A half-speed fleet takes longer over the same requests, and its engines
// report their own KV size to the router.
func TestSimRunsUnequalEngines(t *testing.T) {
	w := synthetic(t, 200)
	cfg := smallConfig()
	full, err := Run(cfg, "round-robin", w, 4)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Specs = mustSpecs(t, "4x0.5:0.5")
	half, err := Run(cfg, "round-robin", w, 4)
	if err != nil {
		t.Fatal(err)
	}
	if !(half.TTFT.Mean > 1.5*full.TTFT.Mean) {
		t.Errorf("TTFT mean at half speed %.0f ms, at full %.0f ms", half.TTFT.Mean, full.TTFT.Mean)
	}
	s, err := newSim(cfg, "kv", w, 1)
	if err != nil {
		t.Fatal(err)
	}
	if got := s.engines[0].eng.Config(); got.NumGPUBlocks != cfg.Engine.NumGPUBlocks/2 || got.Speed != 0.5 {
		t.Errorf("engine config %+v", got)
	}
	cfg.Specs = cfg.Specs[:3]
	if _, err := Run(cfg, "kv", w, 1); err == nil {
		t.Error("3 specs for 4 engines accepted")
	}
}
