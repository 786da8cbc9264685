package workload

import (
	"cmp"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"time"

	"github.com/kvrouter/kvrouter/lab/trace"
)

// SyntheticConfig describes a shared-prefix workload; the comments name the
// flags of `kvrouter bench replay` that set them.
type SyntheticConfig struct {
	Requests       int           // --synthetic-requests: total requests (all turns of all sessions)
	Groups         int           // --groups: distinct system prompts; each session uses one, chosen uniformly
	SystemTokens   int           // --system-tokens: length of each group's system prompt
	QuestionTokens int           // --question-tokens: new user tokens per turn
	OutputTokens   int           // --output-tokens: tokens generated per turn (also appended to the next turn's prompt as the assistant's answer)
	Rate           float64       // --rate: mean new requests per second (Poisson arrivals of turns)
	Turns          int           // --turns: turns per session (1 = independent requests)
	ThinkTime      time.Duration // --think-time: mean gap between a session's turns (exponential)
	Tenants        int           // --tenants: each session belongs to one of this many tenants, chosen uniformly, whose requests carry its cache_salt; 0 = no salts
	Seed           uint64        // --seed
}

// DefaultSyntheticConfig is a chat-like workload whose shared system
// prompts dominate the prompt length, so that a KV-aware router has much to
// gain over one that ignores the cache.
func DefaultSyntheticConfig() SyntheticConfig {
	return SyntheticConfig{
		Requests:       1000,
		Groups:         8,
		SystemTokens:   2048,
		QuestionTokens: 256,
		OutputTokens:   128,
		Rate:           8,
		Turns:          4,
		ThinkTime:      10 * time.Second,
		Seed:           1,
	}
}

// maxPromptTokens bounds the longest prompt: far beyond any context window,
// it exists to turn a typo in a flag into an error instead of an attempt to
// allocate terabytes (or an int overflow).
const maxPromptTokens = 1 << 24

// maxSpan bounds the expected duration of the workload, below the ~292 years
// a time.Duration holds, so that arrival times never saturate.
const maxSpan = 100 * 365 * 24 * time.Hour

// Validate reports the first out-of-range field with a clear message.
func (c SyntheticConfig) Validate() error {
	positive := []struct {
		name, flag string
		v          int
	}{
		{"Requests", "--synthetic-requests", c.Requests},
		{"Groups", "--groups", c.Groups},
		{"SystemTokens", "--system-tokens", c.SystemTokens},
		{"QuestionTokens", "--question-tokens", c.QuestionTokens},
		{"OutputTokens", "--output-tokens", c.OutputTokens},
	}
	for _, f := range positive {
		if f.v <= 0 {
			return fmt.Errorf("synthetic workload: %s (%s) must be positive, got %d", f.name, f.flag, f.v)
		}
	}
	if !(c.Rate > 0) || math.IsInf(c.Rate, 0) {
		return fmt.Errorf("synthetic workload: Rate (--rate) must be a positive finite number of requests per second, got %g", c.Rate)
	}
	if c.Tenants < 0 {
		return fmt.Errorf("synthetic workload: Tenants (--tenants) must not be negative, got %d", c.Tenants)
	}
	if c.Turns <= 0 {
		return fmt.Errorf("synthetic workload: Turns (--turns) must be positive, got %d", c.Turns)
	}
	// A zero think time with one turn is harmless (it is never drawn), and
	// accepting it lets callers leave the field unset for independent requests.
	if c.ThinkTime < 0 {
		return fmt.Errorf("synthetic workload: ThinkTime (--think-time) must not be negative, got %v", c.ThinkTime)
	}
	if c.ThinkTime == 0 && c.Turns > 1 {
		return fmt.Errorf("synthetic workload: ThinkTime (--think-time) must be positive with more than one turn (Turns %d)", c.Turns)
	}
	// Float arithmetic: the integer sum could overflow for absurd inputs,
	// which is exactly what this check is for.
	turns := float64(min(c.Turns, c.Requests))
	if longest := float64(c.SystemTokens) + turns*float64(c.QuestionTokens) + (turns-1)*float64(c.OutputTokens); longest > maxPromptTokens {
		return fmt.Errorf("synthetic workload: the last turn's prompt would have %.0f tokens (SystemTokens + Turns*QuestionTokens + (Turns-1)*OutputTokens), more than %d",
			longest, maxPromptTokens)
	}
	if span := float64(c.Requests)/c.Rate*float64(time.Second) + (turns-1)*float64(c.ThinkTime); span > float64(maxSpan) {
		return fmt.Errorf("synthetic workload: %d requests at Rate (--rate) %g/s with ThinkTime (--think-time) %v would span more than 100 years",
			c.Requests, c.Rate, c.ThinkTime)
	}
	return nil
}

// Seeds of the two PCG streams: arrivals (session starts, groups, think
// times) and token content draw from separate streams so that changing a
// length flag leaves the arrival pattern unchanged, and runs that differ only
// in prompt size can be compared request for request.
const (
	arrivalStream = 0x617272697661 // "arriva"
	contentStream = 0x636f6e74656e // "conten"
	tenantStream  = 0x74656e616e74 // "tenant"
)

// distinctStride is coprime with trace.Vocab (2^10 * 5^3), so i ->
// (i*distinctStride + offset) mod Vocab is a permutation of the token ids.
const distinctStride = 104729

// Synthetic generates the workload, sorted by At (stable for equal At).
//
// Sessions start as a Poisson process at Rate/Turns per second, so that with
// every session's turns in flight the request rate is Rate; each turn after
// the first arrives an exponential ThinkTime after the previous one, without
// waiting for its answer (open loop). A turn's prompt is the previous turn's
// prompt, the previous answer (OutputTokens tokens) and a new question, the
// first turn's the group's system prompt and a question. Sessions are
// generated until Requests requests exist: the last one may be cut short.
//
// The turns of one session share the backing array of their Tokens (each
// capped to its length, so append copies): treat Tokens as read-only. This
// keeps the memory of a session to its longest prompt rather than the sum of
// all of them.
//
// The first token of every group's system prompt, and the first token of
// every session's first question, is distinct (up to trace.Vocab groups or
// sessions): prompts of different groups share no prefix at all, and
// sessions of one group share exactly the system prompt, whatever the seed.
func Synthetic(c SyntheticConfig) ([]Request, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	arrivals := rand.New(rand.NewPCG(c.Seed, arrivalStream))
	content := rand.New(rand.NewPCG(c.Seed, contentStream))
	tenants := rand.New(rand.NewPCG(c.Seed, tenantStream))

	systems, sessionOffset := systemPrompts(content, c.Groups, c.SystemTokens)

	sessionGap := float64(time.Second) * float64(c.Turns) / c.Rate // mean, ns
	think := float64(c.ThinkTime)
	out := make([]Request, 0, c.Requests)
	var start float64 // ns; float so that no gap is rounded into the sum
	for i := 0; len(out) < c.Requests; i++ {
		start += arrivals.ExpFloat64() * sessionGap
		system := systems[arrivals.IntN(c.Groups)]
		turns := min(c.Turns, c.Requests-len(out))
		name := ""
		if c.Turns > 1 {
			name = "s" + strconv.Itoa(i)
		}
		salt := ""
		if c.Tenants > 0 {
			salt = "tenant-" + strconv.Itoa(tenants.IntN(c.Tenants))
		}

		buf := make([]uint32, c.SystemTokens+turns*c.QuestionTokens+(turns-1)*c.OutputTokens)
		n := copy(buf, system)
		at := start
		for k := range turns {
			if k > 0 {
				n += fillTokens(content, buf[n:n+c.OutputTokens]) // the previous answer
				at += arrivals.ExpFloat64() * think
			}
			q := buf[n : n+c.QuestionTokens]
			if k == 0 {
				q[0] = distinctToken(uint64(i), sessionOffset)
				q = q[1:]
			}
			fillTokens(content, q)
			n += c.QuestionTokens
			out = append(out, Request{
				At:        duration(at),
				Tokens:    buf[:n:n],
				OSL:       c.OutputTokens,
				Session:   name,
				CacheSalt: salt,
			})
		}
	}
	slices.SortStableFunc(out, func(a, b Request) int { return cmp.Compare(a.At, b.At) })
	return out, nil
}

// systemPrompts draws n system prompts of the given length, each starting
// with a distinct token, and the offset that makes sessions' first tokens
// distinct too.
func systemPrompts(content *rand.Rand, n, tokens int) (systems [][]uint32, sessionOffset uint64) {
	groupOffset := content.Uint64N(trace.Vocab)
	sessionOffset = content.Uint64N(trace.Vocab)
	systems = make([][]uint32, n)
	for g := range systems {
		s := make([]uint32, tokens)
		s[0] = distinctToken(uint64(g), groupOffset)
		fillTokens(content, s[1:])
		systems[g] = s
	}
	return systems, sessionOffset
}

// distinctToken is the i-th token of a permutation of [0, Vocab).
func distinctToken(i, offset uint64) uint32 {
	return uint32((i%trace.Vocab*distinctStride + offset) % trace.Vocab)
}

// fillTokens fills dst with pseudo-random tokens in [0, Vocab), two per
// 64-bit draw (multiply-shift, as trace does, instead of a division per
// token), and returns len(dst).
func fillTokens(r *rand.Rand, dst []uint32) int {
	i := 0
	for ; i+1 < len(dst); i += 2 {
		z := r.Uint64()
		dst[i] = uint32((z & 0xffffffff) * trace.Vocab >> 32)
		dst[i+1] = uint32((z >> 32) * trace.Vocab >> 32)
	}
	if i < len(dst) {
		dst[i] = uint32((r.Uint64() & 0xffffffff) * trace.Vocab >> 32)
	}
	return len(dst)
}

// duration converts nanoseconds, saturating: Validate keeps the expected
// span far below the limit, but an exponential tail is unbounded.
func duration(ns float64) time.Duration {
	if ns >= math.MaxInt64 {
		return math.MaxInt64
	}
	return time.Duration(ns)
}
