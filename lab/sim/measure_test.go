package sim

import (
	"testing"

	"github.com/kvrouter/kvrouter/lab/workload"
)

// BenchmarkMeasure is the bounds pass of a sweep (every prompt hashed,
// both ceilings, ownership and privacy) on agent sessions, whose prompts
// repeat their session's context, and on the synthetic workload.
func BenchmarkMeasure(b *testing.B) {
	agentic := workload.DefaultAgenticConfig()
	agentic.Requests = 3000
	ag, err := workload.Agentic(agentic)
	if err != nil {
		b.Fatal(err)
	}
	syn, err := workload.Synthetic(workload.DefaultSyntheticConfig())
	if err != nil {
		b.Fatal(err)
	}
	cfg := DefaultConfig()
	_, _, fleetBlocks := cfg.fleetSize(cfg.Workers)
	for _, tc := range []struct {
		name string
		w    Workload
	}{{"agentic", FromRequests(ag)}, {"synthetic", FromRequests(syn)}} {
		b.Run(tc.name, func(b *testing.B) {
			var blocks int64
			for range b.N {
				m := measure(tc.w, cfg.Engine.BlockSize, fleetBlocks, true)
				_, total := m.infinite.Tokens()
				blocks = int64(total / cfg.Engine.BlockSize)
			}
			b.ReportMetric(float64(blocks*int64(b.N))/b.Elapsed().Seconds(), "blocks/s")
		})
	}
}
