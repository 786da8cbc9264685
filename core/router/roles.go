package router

import (
	"context"
	"fmt"
	"strings"

	"github.com/kvrouter/kvrouter/core/sched"
)

// Role is a worker's part in disaggregated serving.
type Role uint8

const (
	// RoleBoth prefills and decodes its own requests: aggregated serving,
	// the default.
	RoleBoth Role = iota
	// RolePrefill only prefills: it answers with where the KV lives, and a
	// decode worker pulls it.
	RolePrefill
	// RoleDecode decodes requests whose KV a prefill worker computed, and
	// prefills itself when there is none (fallback, short remainders).
	RoleDecode
)

func (r Role) String() string {
	switch r {
	case RolePrefill:
		return "prefill"
	case RoleDecode:
		return "decode"
	}
	return "both"
}

// ParseRole reads a role as flags, configs and discovery entries name it;
// "" is RoleBoth.
func ParseRole(s string) (Role, error) {
	switch s {
	case "", "both", "aggregated":
		return RoleBoth, nil
	case "prefill":
		return RolePrefill, nil
	case "decode":
		return RoleDecode, nil
	}
	return RoleBoth, fmt.Errorf("unknown worker role %q: want prefill, decode or both", s)
}

// Pools counts the workers that can take model's requests, by the half of
// the work they do: prefill workers, and decode-capable ones (RoleDecode
// and RoleBoth). A model with both is served disaggregated; when its last
// prefill worker leaves, it is served aggregated again.
func (r *Router) Pools(model string) (prefill, decode int) {
	for _, in := range r.fleet.Load().infos {
		if model != "" && in.Model != "" && in.Model != model {
			continue
		}
		if in.Role == RolePrefill {
			prefill++
		} else {
			decode++
		}
	}
	return prefill, decode
}

var noBlocks = false

// trackBlocks is the booking's active-block override: a prefill request's
// blocks leave its engine with the transfer, so they never count as decode
// load there.
func (p *prepared) trackBlocks() *bool {
	if p.req.Prefill {
		return &noBlocks
	}
	return nil
}

// RemoteDecodeOverrides are the routing knobs of a decode whose prompt a
// prefill worker computed, over the request's own o: it adds no prefill
// load; with noReuse (Dynamo's decode routing, --no-router-assume-kv-reuse)
// the blocks the decode worker holds count for nothing either.
func RemoteDecodeOverrides(o sched.Overrides, noReuse bool) sched.Overrides {
	off := false
	o.TrackPrefillTokens = &off
	if noReuse {
		zero := 0.0
		o.AssumeKVReuse, o.OverlapCredit, o.HostHitWeight, o.DiskHitWeight, o.SharedCache = &off, &zero, &zero, &zero, &off
	}
	return o
}

// ShortUncached is conditional disaggregation: whether the decode worker
// req would go to lacks fewer than minUncached of its prompt's tokens, so
// that computing them there costs less than a prefill elsewhere and a
// transfer. It only asks: nothing is booked.
func (r *Router) ShortUncached(ctx context.Context, req Request, minUncached int) bool {
	if minUncached <= 0 {
		return false
	}
	req.Prefill = false
	pv, err := r.Preview(ctx, req, false)
	return err == nil && pv.Uncached < minUncached
}

// ParseDevice reads the device an engine computes on, as flags, configs
// and discovery entries name it: cpu, or an accelerator's name (cuda,
// rocm, xpu, ...); "" is an accelerator, as Dynamo takes an engine that
// does not say. Only CPU against the rest matters to routing.
func ParseDevice(s string) (cpu bool, err error) {
	d := strings.ToLower(strings.TrimSpace(s))
	for _, c := range d {
		if (c < 'a' || c > 'z') && (c < '0' || c > '9') && c != '-' && c != '_' {
			return false, fmt.Errorf("device %q: want cpu or an accelerator's name such as cuda", s)
		}
	}
	return d == "cpu", nil
}

// Preview is where a request would go and that rank's load with it there;
// nothing is booked. Conditional disaggregation's load policies read it.
type Preview struct {
	Decision
	// Uncached is how many of the prompt's tokens the rank lacks.
	Uncached int
	// Load is the rank's load now, and Potential* with the request on it.
	Load WorkerLoad
	// TotalKVBlocks and MaxNumBatchedTokens are the engine's; 0 unknown.
	TotalKVBlocks, MaxNumBatchedTokens int
}

// Preview routes req without booking it (its ID is ignored); the rank's
// load and capacity only withLoad, which costs a second match.
func (r *Router) Preview(ctx context.Context, req Request, withLoad bool) (Preview, error) {
	req.ID = ""
	d, err := r.BestWorker(ctx, &req)
	if err != nil {
		return Preview{}, err
	}
	pv := Preview{Decision: d, Uncached: max(0, len(req.Tokens)-d.OverlapBlocks*r.cfg.BlockSize)}
	if !withLoad {
		return pv, nil
	}
	for _, l := range r.potentialLoads(&req) {
		if l.Worker == d.Worker {
			pv.Load = l
			break
		}
	}
	if info, ok := r.fleet.Load().infos[d.Worker.ID]; ok {
		pv.TotalKVBlocks, pv.MaxNumBatchedTokens = info.TotalKVBlocks, info.MaxNumBatchedTokens
	}
	return pv, nil
}

// PrefillBusy is whether the rank's prompt backlog exceeds threshold × its
// per-step token budget; an unknown budget never counts as busy, as in busy
// detection and the queue.
func (p Preview) PrefillBusy(threshold float64) bool {
	return p.MaxNumBatchedTokens > 0 && float64(p.Load.ActivePrefillTokens) > threshold*float64(p.MaxNumBatchedTokens)
}

// DecodeBusy is whether the rank's KV blocks with the request on it exceed
// threshold × its capacity; known is false when the capacity is unknown.
func (p Preview) DecodeBusy(threshold float64) (busy, known bool) {
	if p.TotalKVBlocks <= 0 {
		return false, false
	}
	return p.Load.PotentialDecodeBlocks > threshold*float64(p.TotalKVBlocks), true
}
