package sched

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
)

// BusyThreshold says when a worker is too loaded to receive new work. Nil
// disables a check. The JSON shape is that of the /busy_threshold API, where
// a missing or null field means "unset" on output and "leave as is" on input.
type BusyThreshold struct {
	// ActiveDecodeBlocks is a fraction of the worker's TotalKVBlocks, in
	// [MinActiveDecodeBlocks, 1]: below, one ordinary prompt makes a worker
	// busy, so every worker is busy as soon as it works at all; above 1 it
	// could never trigger on an engine that reports its capacity
	// truthfully; both are taken for mistakes.
	ActiveDecodeBlocks *float64 `json:"active_decode_blocks_threshold"`
	// ActivePrefillTokens is an absolute token count, ≥ 0. 0 is allowed:
	// it means "at most one prompt in prefill per worker".
	ActivePrefillTokens *int `json:"active_prefill_tokens_threshold"`
	// ActivePrefillTokensFrac is a multiple of the worker's
	// MaxNumBatchedTokens, ≥ 0 (Dynamo's
	// active_prefill_tokens_threshold_frac): busy above it; a worker whose
	// budget is unknown never is. Either prefill check suffices. Left out
	// of the JSON when unset, so answers without it read as before.
	ActivePrefillTokensFrac *float64 `json:"active_prefill_tokens_threshold_frac,omitempty"`
}

// MinActiveDecodeBlocks is the smallest decode threshold accepted.
const MinActiveDecodeBlocks = 0.01

// ErrInvalidThreshold wraps every validation failure of thresholds.
var ErrInvalidThreshold = errors.New("sched: invalid busy threshold")

// ErrTooManyModels refuses thresholds for one model more than the registry
// holds.
var ErrTooManyModels = errors.New("sched: too many models")

// Validate reports the first out-of-range field.
func (t BusyThreshold) Validate() error {
	if v := t.ActiveDecodeBlocks; v != nil && !(*v >= MinActiveDecodeBlocks && *v <= 1) {
		return fmt.Errorf("%w: active_decode_blocks_threshold %v: want a fraction in [%v, 1], or null to switch it off", ErrInvalidThreshold, *v, MinActiveDecodeBlocks)
	}
	if v := t.ActivePrefillTokens; v != nil && *v < 0 {
		return fmt.Errorf("%w: active_prefill_tokens_threshold %d: want a token count ≥ 0, or null to switch it off", ErrInvalidThreshold, *v)
	}
	if v := t.ActivePrefillTokensFrac; v != nil && !(*v >= 0 && *v <= maxPrefillFrac) {
		return fmt.Errorf("%w: active_prefill_tokens_threshold_frac %v: want a multiple of max_num_batched_tokens in [0, %v], or null to switch it off", ErrInvalidThreshold, *v, maxPrefillFrac)
	}
	return nil
}

// Busy reports whether c exceeds a threshold. The decode fraction is
// judged on the router's prediction when the worker's capacity is known,
// and on the KV usage the engine itself reports when it reports one: the
// prediction misses what the router did not route (other replicas without
// sync, direct traffic), the report lags, so either one suffices.
func (t BusyThreshold) Busy(c *Candidate) bool {
	if v := t.ActiveDecodeBlocks; v != nil {
		if c.TotalKVBlocks > 0 && c.ActiveDecodeBlocks > *v*float64(c.TotalKVBlocks) {
			return true
		}
		if c.Engine.Known && c.Engine.KVUsage > *v {
			return true
		}
	}
	if v := t.ActivePrefillTokensFrac; v != nil && c.MaxNumBatchedTokens > 0 && float64(c.ActivePrefillTokens) > *v*float64(c.MaxNumBatchedTokens) {
		return true
	}
	return t.ActivePrefillTokens != nil && c.ActivePrefillTokens > *t.ActivePrefillTokens
}

// maxPrefillFrac bounds the fraction: Dynamo's largest default is 64
// budgets; far beyond it the check could never trigger and is a mistake.
const maxPrefillFrac = 1e6

func (t BusyThreshold) enabled() bool {
	return t.ActiveDecodeBlocks != nil || t.ActivePrefillTokens != nil || t.ActivePrefillTokensFrac != nil
}

// clone gives the caller pointers of its own, so no one can change the
// registry's values by writing through a returned threshold.
func (t BusyThreshold) clone() BusyThreshold {
	if t.ActiveDecodeBlocks != nil {
		v := *t.ActiveDecodeBlocks
		t.ActiveDecodeBlocks = &v
	}
	if t.ActivePrefillTokens != nil {
		v := *t.ActivePrefillTokens
		t.ActivePrefillTokens = &v
	}
	if t.ActivePrefillTokensFrac != nil {
		v := *t.ActivePrefillTokensFrac
		t.ActivePrefillTokensFrac = &v
	}
	return t
}

// ModelThreshold is one row of the /busy_threshold API.
type ModelThreshold struct {
	Model string `json:"model"`
	BusyThreshold
}

// Thresholds holds the busy thresholds of every model, changeable at run
// time. Models never Set use the defaults given to NewThresholds (the
// --active-*-threshold flags). Safe for concurrent use.
type Thresholds struct {
	defaults  BusyThreshold // immutable after NewThresholds
	maxModels int

	mu      sync.RWMutex // guards byModel; held only for map access, never across calls out
	byModel map[string]BusyThreshold
}

// Bounds of the registry: model names come from clients of
// /busy_threshold.
const (
	DefaultMaxThresholdModels = 1024
	MaxModelNameBytes         = 256
)

// NewThresholds validates the defaults and returns an empty registry that
// holds at most maxModels models (≤ 0: DefaultMaxThresholdModels).
func NewThresholds(defaults BusyThreshold, maxModels int) (*Thresholds, error) {
	if err := defaults.Validate(); err != nil {
		return nil, err
	}
	if maxModels <= 0 {
		maxModels = DefaultMaxThresholdModels
	}
	return &Thresholds{defaults: defaults.clone(), maxModels: maxModels, byModel: map[string]BusyThreshold{}}, nil
}

// Get returns the thresholds in force for model: what was Set, or the
// defaults. This is the answer to a POST that names only the model.
func (t *Thresholds) Get(model string) BusyThreshold {
	t.mu.RLock()
	v, ok := t.byModel[model]
	t.mu.RUnlock()
	if !ok {
		v = t.defaults
	}
	return v.clone()
}

// Defaults are the thresholds of every model not Set.
func (t *Thresholds) Defaults() BusyThreshold { return t.defaults.clone() }

// ThresholdUpdate changes a model's thresholds: the non-nil fields of Set
// take their value, the Off ones are switched off, the others are kept.
type ThresholdUpdate struct {
	Set                            BusyThreshold
	DecodeOff, PrefillOff, FracOff bool
}

// Set changes the non-nil fields of update for model and returns the
// thresholds now in force. Nil fields keep their value, so Set with an empty
// update records the model at its current values (so that List shows it).
// An invalid update changes nothing.
func (t *Thresholds) Set(model string, update BusyThreshold) (BusyThreshold, error) {
	return t.Update(model, ThresholdUpdate{Set: update})
}

// Update applies u to model's thresholds and returns those now in force.
// An invalid update changes nothing.
func (t *Thresholds) Update(model string, u ThresholdUpdate) (BusyThreshold, error) {
	if strings.TrimSpace(model) == "" {
		return BusyThreshold{}, fmt.Errorf("%w: model name is empty", ErrInvalidThreshold)
	}
	if len(model) > MaxModelNameBytes {
		return BusyThreshold{}, fmt.Errorf("%w: model name is %d bytes long, at most %d are allowed", ErrInvalidThreshold, len(model), MaxModelNameBytes)
	}
	if err := u.Set.Validate(); err != nil {
		return BusyThreshold{}, err
	}
	if (u.DecodeOff && u.Set.ActiveDecodeBlocks != nil) || (u.PrefillOff && u.Set.ActivePrefillTokens != nil) || (u.FracOff && u.Set.ActivePrefillTokensFrac != nil) {
		return BusyThreshold{}, fmt.Errorf("%w: a threshold both set and switched off", ErrInvalidThreshold)
	}
	update := u.Set.clone()
	t.mu.Lock()
	cur, ok := t.byModel[model]
	if !ok {
		if len(t.byModel) >= t.maxModels {
			t.mu.Unlock()
			return BusyThreshold{}, fmt.Errorf("%w: thresholds are set for %d models, the most this router holds", ErrTooManyModels, len(t.byModel))
		}
		cur = t.defaults
	}
	if update.ActiveDecodeBlocks != nil || u.DecodeOff {
		cur.ActiveDecodeBlocks = update.ActiveDecodeBlocks
	}
	if update.ActivePrefillTokens != nil || u.PrefillOff {
		cur.ActivePrefillTokens = update.ActivePrefillTokens
	}
	if update.ActivePrefillTokensFrac != nil || u.FracOff {
		cur.ActivePrefillTokensFrac = update.ActivePrefillTokensFrac
	}
	t.byModel[model] = cur
	t.mu.Unlock()
	return cur.clone(), nil
}

// List returns every model that was Set, sorted by name, for the GET
// listing.
func (t *Thresholds) List() []ModelThreshold {
	t.mu.RLock()
	out := make([]ModelThreshold, 0, len(t.byModel))
	for m, v := range t.byModel {
		out = append(out, ModelThreshold{Model: m, BusyThreshold: v.clone()})
	}
	t.mu.RUnlock()
	slices.SortFunc(out, func(a, b ModelThreshold) int { return strings.Compare(a.Model, b.Model) })
	return out
}
