package sim

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/lab/workload"
)

// mixedAnswers is a workload of unrelated prompts whose answers are either
// short or long, a quarter of them long.
func mixedAnswers(n int, gap time.Duration) Requests {
	rng := rand.New(rand.NewPCG(7, 7))
	reqs := make([]workload.Request, n)
	for i := range reqs {
		toks := make([]uint32, 1024+rng.IntN(1024))
		for j := range toks {
			toks[j] = rng.Uint32()
		}
		osl := 16
		if rng.IntN(4) == 0 {
			osl = 512
		}
		reqs[i] = workload.Request{At: time.Duration(i) * gap, Tokens: toks, OSL: osl}
	}
	return FromRequests(reqs)
}

// On a fleet whose caches differ, the learned cost sends long answers to
// the large caches when it is told the output lengths: the small caches
// fill less, and first tokens come sooner, than when the router routes
// without the hints.
func TestOSLHintsSteerLongAnswersToLargeCaches(t *testing.T) {
	w := mixedAnswers(600, 100*time.Millisecond)
	cfg := DefaultConfig()
	cfg.Engine.NumGPUBlocks = 2048
	cfg.Workers = 4
	cfg.Specs = mustSpecs(t, "2x1,2x1:0.5")
	cfg.Router.PrefillLoadModel = "learned"
	blind := cfg
	blind.NoOSLHints = true
	// Below the knee the hints only shorten the tail; at ×1.2 they are
	// what keeps p90 TTFT within 2 s (426 ms against 5,237 without).
	for _, sp := range []float64{1.1, 1.2} {
		with, err := Run(cfg, "kv", w, sp)
		if err != nil {
			t.Fatal(err)
		}
		without, err := Run(blind, "kv", w, sp)
		if err != nil {
			t.Fatal(err)
		}
		if with.TTFT.P90 >= without.TTFT.P90 || (sp == 1.2 && (with.TTFT.P90 > 2000 || without.TTFT.P90 <= 2000)) {
			t.Errorf("×%v: p90 TTFT %.0f ms with the hints, %.0f ms without", sp, with.TTFT.P90, without.TTFT.P90)
		}
	}
}
