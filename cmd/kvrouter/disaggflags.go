package main

import (
	"fmt"
	"time"

	"github.com/spf13/pflag"

	"github.com/kvrouter/kvrouter/adapters/frontend"
)

// disaggFlags bind disaggregated serving's knobs. They only act on models
// that have prefill workers; the rest are served aggregated.
type disaggFlags struct {
	minUncached    int
	maxRatio       float64
	enforce        bool
	prefillTimeout time.Duration
}

// defaultDisaggMinUncachedTokens is --disagg-min-uncached-tokens' default:
// a remainder under one Mooncake block costs less to prefill where it will
// be decoded than to compute elsewhere and pull. Chosen by goodput (`kvrouter
// sim`, conversation trace, 8 engines, p90 TTFT ≤ 2 s; docs/disaggregated.md):
// with 4 prefill + 4 decode engines 0, 512, 2048, 8192 and 16384 carried
// 19.1, 19.6, 20.8, 25.1 and 28.9 req/s, with 6 + 2 they carried 24.7,
// 24.7, 23.8, 17.9 and 12.8: the best large value depends on how much
// spare prefill capacity the decode pool has, and a wrong one halves
// goodput, while 512 is never worse than 0.
const defaultDisaggMinUncachedTokens = 512

func (f *disaggFlags) register(fs *pflag.FlagSet) {
	fs.IntVar(&f.minUncached, "disagg-min-uncached-tokens", defaultDisaggMinUncachedTokens,
		"conditional disaggregation: prefill on the decode worker itself when it lacks fewer than this many of the prompt's tokens; 0 = always on a prefill worker")
	fs.Float64Var(&f.maxRatio, "router-conditional-disagg-eff-isl-ratio-threshold", 0,
		"conditional disaggregation: also require the uncached share of the prompt below this, in (0, 1], for a local prefill; 0 = no ratio (Dynamo's 1.0)")
	fs.BoolVar(&f.enforce, "enforce-disagg", false,
		"answer 503 when no prefill worker can take a request of a disaggregated model (none, all busy, failed or timed out) instead of prefilling on the decode worker")
	fs.DurationVar(&f.prefillTimeout, "disagg-prefill-timeout", frontend.DefaultPrefillTimeout,
		"a prefill worker that has not answered within this long is given up and the decode worker prefills")
}

// config is the frontend's disaggregation settings; noAssumeReuse is
// --no-router-assume-kv-reuse, which also routes decode as Dynamo does.
func (f *disaggFlags) config(noAssumeReuse bool) (frontend.Disagg, error) {
	if f.minUncached < 0 {
		return frontend.Disagg{}, fmt.Errorf("--disagg-min-uncached-tokens must be at least 0, got %d", f.minUncached)
	}
	if f.prefillTimeout <= 0 {
		return frontend.Disagg{}, fmt.Errorf("--disagg-prefill-timeout must be positive, got %v", f.prefillTimeout)
	}
	if !(f.maxRatio >= 0 && f.maxRatio <= 1) {
		return frontend.Disagg{}, fmt.Errorf("--router-conditional-disagg-eff-isl-ratio-threshold must be in [0, 1], got %v", f.maxRatio)
	}
	return frontend.Disagg{MinUncachedTokens: f.minUncached, MaxUncachedRatio: f.maxRatio, Enforce: f.enforce, PrefillTimeout: f.prefillTimeout, NoAssumeKVReuse: noAssumeReuse}, nil
}
