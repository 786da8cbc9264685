package engine

import (
	"math"
	"time"
)

// Model time of one scheduler step (SPEC §8), before any speedup ratio.

// PrefillTime is the model time of prefilling t new (uncached) tokens in one
// step: 4.209989e-7·t² + 1.518344e-2·t + 16.50142 ms, and 0 when t <= 0.
func PrefillTime(t int) time.Duration {
	if t <= 0 {
		return 0
	}
	x := float64(t)
	return millis(4.209989e-7*x*x + 1.518344e-2*x + 16.50142)
}

// DecodeTime is the model time of one decode step at KV usage fraction u
// (clamped to [0, 1]): −25.74·u² + 54.01·u + 5.74 ms, at least 1 ms.
func DecodeTime(u float64) time.Duration {
	// Compared by hand: math.Max and math.Min, which order ±0 and pass
	// NaN on, are calls that cost a simulated step more than the rest of
	// its timing. A NaN stays NaN and −0 gives the same time either way.
	if u < 0 {
		u = 0
	} else if u > 1 {
		u = 1
	}
	ms := -25.74*u*u + 54.01*u + 5.74
	if ms < 1 {
		ms = 1
	}
	return millis(ms)
}

// StepTime is the model time of a step that prefills prefillTokens new
// tokens and decodes one token for each of decodeSeqs sequences at KV usage
// u. This is the one place that decides how the parts of a mixed step
// combine.
//
// They add. vLLM runs a mixed step as one forward pass, but the two fits
// measure different work: the prefill fit is compute-bound work growing with
// the new tokens, the decode fit is the memory-bound read of the whole KV
// cache, growing with usage, and a mixed batch does both. Taking the max
// would make decodes free whenever a prefill runs, so a stream of arriving
// prompts would cost running requests no inter-token latency at all, which
// is the opposite of what vLLM shows; the sum over-counts one fixed overhead
// (about 6-16 ms) but keeps both effects, and it is what Dynamo's mocker, the
// source of these fits, does.
func StepTime(prefillTokens, decodeSeqs int, u float64) time.Duration {
	var d time.Duration
	if prefillTokens > 0 {
		d += PrefillTime(prefillTokens)
	}
	if decodeSeqs > 0 {
		d += DecodeTime(u)
	}
	return d
}

func millis(ms float64) time.Duration {
	return time.Duration(math.Round(ms * float64(time.Millisecond)))
}
