package main

import (
	"fmt"
	"math"
	"strconv"
	"strings"
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
	policy         string
	prefillBusy    string
	decodeBusy     string
	// poolPolicy is Dynamo's per-pool worker selection
	// (--router-prefill-policy, --router-decode-policy), by pool.
	poolPolicy   [2]string
	policyConfig string
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
	fs.StringVar(&f.policy, "router-conditional-disagg-policy", frontend.PolicyISLBounding,
		"when the decode worker prefills itself: isl_bounding (it lacks little of the prompt), prefill_load (the prefill worker the router would pick is busy), isl_or_load (either)")
	fs.StringVar(&f.prefillBusy, "router-conditional-disagg-prefill-busy-threshold", "",
		"prefill_load, isl_or_load: a prefill worker whose prompt backlog exceeds this × its max batched tokens is busy (unset: --router-queue-threshold)")
	fs.StringVar(&f.decodeBusy, "router-conditional-disagg-decode-busy-threshold", "",
		"the decode worker prefills itself only while its KV blocks with the request stay within this fraction of its capacity (unset or none: no such check)")
	fs.StringVar(&f.poolPolicy[0], "router-prefill-policy", "", "Dynamo's worker selection for the prefill pool: default (or --router-mode's name) is --router-mode, which routes both pools")
	fs.StringVar(&f.poolPolicy[1], "router-decode-policy", "", "Dynamo's worker selection for the decode pool: default (or --router-mode's name) is --router-mode, which routes both pools")
	fs.StringVar(&f.policyConfig, "router-policy-config", "", "Dynamo's YAML of policy classes; refused: kvrouter's policies are flags (--router-mode, --router-queue-policy, --router-conditional-disagg-policy)")
}

// checkPoolPolicies takes Dynamo's per-pool selection where it names
// what kvrouter does, the built-in selector (default) or --router-mode
// itself, and refuses a provider kvrouter does not have.
func (f *disaggFlags) checkPoolPolicies(mode string) error {
	if f.policyConfig != "" {
		return fmt.Errorf("--router-policy-config %s: kvrouter has no YAML policy classes; its policies are flags: --router-mode (both pools), --router-queue-policy, --router-conditional-disagg-policy, --active-*-threshold", f.policyConfig)
	}
	for i, flag := range []string{"--router-prefill-policy", "--router-decode-policy"} {
		p := strings.TrimSpace(f.poolPolicy[i])
		if p == "" || p == "default" || p == mode || strings.ReplaceAll(p, "_", "-") == mode {
			continue
		}
		return fmt.Errorf("%s %q: kvrouter routes the prefill and decode pools alike with --router-mode (%s now); give default or %s, or choose the mode for both with --router-mode", flag, p, mode, mode)
	}
	return nil
}

// config is the frontend's disaggregation settings; noAssumeReuse is
// --no-router-assume-kv-reuse, which also routes decode as Dynamo does,
// queueThreshold the router's, which the prefill load policies fall back on
// as Dynamo's do, and mode --router-mode, which routes both pools.
func (f *disaggFlags) config(noAssumeReuse bool, queueThreshold *float64, mode string) (frontend.Disagg, error) {
	if err := f.checkPoolPolicies(mode); err != nil {
		return frontend.Disagg{}, err
	}
	if f.minUncached < 0 {
		return frontend.Disagg{}, fmt.Errorf("--disagg-min-uncached-tokens must be at least 0, got %d", f.minUncached)
	}
	if f.prefillTimeout <= 0 {
		return frontend.Disagg{}, fmt.Errorf("--disagg-prefill-timeout must be positive, got %v", f.prefillTimeout)
	}
	if !(f.maxRatio >= 0 && f.maxRatio <= 1) {
		return frontend.Disagg{}, fmt.Errorf("--router-conditional-disagg-eff-isl-ratio-threshold must be in [0, 1], got %v", f.maxRatio)
	}
	d := frontend.Disagg{MinUncachedTokens: f.minUncached, MaxUncachedRatio: f.maxRatio, Enforce: f.enforce, PrefillTimeout: f.prefillTimeout, NoAssumeKVReuse: noAssumeReuse, Policy: f.policy}
	switch f.policy {
	case frontend.PolicyISLBounding:
	case frontend.PolicyPrefillLoad, frontend.PolicyISLOrLoad:
		v, err := optionalThreshold("--router-conditional-disagg-prefill-busy-threshold", f.prefillBusy)
		if err != nil {
			return d, err
		}
		if v == nil {
			v = queueThreshold
		}
		if v == nil {
			return d, fmt.Errorf("--router-conditional-disagg-policy %s needs a busy threshold: --router-conditional-disagg-prefill-busy-threshold, or --router-queue-threshold not none", f.policy)
		}
		d.PrefillBusyThreshold = *v
	default:
		return d, fmt.Errorf("--router-conditional-disagg-policy %q: want isl_bounding, prefill_load or isl_or_load", f.policy)
	}
	v, err := optionalThreshold("--router-conditional-disagg-decode-busy-threshold", f.decodeBusy)
	if err != nil {
		return d, err
	}
	d.DecodeBusyThreshold = v
	return d, nil
}

// optionalThreshold reads a fraction ≥ 0; "" or Dynamo's None is unset.
func optionalThreshold(flag, s string) (*float64, error) {
	t := strings.TrimSpace(s)
	if t == "" || strings.EqualFold(t, "none") || strings.EqualFold(t, "null") {
		return nil, nil
	}
	v, err := strconv.ParseFloat(t, 64)
	if err != nil || !(v >= 0) || math.IsInf(v, 0) {
		return nil, fmt.Errorf("%s %q: want a fraction ≥ 0, or none", flag, s)
	}
	return &v, nil
}
