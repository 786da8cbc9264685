package router

import (
	"cmp"
	"slices"
	"time"

	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/sched"
)

// DecisionTap watches routing decisions, for a live view of them. Want is
// asked on every decision while the tap is set, so it must be cheap (a
// rate limit); only when it says yes is the record built, costs and all.
// Record runs on the routing path, possibly with the router's lock held:
// it must copy what it keeps and return at once, never calling the router.
type DecisionTap interface {
	Want() bool
	Record(DecisionRecord)
}

// DecisionRecord is one decision as a person reads it.
type DecisionRecord struct {
	Time          time.Time
	ID            string // "" for a query that booked nothing
	Model         string
	Worker        kv.Worker
	Via           sched.Via
	OverlapBlocks int
	PromptBlocks  int
	ISL           int
	Prefill       bool // the prefill half of a disaggregated request
	// Top are the cheapest candidates by the kv cost model, cheapest
	// first, at most TopCandidates, the chosen worker always among them
	// (last, when it was not among the cheapest); in other modes it is the
	// cost the kv mode would have seen, which still tells how loaded each
	// one was.
	Top []CandidateCost
}

// CandidateCost is one candidate of a decision with its cost's terms.
type CandidateCost struct {
	Worker        kv.Worker
	OverlapBlocks int
	Busy          bool
	sched.CostTerms
}

// TopCandidates is how many candidates a DecisionRecord keeps.
const TopCandidates = 3

type tapHolder struct{ t DecisionTap }

// SetDecisionTap starts (or, with nil, stops) handing decisions to t.
// Without a tap a decision pays one atomic load for it.
func (r *Router) SetDecisionTap(t DecisionTap) {
	if t == nil {
		r.tap.Store(nil)
		return
	}
	r.tap.Store(&tapHolder{t})
}

// tapDecision hands the decision just made to the tap, if one is set and
// wants it.
func (r *Router) tapDecision(p *prepared, sc *scratch, cands []sched.Candidate, d *Decision) {
	h := r.tap.Load()
	if h == nil || !h.t.Want() {
		return
	}
	isl := len(p.req.Tokens)
	lightest := sched.LightestOf(cands)
	top := make([]CandidateCost, 0, len(cands))
	for i := range cands {
		c := &cands[i]
		top = append(top, CandidateCost{Worker: c.Worker, OverlapBlocks: c.OverlapBlocks, Busy: sc.busy.Busy(c), CostTerms: p.params.Terms(c, isl, r.cfg.BlockSize, lightest)})
	}
	// Cheapest first; among equals the chosen worker first, and the chosen
	// worker always shown (it may not be among the cheapest: a tie broken
	// by chance, a session's pin, a peer mode's own choice), or the list
	// would not say where the request went against what.
	chosen := func(c CandidateCost) int {
		if c.Worker == d.Worker {
			return 0
		}
		return 1
	}
	slices.SortStableFunc(top, func(a, b CandidateCost) int {
		return cmp.Or(cmp.Compare(a.Total, b.Total), cmp.Compare(chosen(a), chosen(b)))
	})
	if i := slices.IndexFunc(top, func(c CandidateCost) bool { return c.Worker == d.Worker }); i >= TopCandidates {
		top[TopCandidates-1] = top[i]
	}
	h.t.Record(DecisionRecord{
		Time: r.now(), ID: p.req.ID, Model: p.req.Model, Worker: d.Worker, Via: d.Via,
		OverlapBlocks: d.OverlapBlocks, PromptBlocks: d.PromptBlocks, ISL: isl, Prefill: p.req.Prefill,
		Top: top[:min(len(top), TopCandidates)],
	})
}

// IndexedBlocks is how many blocks the router's index holds for rank w:
// the event-fed index's, or in approximate mode none (its blocks are the
// router's own guesses, counted in Stats).
func (r *Router) IndexedBlocks(w kv.Worker) int {
	if r.exact == nil {
		return 0
	}
	return r.exact.Blocks(w)
}

// Mode is the routing mode in force.
func (r *Router) Mode() sched.Mode { return r.cfg.Mode }

// WorkerEvents is how many KV events of engine id the router has accepted
// since it joined (0 for an unknown engine).
func (r *Router) WorkerEvents(id uint64) uint64 {
	if c := r.fleet.Load().events[id]; c != nil {
		return c.Load()
	}
	return 0
}
