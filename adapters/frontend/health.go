package frontend

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
	"time"
)

type healthWorker struct {
	ID         uint64 `json:"id"`
	Name       string `json:"name"`
	Model      string `json:"model"`
	BaseURL    string `json:"base_url,omitempty"` // to the admin only
	DPSize     int    `json:"dp_size"`
	Registered bool   `json:"registered"` // known to the router
	KVEvents   string `json:"kv_events,omitempty"`
	// Ejected: out of routing for failing requests, why and until when.
	Ejected *ejectionHealth `json:"ejected,omitempty"`
	// State and Why name a configured engine that is not in routing.
	State string `json:"state,omitempty"`
	Why   string `json:"why,omitempty"`
	// OverBound lists the ranks whose events claimed more blocks than
	// their capacity allows (index.RankBound).
	OverBound []healthBound `json:"kv_index_over_bound,omitempty"`
	// Unsupported counts, by field, what its KV events carried that the
	// router does not honour (unsupported.go).
	Unsupported map[string]uint64 `json:"kv_events_unsupported,omitempty"`
	// LearnedPrefill is each rank's learned prefill rate
	// (--router-prefill-load-model learned).
	LearnedPrefill []healthPrefill `json:"learned_prefill,omitempty"`
}

type healthPrefill struct {
	DPRank uint32 `json:"dp_rank"`
	// TokensPerSecond is 0 while too few first tokens have come to fit it.
	TokensPerSecond float64 `json:"tokens_per_second"`
	FixedMS         float64 `json:"fixed_ms"`
	Samples         int     `json:"samples"`
	Pending         int     `json:"pending"`
}

// learnedPrefill groups the router's prefill fits by engine.
func (f *Frontend) learnedPrefill() map[uint64][]healthPrefill {
	out := map[uint64][]healthPrefill{}
	for _, fit := range f.cfg.Router.PrefillFits() {
		out[fit.Worker.ID] = append(out[fit.Worker.ID], healthPrefill{
			DPRank: fit.Worker.DPRank, TokensPerSecond: fit.TokensPerSecond, FixedMS: fit.FixedSeconds * 1000, Samples: fit.Samples, Pending: fit.Pending,
		})
	}
	return out
}

type healthBound struct {
	DPRank  uint32 `json:"dp_rank"`
	Bound   int    `json:"bound"`
	Blocks  int    `json:"blocks"`
	Refused uint64 `json:"refused"`
}

// live answers while the process serves HTTP at all: a liveness probe
// must not restart a router that waits for its engines or for NATS.
func (f *Frontend) live(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, map[string]string{"status": "live"})
}

// ready is 200 while the router can route every model it serves, so a
// readiness probe takes the replica out of a load balancer only when
// traffic sent to it would fail.
func (f *Frontend) ready(w http.ResponseWriter, _ *http.Request) {
	if reasons := f.notReady(f.cfg.Workers(), f.registered()); len(reasons) > 0 {
		writeJSON(w, http.StatusServiceUnavailable, map[string]any{"status": "not_ready", "reasons": reasons})
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ready"})
}

func (f *Frontend) registered() map[uint64]bool {
	known := map[uint64]bool{}
	for _, in := range f.cfg.Router.Workers() {
		known[in.ID] = true
	}
	return known
}

// notReady lists why the router cannot route: draining, no engine in
// routing, or a model every engine of which is out of routing.
func (f *Frontend) notReady(ws []Worker, known map[uint64]bool) []string {
	var reasons []string
	if f.draining.Load() {
		reasons = append(reasons, "draining: shutting down")
	}
	var routable []Worker
	for _, wk := range ws {
		if known[wk.ID] {
			routable = append(routable, wk)
		}
	}
	if len(routable) == 0 {
		return append(reasons, "no engine in routing")
	}
	if !f.warmedUp(len(routable)) {
		reasons = append(reasons, fmt.Sprintf("%d of the %d engines --router-min-initial-workers waits for are in routing", len(routable), f.cfg.MinInitialWorkers))
	}
	var models []string
	if f.cfg.Models != nil {
		models = f.cfg.Models()
	} else {
		for _, wk := range ws {
			models = append(models, wk.Model)
		}
	}
	slices.Sort(models)
	for _, m := range slices.Compact(models) {
		if m == "" {
			continue
		}
		if !slices.ContainsFunc(routable, func(wk Worker) bool { return wk.Model == "" || wk.Model == m }) {
			reasons = append(reasons, fmt.Sprintf("model %q: no engine in routing", m))
		}
	}
	return reasons
}

// health is the detailed view: "unavailable" (503) when the router is not
// ready, "degraded" (200: requests are served) when an engine is not
// known to the router or a dependency is not "ok", else "ok" (200). The
// reasons say why; notes say what is worth knowing without degrading,
// e.g. KV event fields the router does not honour (unsupported.go).
//
// The engines' URLs are for the admin (seesEngineURLs): they are where to
// reach an engine around the router's keys and limits.
func (f *Frontend) health(w http.ResponseWriter, r *http.Request) {
	known := f.registered()
	ws := f.cfg.Workers()
	engines := f.engineStatuses()
	statuses := make(map[uint64]EngineStatus, len(engines))
	for _, e := range engines {
		statuses[e.ID] = e
	}
	var notes []string
	out := make([]healthWorker, len(ws))
	urls := f.seesEngineURLs(r)
	var degraded []string
	ejected := f.ejectionsHealth()
	over := map[uint64][]healthBound{}
	for _, ob := range f.cfg.Router.OverBound() {
		over[ob.Worker.ID] = append(over[ob.Worker.ID], healthBound{DPRank: ob.Worker.DPRank, Bound: ob.Bound, Blocks: ob.Blocks, Refused: ob.Refused})
	}
	prefill := f.learnedPrefill()
	for i, wk := range ws {
		out[i] = healthWorker{ID: wk.ID, Name: wk.Name, Model: wk.Model, DPSize: max(wk.DPSize, 1), Registered: known[wk.ID], LearnedPrefill: prefill[wk.ID]}
		if urls {
			out[i].BaseURL = wk.BaseURL
		}
		if !known[wk.ID] {
			degraded = append(degraded, fmt.Sprintf("engine %s (%d) is not registered with the router", wk.Name, wk.ID))
		}
		if e := ejected[wk.ID]; e != nil {
			out[i].Ejected = e
			degraded = append(degraded, fmt.Sprintf("engine %s (%d) is ejected from routing until %s: %s (ejection %d)", wk.Name, wk.ID, e.Until.UTC().Format(time.RFC3339), e.Reason, e.Ejections))
		}
		var eventless bool
		if out[i].KVEvents, eventless = f.kvEventsHealth(wk); eventless {
			degraded = append(degraded, fmt.Sprintf("engine %s (%d): kv events %s", wk.Name, wk.ID, out[i].KVEvents))
		}
		if e, ok := statuses[wk.ID]; ok && len(e.Unsupported) > 0 {
			out[i].Unsupported = e.Unsupported
			notes = append(notes, unsupportedNote(e))
		}
		if ob := over[wk.ID]; len(ob) > 0 {
			slices.SortFunc(ob, func(a, b healthBound) int { return int(a.DPRank) - int(b.DPRank) })
			out[i].OverBound = ob
			degraded = append(degraded, fmt.Sprintf("engine %s (%d): its KV events claimed more blocks than its capacity; %d refused on rank %d (bound %d)", wk.Name, wk.ID, ob[0].Refused, ob[0].DPRank, ob[0].Bound))
		}
	}
	for _, e := range unroutable(ws, engines) {
		hw := healthWorker{ID: e.ID, Name: e.Name, Model: e.Model, DPSize: max(e.DPSize, 1), State: e.State, Why: e.Why, Unsupported: e.Unsupported}
		if len(e.Unsupported) > 0 {
			notes = append(notes, unsupportedNote(e))
		}
		if urls {
			hw.BaseURL = e.URL
		} else if e.URL != "" {
			e.Why = strings.ReplaceAll(e.Why, e.URL, "(its URL: shown to the admin)")
			hw.Why = e.Why
		}
		out = append(out, hw)
		degraded = append(degraded, fmt.Sprintf("engine %s (%d) is not in routing: %s", e.Name, e.ID, e.Why))
	}
	tokenizers, mismatched := f.tokCheck.health()
	degraded = append(degraded, mismatched...)
	body := map[string]any{"workers": out, "kv_block_size": f.blockSizeHealth(), "tokenizer": tokenizers}
	if f.cfg.Dependencies != nil {
		deps := f.cfg.Dependencies()
		keys := make([]string, 0, len(deps))
		for k := range deps {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		for _, k := range keys {
			if deps[k] != "ok" {
				degraded = append(degraded, k+": "+deps[k])
			}
		}
		if deps != nil {
			body["dependencies"] = deps
		}
	}
	status, code := "ok", http.StatusOK
	reasons := f.notReady(ws, known)
	switch {
	case len(reasons) > 0:
		status, code = "unavailable", http.StatusServiceUnavailable
	case len(degraded) > 0:
		status = "degraded"
	}
	body["status"] = status
	if reasons = append(reasons, degraded...); len(reasons) > 0 {
		body["reasons"] = reasons
	}
	if len(notes) > 0 {
		body["notes"] = notes
	}
	writeJSON(w, code, body)
}

// unroutable lists the configured engines missing from ws, the engines in
// routing: an engine that never answered or died must show, not vanish.
func unroutable(ws []Worker, engines []EngineStatus) []EngineStatus {
	var out []EngineStatus
	for _, e := range engines {
		if !slices.ContainsFunc(ws, func(wk Worker) bool { return wk.ID == e.ID }) {
			out = append(out, e)
		}
	}
	return out
}

// warmedUp reports whether the fleet has reached MinInitialWorkers engines
// in routing (routable now) since the start: once it has, engines that
// leave later do not make the router wait again.
func (f *Frontend) warmedUp(routable int) bool {
	if f.initialReached.Load() || f.cfg.MinInitialWorkers <= 0 {
		return true
	}
	if routable >= f.cfg.MinInitialWorkers {
		f.initialReached.Store(true)
		return true
	}
	return false
}

// waitingForWorkers answers a request that came before MinInitialWorkers
// engines were in routing, or reports false when the router is past that.
func (f *Frontend) waitingForWorkers(w http.ResponseWriter) bool {
	if f.cfg.MinInitialWorkers <= 0 || f.initialReached.Load() {
		return false
	}
	known := f.registered()
	n := 0
	for _, wk := range f.cfg.Workers() {
		if known[wk.ID] {
			n++
		}
	}
	if f.warmedUp(n) {
		return false
	}
	w.Header().Set("Retry-After", "1")
	writeError(w, http.StatusServiceUnavailable, "server_error", "waiting_for_workers", "",
		"the router waits for %d engines before routing (--router-min-initial-workers); %d are in routing", f.cfg.MinInitialWorkers, n)
	return true
}
