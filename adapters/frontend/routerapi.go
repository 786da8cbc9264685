package frontend

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/adapters/jsonerr"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/core/sched"
)

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// decodeObject reads a JSON object body into a map.
func (f *Frontend) decodeObject(w http.ResponseWriter, r *http.Request) (map[string]json.RawMessage, *httpError) {
	body, herr := readBody(w, r, f.cfg.MaxBodyBytes)
	if herr != nil {
		return nil, herr
	}
	top, err := splitObject(body)
	if err != nil {
		return nil, badRequest("invalid_json", "", "the body must be a JSON object")
	}
	return top, nil
}

func stringField(top map[string]json.RawMessage, key string) (string, *httpError) {
	if !present(top[key]) {
		return "", nil
	}
	var s string
	if err := json.Unmarshal(top[key], &s); err != nil {
		return "", badRequest("invalid_"+key, key, "%s must be a string", key)
	}
	return s, nil
}

// cacheSalt reads vLLM's top-level cache_salt: the request's blocks are
// cached apart from every other salt's (and from unsalted ones), so the
// router matches them only against blocks of the same salt. Like vLLM, a
// salt that is not a non-empty string is refused.
func cacheSalt(top map[string]json.RawMessage) (string, *httpError) {
	if !present(top["cache_salt"]) {
		return "", nil
	}
	var s string
	if err := json.Unmarshal(top["cache_salt"], &s); err != nil || s == "" {
		return "", badRequest("invalid_cache_salt", "cache_salt", "cache_salt must be a non-empty string")
	}
	return s, nil
}

// MaxRequestIDBytes bounds a client's request_id: a booking holds it
// until it is freed or expires.
const MaxRequestIDBytes = 256

func requestID(top map[string]json.RawMessage, required bool) (string, *httpError) {
	id, herr := stringField(top, "request_id")
	switch {
	case herr != nil:
		return "", herr
	case id == "" && required:
		return "", badRequest("missing_request_id", "request_id", "request_id is required")
	case len(id) > MaxRequestIDBytes:
		return "", badRequest("invalid_request_id", "request_id", "request_id is %d bytes long, at most %d are allowed", len(id), MaxRequestIDBytes)
	}
	return id, nil
}

// routeQuery reads the common part of /router/best_worker and
// /router/potential_loads: the model, the LoRA adapter and the tokens.
func (f *Frontend) routeQuery(w http.ResponseWriter, r *http.Request) (top map[string]json.RawMessage, req router.Request, n nvext, herr *httpError) {
	if top, herr = f.decodeObject(w, r); herr != nil {
		return
	}
	if req.Model, herr = stringField(top, "model"); herr != nil {
		return
	}
	if req.LoRA, herr = stringField(top, "lora_name"); herr != nil {
		return
	}
	if req.CacheSalt, herr = cacheSalt(top); herr != nil {
		return
	}
	if herr = checkPrompt(top, kindAny); herr != nil {
		return
	}
	all, serving := f.workersFor(req.Model)
	if req.Model != "" && f.isAdapter(req.Model, all) {
		// The model is an adapter: routed as /v1 routes it, but never
		// loaded, since this only asks where a request would go.
		req.LoRA = req.Model
		req.Model, serving = adapterHolders(req.LoRA, all)
		if len(serving) == 0 {
			herr = newError(http.StatusNotFound, "invalid_request_error", "model_not_found", "model", "The model `%s` does not exist: no engine has the LoRA adapter loaded.", req.LoRA)
			return
		}
		req.Only = workerIDs(serving)
	} else if req.Model != "" && len(all) > 0 && len(serving) == 0 {
		herr = f.unknownModel(req.Model)
		return
	}
	if _, holders := adapterHolders(req.LoRA, serving); req.LoRA != "" && len(holders) > 0 {
		// Engines that list no adapters (SGLang, older vLLM) are not
		// known not to hold it: only a listed one restricts the choice.
		serving, req.Only = holders, workerIDs(holders)
	}
	var warnings []string
	if n, _, warnings, herr = parseNvext(requestNvext(top, r.Header, f.cfg.StrictNvext), &req); herr != nil {
		return
	}
	warn(w, warnings)
	if present(top["pool"]) {
		var pool string
		_ = json.Unmarshal(top["pool"], &pool)
		switch pool {
		case poolPrefill:
			req.Prefill = true
			if n.PrefillWorkerID != nil {
				req.Target = &kv.Worker{ID: *n.PrefillWorkerID}
				if n.PrefillDPRank != nil {
					req.Target.DPRank = *n.PrefillDPRank
				}
			}
		case poolDecode:
		default:
			herr = badRequest("invalid_pool", "pool", "pool must be %q or %q, got %s", poolPrefill, poolDecode, top["pool"])
			return
		}
	}
	req.Tokens, req.MM, herr = f.promptTokens(r.Context(), top, kindAny, req.Model, serving, n.TokenData)
	if herr == nil && r.Context().Err() != nil {
		herr = errCancelled(r.Context())
	}
	return
}

// bestWorkerResponse is the answer of POST /router/best_worker.
type bestWorkerResponse struct {
	WorkerID      uint64  `json:"worker_id"`
	DPRank        uint32  `json:"dp_rank"`
	OverlapBlocks int     `json:"overlap_blocks"`
	PromptBlocks  int     `json:"prompt_blocks"`
	RequestID     string  `json:"request_id,omitempty"` // set when booked
	Via           string  `json:"via"`
	Timing        *timing `json:"timing"`
	Warning       string  `json:"warning,omitempty"`
}

// bestWorker is KvPushRouter.best_worker over HTTP: with request_id the
// request is booked (free it with /router/free), without it nothing changes.
func (f *Frontend) bestWorker(w http.ResponseWriter, r *http.Request) {
	top, req, _, herr := f.routeQuery(w, r)
	if herr == nil {
		req.ID, herr = requestID(top, false)
	}
	if herr == nil && req.ID != "" {
		// Booking holds load on an engine until freed: the admin's call.
		if !f.allowAdmin(w, r) {
			return
		}
		herr = f.checkBookingSize(&req)
		if herr == nil && !f.bookings.reserve(f.cfg.Router, req.ID, time.Now()) {
			herr = tooManyBookings(f.cfg.MaxBookings)
		}
	}
	if herr != nil {
		writeHTTPError(w, herr)
		return
	}
	req.OverrideBusy = f.isAdmin(r)
	ctx, done := f.requestContext(r) // a queued booking must not hold up a drain
	defer done()
	d, err := f.cfg.Router.BestWorker(ctx, f.withoutEjected(&req))
	if err != nil {
		if req.ID != "" && !errors.Is(err, router.ErrDuplicateID) {
			f.bookings.release(req.ID)
		}
		writeHTTPError(w, routeError(err, req.Model))
		return
	}
	pool := poolDecode
	if req.Prefill {
		pool = poolPrefill
	}
	f.observeDecision(f.modelLabel(req.Model), pool, &d, true)
	writeJSON(w, http.StatusOK, bestWorkerResponse{
		WorkerID: d.Worker.ID, DPRank: d.Worker.DPRank, OverlapBlocks: d.OverlapBlocks, PromptBlocks: d.PromptBlocks,
		RequestID: req.ID, Via: d.Via.String(), Warning: d.Warning,
		Timing: &timing{
			RoutingMS: ms(d.Timings.Total), QueueMS: ms(d.Queued), HashMS: ms(d.Timings.Hash),
			FindMatchesMS: ms(d.Timings.FindMatches), SchedulingMS: ms(d.Timings.Schedule),
		},
	})
}

// potentialLoad is one rank in the answer of POST /router/potential_loads.
type potentialLoad struct {
	WorkerID               uint64  `json:"worker_id"`
	DPRank                 uint32  `json:"dp_rank"`
	OverlapBlocks          int     `json:"overlap_blocks"`
	ActiveDecodeBlocks     float64 `json:"active_decode_blocks"`
	ActivePrefillTokens    int     `json:"active_prefill_tokens"`
	ActiveRequests         int     `json:"active_requests"`
	PotentialDecodeBlocks  float64 `json:"potential_decode_blocks"`
	PotentialPrefillTokens int     `json:"potential_prefill_tokens"`
}

func (f *Frontend) potentialLoads(w http.ResponseWriter, r *http.Request) {
	_, req, _, herr := f.routeQuery(w, r)
	if herr != nil {
		writeHTTPError(w, herr)
		return
	}
	models := map[uint64]string{}
	for _, in := range f.cfg.Router.Workers() {
		models[in.ID] = in.Model
	}
	out := []potentialLoad{}
	for _, l := range f.cfg.Router.PotentialLoadsFor(&req) {
		if m := models[l.Worker.ID]; req.Model != "" && m != "" && m != req.Model {
			continue
		}
		if req.Only != nil && !slices.Contains(req.Only, l.Worker.ID) {
			continue
		}
		out = append(out, potentialLoad{
			WorkerID: l.Worker.ID, DPRank: l.Worker.DPRank, OverlapBlocks: l.OverlapBlocks,
			ActiveDecodeBlocks: l.ActiveDecodeBlocks, ActivePrefillTokens: l.ActivePrefillTokens, ActiveRequests: l.ActiveRequests,
			PotentialDecodeBlocks: l.PotentialDecodeBlocks, PotentialPrefillTokens: l.PotentialPrefillTokens,
		})
	}
	writeJSON(w, http.StatusOK, out)
}

// requestIDOp answers /router/mark_prefill_complete and /router/free:
// {"request_id", "found"}, found false when no such request is booked.
func (f *Frontend) requestIDOp(w http.ResponseWriter, r *http.Request, op func(string) bool) {
	top, herr := f.decodeObject(w, r)
	var id string
	if herr == nil {
		id, herr = requestID(top, true)
	}
	if herr != nil {
		writeHTTPError(w, herr)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"request_id": id, "found": op(id)})
}

func (f *Frontend) markPrefillComplete(w http.ResponseWriter, r *http.Request) {
	f.requestIDOp(w, r, f.cfg.Router.MarkPrefillCompleted)
}

func (f *Frontend) free(w http.ResponseWriter, r *http.Request) {
	f.requestIDOp(w, r, func(id string) bool {
		f.bookings.release(id)
		return f.cfg.Router.Free(id)
	})
}

// models lists the distinct models of the workers (workers serving every
// model ("") add none) and, as vLLM does, the LoRA adapters they hold and
// those the router may load, each with its base model as parent.
func (f *Frontend) models(w http.ResponseWriter, _ *http.Request) {
	workers := f.cfg.Workers()
	var names []string
	parents := map[string]string{}
	for _, wk := range workers {
		if wk.Model != "" && !slices.Contains(names, wk.Model) {
			names = append(names, wk.Model)
		}
		for _, a := range wk.Adapters {
			if _, ok := parents[a]; !ok {
				parents[a] = wk.Model
			}
		}
	}
	if f.cfg.LoRA.DynamicLoading {
		for name, m := range f.cfg.LoRA.Modules {
			if _, ok := parents[name]; !ok {
				parents[name] = m.Base
			}
		}
	}
	slices.Sort(names)
	type model struct {
		ID      string `json:"id"`
		Object  string `json:"object"`
		Created int64  `json:"created"`
		OwnedBy string `json:"owned_by"`
		// Parent is an adapter's base model ("" when the engines serve
		// any), null for a model.
		Parent *string `json:"parent"`
		// Tokenizer says who tokenizes the model's text and chat prompts.
		Tokenizer string `json:"tokenizer"`
	}
	where := func(m string) string {
		if f.cfg.Tokenizer != nil && f.cfg.Tokenizer(m) != nil {
			return "in-process"
		}
		return "engine"
	}
	data := make([]model, 0, len(names)+len(parents))
	for _, n := range names {
		data = append(data, model{ID: n, Object: "model", Created: f.created, OwnedBy: "kvrouter", Tokenizer: where(n)})
	}
	for _, a := range slices.Sorted(maps.Keys(parents)) {
		p := parents[a]
		data = append(data, model{ID: a, Object: "model", Created: f.created, OwnedBy: "kvrouter", Parent: &p, Tokenizer: where(p)})
	}
	writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": data})
}

func (f *Frontend) listThresholds(w http.ResponseWriter, _ *http.Request) {
	writeJSON(w, http.StatusOK, map[string]any{"thresholds": thresholdsInForce(f.cfg.Router.Thresholds())})
}

// thresholdsInForce lists the models given thresholds at run time and,
// first, under model "", the command line's (--active-*-threshold), which
// every other model is held to: a GET must show what decides busyness, not
// only what was changed.
func thresholdsInForce(th *sched.Thresholds) []sched.ModelThreshold {
	list := th.List()
	if d := th.Defaults(); d.ActiveDecodeBlocks != nil || d.ActivePrefillTokens != nil {
		list = append([]sched.ModelThreshold{{Model: "", BusyThreshold: d}}, list...)
	}
	return list
}

// servesModel tells whether an engine, in routing or not, serves model.
func (f *Frontend) servesModel(model string) bool {
	if f.cfg.Models != nil && slices.Contains(f.cfg.Models(), model) {
		return true
	}
	_, serving := f.workersFor(model)
	return len(serving) > 0
}

// thresholdValue shows a threshold in the log: its value, or off.
func thresholdValue[T float64 | int](v *T) string {
	if v == nil {
		return "off"
	}
	return fmt.Sprint(*v)
}

// postThreshold sets the fields given for the model, switches off those
// given as null, and answers the thresholds now in force; with only the
// model it just reads them.
func (f *Frontend) postThreshold(w http.ResponseWriter, r *http.Request) {
	body, herr := readBody(w, r, f.cfg.MaxBodyBytes)
	if herr != nil {
		writeHTTPError(w, herr)
		return
	}
	top, err := splitObject(body)
	if err != nil {
		writeHTTPError(w, badRequest("invalid_json", "", "the body must be a JSON object"))
		return
	}
	var mt sched.ModelThreshold
	if err := json.Unmarshal(body, &mt); err != nil {
		// Well-formed JSON by now: a field of the wrong type.
		writeHTTPError(w, badRequest("invalid_threshold", "", "%s", jsonerr.Describe(err, &mt, "")))
		return
	}
	if strings.TrimSpace(mt.Model) == "" {
		writeHTTPError(w, badRequest("missing_model", "model", "model is required"))
		return
	}
	if len(mt.Model) > sched.MaxModelNameBytes {
		writeHTTPError(w, badRequest("invalid_model", "model", "model is %d bytes long, at most %d are allowed", len(mt.Model), sched.MaxModelNameBytes))
		return
	}
	if !f.servesModel(mt.Model) {
		writeHTTPError(w, newError(http.StatusNotFound, "invalid_request_error", "model_not_found", "model", "The model `%s` does not exist: no engine of this router serves it (see /v1/models).", mt.Model))
		return
	}
	isNull := func(key string) bool { raw, ok := top[key]; return ok && !present(raw) }
	u := sched.ThresholdUpdate{
		Set:        mt.BusyThreshold,
		DecodeOff:  isNull("active_decode_blocks_threshold"),
		PrefillOff: isNull("active_prefill_tokens_threshold"),
		FracOff:    isNull("active_prefill_tokens_threshold_frac"),
	}
	th := f.cfg.Router.Thresholds()
	if u.Set.ActiveDecodeBlocks == nil && u.Set.ActivePrefillTokens == nil && u.Set.ActivePrefillTokensFrac == nil && !u.DecodeOff && !u.PrefillOff && !u.FracOff {
		writeJSON(w, http.StatusOK, sched.ModelThreshold{Model: mt.Model, BusyThreshold: th.Get(mt.Model)})
		return
	}
	cur, err := th.Update(mt.Model, u)
	if err != nil {
		switch {
		case errors.Is(err, sched.ErrInvalidThreshold):
			writeHTTPError(w, badRequest("invalid_threshold", "", "%s", detail(err, sched.ErrInvalidThreshold)))
		case errors.Is(err, sched.ErrTooManyModels):
			writeHTTPError(w, badRequest("too_many_models", "model", "%s", detail(err, sched.ErrTooManyModels)))
		default:
			writeHTTPError(w, newError(http.StatusInternalServerError, "server_error", "internal", "", "%v", err))
		}
		return
	}
	f.log.Info("busy threshold set", "model", mt.Model, "decode", thresholdValue(cur.ActiveDecodeBlocks), "prefill", thresholdValue(cur.ActivePrefillTokens))
	writeJSON(w, http.StatusOK, sched.ModelThreshold{Model: mt.Model, BusyThreshold: cur})
}
