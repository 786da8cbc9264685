package frontend

import (
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/adapters/jsonerr"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/core/sched"
)

// uiPage is the whole dashboard: one file, no external resource, so that
// it works where the operator's browser has no network beyond the router.
//
//go:embed ui/index.html
var uiPage []byte

// EngineStatus is what the registry knows of one configured engine beyond
// the router's view of it, for the dashboard.
type EngineStatus struct {
	ID     uint64
	Name   string
	URL    string
	Events string // rank 0's KV-event endpoint, "" when unknown
	Model  string
	DPSize int
	Role   string
	// State is "up" (in routing), "down" (not answering its health probe)
	// or "drained" (taken out by an operator).
	State string
	// Why the engine is not in routing, when it is not, e.g. "engine
	// url=http://127.0.0.1:8109 unreachable: connection refused".
	Why string
	// Warnings say what is wrong with the engine's event stream, e.g.
	// replay gaps that could not be closed.
	Warnings []string
	// Unsupported counts, by field, the events (or blocks) of all its
	// ranks whose field the router could not honour; nil when none.
	Unsupported map[string]uint64
}

// ErrUnknownEngine is Config.SetDrained's answer for an id no engine has.
var ErrUnknownEngine = errors.New("no such engine")

// Defaults of the dashboard's feed.
const (
	// DefaultUIDecisionsPerSecond bounds the decisions recorded for the
	// dashboard: a fleet at thousands of requests per second must not
	// drown the browser, nor pay for explaining each decision.
	DefaultUIDecisionsPerSecond = 20
	// uiWatchWindow is how long after the last poll the router still
	// records decisions: a page polls every second, so one missed poll
	// does not stop the feed, and a closed page stops it soon.
	uiWatchWindow = 5 * time.Second
	uiDecisions   = 200             // decisions kept
	uiPoints      = 600             // series points kept: 10 minutes at one a second
	uiSampleEvery = 1 * time.Second // at most one series point per interval
)

// ui feeds the dashboard. The router pays for it only while a page has
// polled within uiWatchWindow: the decision tap is set then and removed
// after, and TTFT is accumulated only while active is set.
type ui struct {
	f         *Frontend
	perSecond int64

	watchMu  sync.Mutex
	active   atomic.Bool
	lastPoll time.Time
	timer    *time.Timer

	// The rate limit of Want: the second it counts in, and how many
	// decisions were wanted in it.
	sec atomic.Int64
	n   atomic.Int64

	// decMu guards the decision ring only: Record takes it with the
	// router's lock held, so nothing holding it may call the router.
	decMu sync.Mutex
	ring  []uiDecision
	seq   uint64

	ttftNanos, ttftCount atomic.Int64

	sampleMu   sync.Mutex
	points     []uiPoint
	last       uiCounters
	lastAt     time.Time
	eventRates map[uint64]float64
	lastEvents map[uint64]uint64
}

type uiCounters struct {
	decisions, overlap, prompt uint64
	ttftNanos, ttftCount       int64
}

func newUI(f *Frontend, perSecond int) *ui {
	if perSecond <= 0 {
		perSecond = DefaultUIDecisionsPerSecond
	}
	return &ui{f: f, perSecond: int64(perSecond), eventRates: map[uint64]float64{}, lastEvents: map[uint64]uint64{}}
}

// watched reports whether a page is open; the hot path's only cost of the
// dashboard when none is.
func (u *ui) watched() bool { return u.active.Load() }

// touch marks a poll: the feed starts, or goes on for another window.
func (u *ui) touch(now time.Time) {
	u.watchMu.Lock()
	defer u.watchMu.Unlock()
	u.lastPoll = now
	if !u.active.Load() {
		u.active.Store(true)
		u.f.cfg.Router.SetDecisionTap(u)
	}
	if u.timer == nil {
		u.timer = time.AfterFunc(uiWatchWindow, u.idle)
	} else {
		u.timer.Reset(uiWatchWindow)
	}
}

func (u *ui) idle() {
	u.watchMu.Lock()
	defer u.watchMu.Unlock()
	if wait := uiWatchWindow - time.Since(u.lastPoll); wait > 0 {
		u.timer.Reset(wait) // a poll came in as the timer fired
		return
	}
	u.active.Store(false)
	u.f.cfg.Router.SetDecisionTap(nil)
}

// Want implements router.DecisionTap: at most perSecond decisions a
// second, counted with two atomics.
func (u *ui) Want() bool {
	now := time.Now().Unix()
	if s := u.sec.Load(); s != now && u.sec.CompareAndSwap(s, now) {
		u.n.Store(0)
	}
	return u.n.Add(1) <= u.perSecond
}

// Record implements router.DecisionTap.
func (u *ui) Record(d router.DecisionRecord) {
	rec := uiDecision{
		Time: d.Time.UnixMilli(), RequestID: d.ID, Model: d.Model, WorkerID: d.Worker.ID, DPRank: d.Worker.DPRank,
		Via: d.Via.String(), OverlapBlocks: d.OverlapBlocks, PromptBlocks: d.PromptBlocks, Prefill: d.Prefill,
		Candidates: make([]uiCandidate, len(d.Top)),
	}
	for i, c := range d.Top {
		rec.Candidates[i] = uiCandidate{WorkerID: c.Worker.ID, DPRank: c.Worker.DPRank, OverlapBlocks: c.OverlapBlocks, Busy: c.Busy,
			Prefill: round2(c.Prefill), Decode: round2(c.Decode), CacheCredit: round2(c.CacheCredit), Cost: round2(c.Total)}
	}
	u.decMu.Lock()
	u.seq++
	rec.Seq = u.seq
	if len(u.ring) < uiDecisions {
		u.ring = append(u.ring, rec)
	} else {
		u.ring[int((u.seq-1)%uiDecisions)] = rec
	}
	u.decMu.Unlock()
}

// observeTTFT feeds the TTFT series while a page is open.
func (u *ui) observeTTFT(d time.Duration) {
	if !u.watched() {
		return
	}
	u.ttftNanos.Add(int64(d))
	u.ttftCount.Add(1)
}

// decisionsSince returns the recorded decisions after seq, oldest first,
// and the newest seq.
func (u *ui) decisionsSince(since uint64) ([]uiDecision, uint64) {
	u.decMu.Lock()
	defer u.decMu.Unlock()
	out := make([]uiDecision, 0, len(u.ring))
	for _, d := range u.ring {
		if d.Seq > since {
			out = append(out, d)
		}
	}
	slices.SortFunc(out, func(a, b uiDecision) int { return int(a.Seq) - int(b.Seq) })
	return out, u.seq
}

// sample adds a series point when the last is uiSampleEvery old: rates
// are taken between consecutive points, so a page that polls faster
// sees the same curve.
func (u *ui) sample(now time.Time, st router.Stats, engines []EngineStatus) ([]uiPoint, map[uint64]float64) {
	u.sampleMu.Lock()
	defer u.sampleMu.Unlock()
	cur := uiCounters{decisions: st.Decisions, overlap: st.OverlapBlocks, prompt: st.PromptBlocks, ttftNanos: u.ttftNanos.Load(), ttftCount: u.ttftCount.Load()}
	if u.lastAt.IsZero() || now.Sub(u.lastAt) >= uiSampleEvery {
		if !u.lastAt.IsZero() {
			dt := now.Sub(u.lastAt).Seconds()
			p := uiPoint{T: now.UnixMilli(), RPS: round2(float64(cur.decisions-u.last.decisions) / dt), Queue: st.QueuePending}
			if dp := cur.prompt - u.last.prompt; dp > 0 {
				v := round2(float64(cur.overlap-u.last.overlap) / float64(dp))
				p.HitRate = &v
			}
			if n := cur.ttftCount - u.last.ttftCount; n > 0 {
				v := round2(float64(cur.ttftNanos-u.last.ttftNanos) / float64(n) / 1e6)
				p.TTFTms = &v
			}
			u.points = append(u.points, p)
			if len(u.points) > uiPoints {
				u.points = slices.Delete(u.points, 0, len(u.points)-uiPoints)
			}
			rates := map[uint64]float64{}
			for _, e := range engines {
				if prev, ok := u.lastEvents[e.ID]; ok {
					if n := u.f.cfg.Router.WorkerEvents(e.ID); n >= prev {
						rates[e.ID] = round2(float64(n-prev) / dt)
					}
				}
			}
			u.eventRates = rates
		}
		u.last, u.lastAt = cur, now
		clear(u.lastEvents)
		for _, e := range engines {
			u.lastEvents[e.ID] = u.f.cfg.Router.WorkerEvents(e.ID)
		}
	}
	return slices.Clone(u.points), u.eventRates
}

func round2(v float64) float64 {
	r, _ := strconv.ParseFloat(strconv.FormatFloat(v, 'f', 2, 64), 64)
	return r
}

// The JSON of GET /ui/api/state; docs/dashboard.md documents it.
type (
	uiState struct {
		Now           int64                  `json:"now"` // unix ms
		Mode          string                 `json:"mode"`
		BlockSize     int                    `json:"block_size"`
		AdminRequired bool                   `json:"admin_required"`
		Controls      bool                   `json:"controls"` // drain and re-admit are available
		Totals        uiTotals               `json:"totals"`
		Queue         uiQueue                `json:"queue"`
		Thresholds    []sched.ModelThreshold `json:"thresholds"`
		Dependencies  map[string]string      `json:"dependencies,omitempty"`
		Engines       []uiEngine             `json:"engines"`
		Decisions     []uiDecision           `json:"decisions"`
		Next          uint64                 `json:"next"`
		Series        []uiPoint              `json:"series"`
		DecisionsPerS int64                  `json:"decisions_sampled_per_s"`
	}
	uiTotals struct {
		Decisions uint64   `json:"decisions"`
		AllBusy   uint64   `json:"all_busy"`
		Active    int      `json:"active_requests"`
		HitRate   *float64 `json:"hit_rate"` // since start
	}
	uiQueue struct {
		Requests int `json:"pending_requests"`
		Tokens   int `json:"pending_tokens"`
	}
	uiEngine struct {
		WorkerID  uint64   `json:"worker_id"`
		Name      string   `json:"name"`
		Model     string   `json:"model"`
		Role      string   `json:"role"`
		State     string   `json:"state"`
		Why       string   `json:"why,omitempty"` // not in routing, because
		EventsPS  *float64 `json:"kv_events_per_s"`
		Warnings  []string `json:"warnings"`
		Ranks     []uiRank `json:"ranks"`
		BlockSize int      `json:"block_size"`
		// Unsupported lists the KV event fields the router does not
		// honour (unsupported.go), [] when none.
		Unsupported []uiUnsupported `json:"kv_events_unsupported"`
	}
	uiRank struct {
		DPRank              uint32  `json:"dp_rank"`
		IndexedBlocks       int     `json:"indexed_blocks"`
		CapacityBlocks      int     `json:"capacity_blocks"`
		ActiveDecodeBlocks  float64 `json:"active_decode_blocks"`
		ActivePrefillTokens int     `json:"active_prefill_tokens"`
		ActiveRequests      int     `json:"active_requests"`
		Busy                bool    `json:"busy"`
		KVEvents            string  `json:"kv_events"`
		// LearnedPrefillTPS is the learned prefill rate in tokens per
		// second, 0 while fitting; absent without the learned model.
		LearnedPrefillTPS *float64 `json:"learned_prefill_tokens_per_s,omitempty"`
	}
	uiDecision struct {
		Seq           uint64        `json:"seq"`
		Time          int64         `json:"time"` // unix ms
		RequestID     string        `json:"request_id"`
		Model         string        `json:"model"`
		WorkerID      uint64        `json:"worker_id"`
		DPRank        uint32        `json:"dp_rank"`
		Via           string        `json:"via"`
		OverlapBlocks int           `json:"overlap_blocks"`
		PromptBlocks  int           `json:"prompt_blocks"`
		Prefill       bool          `json:"prefill,omitempty"`
		Candidates    []uiCandidate `json:"candidates"`
	}
	uiCandidate struct {
		WorkerID      uint64  `json:"worker_id"`
		DPRank        uint32  `json:"dp_rank"`
		OverlapBlocks int     `json:"overlap_blocks"`
		Busy          bool    `json:"busy"`
		Prefill       float64 `json:"prefill"`
		Decode        float64 `json:"decode"`
		CacheCredit   float64 `json:"cache_credit"`
		Cost          float64 `json:"cost"`
	}
	uiPoint struct {
		T       int64    `json:"t"` // unix ms
		HitRate *float64 `json:"hit_rate"`
		TTFTms  *float64 `json:"ttft_ms"`
		RPS     float64  `json:"decisions_per_s"`
		Queue   int      `json:"queue"`
	}
)

func (f *Frontend) servePage(w http.ResponseWriter, _ *http.Request) {
	h := w.Header()
	h.Set("Content-Type", "text/html; charset=utf-8")
	h.Set("Cache-Control", "no-store")
	// Nothing but the router itself: the page must work offline, and a
	// token typed into it must not leave for anywhere else.
	h.Set("Content-Security-Policy", "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
	h.Set("X-Content-Type-Options", "nosniff")
	_, _ = w.Write(uiPage)
}

func (f *Frontend) uiState(w http.ResponseWriter, r *http.Request) {
	var since uint64
	if s := r.URL.Query().Get("since"); s != "" {
		v, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			writeHTTPError(w, badRequest("invalid_since", "since", "since must be a decision sequence number (an unsigned integer), got %q", s))
			return
		}
		since = v
	}
	now := time.Now()
	f.ui.touch(now)
	rt := f.cfg.Router
	st := rt.Stats()
	engines := f.engineStatuses()
	points, rates := f.ui.sample(now, st, engines)
	decisions, next := f.ui.decisionsSince(since)
	out := uiState{
		Now: now.UnixMilli(), Mode: string(rt.Mode()), BlockSize: rt.BlockSize(),
		AdminRequired: f.admin.set, Controls: f.cfg.SetDrained != nil,
		Totals:     uiTotals{Decisions: st.Decisions, AllBusy: st.AllBusy, Active: st.Load.Active},
		Queue:      uiQueue{Requests: st.QueuePending, Tokens: st.QueuePendingTokens},
		Thresholds: thresholdsInForce(rt.Thresholds()), Decisions: decisions, Next: next, Series: points,
		DecisionsPerS: f.ui.perSecond,
	}
	if st.PromptBlocks > 0 {
		v := round2(float64(st.OverlapBlocks) / float64(st.PromptBlocks))
		out.Totals.HitRate = &v
	}
	// Lists are [] when empty, never null: the page (and any client)
	// iterates them without a check, and a page's first poll, which starts
	// the feed, finds no decision and no point yet.
	out.Thresholds, out.Engines = nonNil(out.Thresholds), nonNil(out.Engines)
	out.Decisions, out.Series = nonNil(out.Decisions), nonNil(out.Series)
	if f.cfg.Dependencies != nil {
		out.Dependencies = f.cfg.Dependencies()
	}
	out.Engines = f.uiEngines(engines, rates)
	writeJSON(w, http.StatusOK, out)
}

// engineStatuses lists every configured engine: the registry's list when
// it gives one, else the engines in routing.
func (f *Frontend) engineStatuses() []EngineStatus {
	if f.cfg.Engines != nil {
		return f.cfg.Engines()
	}
	var out []EngineStatus
	for _, wk := range f.cfg.Workers() {
		out = append(out, EngineStatus{ID: wk.ID, Name: wk.Name, URL: wk.BaseURL, Events: wk.Events, Model: wk.Model, DPSize: wk.DPSize, State: "up"})
	}
	return out
}

func (f *Frontend) uiEngines(engines []EngineStatus, rates map[uint64]float64) []uiEngine {
	rt := f.cfg.Router
	infos := map[uint64]router.WorkerInfo{}
	for _, in := range rt.Workers() {
		infos[in.ID] = in
	}
	loads := map[kv.Worker]router.WorkerLoad{}
	for _, l := range rt.Loads() {
		loads[l.Worker] = l
	}
	prefill := map[kv.Worker]float64{}
	for _, fit := range rt.PrefillFits() {
		prefill[fit.Worker] = round2(fit.TokensPerSecond)
	}
	sizes := map[uint64]int{}
	for _, s := range rt.WorkerBlockSizes() {
		sizes[s.ID] = s.BlockSize
	}
	out := make([]uiEngine, 0, len(engines))
	for _, e := range engines {
		ue := uiEngine{WorkerID: e.ID, Name: e.Name, Model: e.Model, Role: e.Role, State: e.State, Why: e.Why, Warnings: slices.Clone(e.Warnings), BlockSize: rt.BlockSize(),
			Unsupported: unsupportedList(e.Unsupported)}
		if ue.Role == "" {
			ue.Role = router.RoleBoth.String()
		}
		if ue.Warnings == nil {
			ue.Warnings = []string{}
		}
		if v, ok := rates[e.ID]; ok {
			ue.EventsPS = &v
		}
		if size, ok := sizes[e.ID]; ok && size != rt.BlockSize() {
			ue.BlockSize = size
			ue.Warnings = append(ue.Warnings, fmt.Sprintf("block size mismatch: the engine's KV blocks hold %d tokens, the router's %d", size, rt.BlockSize()))
		}
		info, routed := infos[e.ID]
		busy := rt.Thresholds().Get(info.Model)
		for rank := range max(info.DPSize, e.DPSize, 1) {
			wk := kv.Worker{ID: e.ID, DPRank: uint32(rank)}
			ur := uiRank{DPRank: uint32(rank), CapacityBlocks: info.TotalKVBlocks, KVEvents: "unknown"}
			if routed {
				l := loads[wk]
				ur.IndexedBlocks = rt.IndexedBlocks(wk)
				ur.ActiveDecodeBlocks = round2(l.ActiveDecodeBlocks)
				ur.ActivePrefillTokens = l.ActivePrefillTokens
				ur.ActiveRequests = l.ActiveRequests
				if v, ok := prefill[wk]; ok {
					ur.LearnedPrefillTPS = &v
				}
				ur.Busy = busy.Busy(&sched.Candidate{ActiveDecodeBlocks: l.ActiveDecodeBlocks, ActivePrefillTokens: l.ActivePrefillTokens, TotalKVBlocks: info.TotalKVBlocks})
				ev := rt.KVEvents(wk)
				ur.KVEvents = ev.String()
				if ev == router.EventsMissing {
					ue.Warnings = append(ue.Warnings, fmt.Sprintf("no KV events from dp rank %d: routed by predicted caches; %s", rank, KVEventsHint(e.Events)))
				}
			}
			ue.Ranks = append(ue.Ranks, ur)
		}
		out = append(out, ue)
	}
	return out
}

// drainRequest is the body of POST /router/drain.
type drainRequest struct {
	WorkerID *uint64 `json:"worker_id"`
	Drained  *bool   `json:"drained"`
}

// drainWorker takes an engine out of routing (drained: true) or lets it
// back in (false), through the registry's Config.SetDrained.
func (f *Frontend) drainWorker(w http.ResponseWriter, r *http.Request) {
	if f.cfg.SetDrained == nil {
		writeError(w, http.StatusNotImplemented, "invalid_request_error", "not_supported", "", "this router has no engine registry to drain engines from")
		return
	}
	body, herr := readBody(w, r, f.cfg.MaxBodyBytes)
	if herr != nil {
		writeHTTPError(w, herr)
		return
	}
	if _, err := splitObject(body); err != nil {
		writeHTTPError(w, badRequest("invalid_json", "", "the body must be a JSON object"))
		return
	}
	var req drainRequest
	if err := json.Unmarshal(body, &req); err != nil {
		writeHTTPError(w, badRequest("invalid_drain", "", "%s", jsonerr.Describe(err, &req, "")))
		return
	}
	if req.WorkerID == nil {
		writeHTTPError(w, badRequest("missing_worker_id", "worker_id", "worker_id is required"))
		return
	}
	if req.Drained == nil {
		writeHTTPError(w, badRequest("missing_drained", "drained", "drained is required: true takes the engine out of routing, false lets it back in"))
		return
	}
	if err := f.cfg.SetDrained(*req.WorkerID, *req.Drained); err != nil {
		if errors.Is(err, ErrUnknownEngine) {
			writeError(w, http.StatusNotFound, "invalid_request_error", "unknown_worker", "worker_id", "no engine has worker_id %d", *req.WorkerID)
			return
		}
		writeError(w, http.StatusInternalServerError, "server_error", "drain_failed", "", "%v", err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"worker_id": *req.WorkerID, "drained": *req.Drained})
}

func nonNil[T any](s []T) []T {
	if s == nil {
		return []T{}
	}
	return s
}
