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
	prefillTimeout time.Duration
}

// defaultDisaggMinUncachedTokens is --disagg-min-uncached-tokens' default.
const defaultDisaggMinUncachedTokens = 0

func (f *disaggFlags) register(fs *pflag.FlagSet) {
	fs.IntVar(&f.minUncached, "disagg-min-uncached-tokens", defaultDisaggMinUncachedTokens,
		"conditional disaggregation: prefill on the decode worker itself when it lacks fewer than this many of the prompt's tokens; 0 = always on a prefill worker")
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
	return frontend.Disagg{MinUncachedTokens: f.minUncached, PrefillTimeout: f.prefillTimeout, NoAssumeKVReuse: noAssumeReuse}, nil
}
