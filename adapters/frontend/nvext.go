package frontend

import (
	"encoding/json"
	"fmt"
	"maps"
	"math"
	"net/http"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvrouter/kvrouter/adapters/jsonerr"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/core/sched"
)

// overrideFields are the router knobs a request may override, under every
// name Dynamo has used for them.
type overrideFields struct {
	OverlapScoreCredit         *float64 `json:"overlap_score_credit"`
	KVOverlapScoreCredit       *float64 `json:"kv_overlap_score_credit"`
	RouterKVOverlapScoreCredit *float64 `json:"router_kv_overlap_score_credit"`
	PrefillLoadScale           *float64 `json:"prefill_load_scale"`
	RouterPrefillLoadScale     *float64 `json:"router_prefill_load_scale"`
	CacheAffinity              *float64 `json:"cache_affinity"`
	RouterCacheAffinity        *float64 `json:"router_cache_affinity"`
	OverlapScoreWeight         *float64 `json:"overlap_score_weight"`
	KVOverlapScoreWeight       *float64 `json:"kv_overlap_score_weight"`
	RouterKVOverlapScoreWeight *float64 `json:"router_kv_overlap_score_weight"`
	RouterTemperature          *float64 `json:"router_temperature"`
	AssumeKVReuse              *bool    `json:"assume_kv_reuse"`
	RouterAssumeKVReuse        *bool    `json:"router_assume_kv_reuse"`
	TrackPrefillTokens         *bool    `json:"track_prefill_tokens"`
	RouterTrackPrefillTokens   *bool    `json:"router_track_prefill_tokens"`
	SharedCacheMultiplier      *float64 `json:"shared_cache_multiplier"`
}

func first[T any](ps ...*T) *T {
	for _, p := range ps {
		if p != nil {
			return p
		}
	}
	return nil
}

// apply sets the knobs o names onto out, keeping out's others.
func (o *overrideFields) apply(out *sched.Overrides) {
	if o == nil {
		return
	}
	if v := first(o.OverlapScoreCredit, o.KVOverlapScoreCredit, o.RouterKVOverlapScoreCredit); v != nil {
		out.OverlapCredit = v
	}
	if v := first(o.PrefillLoadScale, o.RouterPrefillLoadScale); v != nil {
		out.PrefillLoadScale = v
	}
	if v := first(o.CacheAffinity, o.RouterCacheAffinity); v != nil {
		out.CacheAffinity = v
	}
	if v := first(o.OverlapScoreWeight, o.KVOverlapScoreWeight, o.RouterKVOverlapScoreWeight); v != nil {
		out.LegacyOverlapWeight = v
	}
	if o.RouterTemperature != nil {
		out.Temperature = o.RouterTemperature
	}
	if v := first(o.AssumeKVReuse, o.RouterAssumeKVReuse); v != nil {
		out.AssumeKVReuse = v
	}
	if v := first(o.TrackPrefillTokens, o.RouterTrackPrefillTokens); v != nil {
		out.TrackPrefillTokens = v
	}
	if o.SharedCacheMultiplier != nil {
		out.SharedMultiplier = o.SharedCacheMultiplier
	}
}

// nvext is the request extension as far as the frontend reads it. Every
// key Dynamo's nvext has is known: those kvrouter has no use for are
// accepted and ignored (dynamoOnly); any other key is answered with a
// warning header, or 400 in strict mode (unknownNvext).
type nvext struct {
	overrideFields
	dynamoOnly
	BackendInstanceID    *uint64         `json:"backend_instance_id"`
	DecodeWorkerID       *uint64         `json:"decode_worker_id"`
	DPRank               *uint32         `json:"dp_rank"`
	PrefillWorkerID      *uint64         `json:"prefill_worker_id"`
	PrefillDPRank        *uint32         `json:"prefill_dp_rank"`
	TokenData            []uint32        `json:"token_data"`
	ExtraFields          []string        `json:"extra_fields"`
	AgentHints           *agentHints     `json:"agent_hints"`
	SessionControl       *sessionControl `json:"session_control"`
	RouterConfigOverride *overrideFields `json:"router_config_override"`
}

// dynamoOnly are the nvext keys of Dynamo's that concern its preprocessor
// or engines, not routing.
type dynamoOnly struct {
	GreedSampling      json.RawMessage `json:"greed_sampling"`
	UseRawPrompt       json.RawMessage `json:"use_raw_prompt"`
	Annotations        json.RawMessage `json:"annotations"`
	MaxThinkingTokens  json.RawMessage `json:"max_thinking_tokens"`
	RequestTimestampMS json.RawMessage `json:"request_timestamp_ms"`
}

// agentHints takes the router overrides too: Dynamo's newest
// documentation puts the overlap credit there
// (agent_hints.kv_overlap_score_credit).
type agentHints struct {
	overrideFields
	Priority       *float64 `json:"priority"`
	StrictPriority *uint32  `json:"strict_priority"`
	OSL            *int     `json:"osl"`
	// SpeculativePrefill prefills the next turn's prefix when the turn
	// ends (speculate.go).
	SpeculativePrefill *bool `json:"speculative_prefill"`
	// Dynamo's, accepted without effect: kvrouter's queue orders by
	// priority.
	LatencySensitivity json.RawMessage `json:"latency_sensitivity"`
}

type sessionControl struct {
	SessionID string   `json:"session_id"`
	Action    string   `json:"action"`
	Timeout   *float64 `json:"timeout"` // seconds
}

// extras are what extra_fields asked for.
type extras struct{ workerID, timing bool }

// nvextInput is where a request carries the extension: nvext, and Dynamo's
// router_config_override at the body's top level.
type nvextInput struct {
	nvext, override json.RawMessage
	header          http.Header
	// strict answers an unknown key 400 instead of warning about it.
	strict bool
}

func requestNvext(top map[string]json.RawMessage, header http.Header, strict bool) nvextInput {
	return nvextInput{nvext: top["nvext"], override: top["router_config_override"], header: header, strict: strict}
}

// SessionHeader is Dynamo's header naming a request's session.
const SessionHeader = "X-Dynamo-Session-ID"

// WarningHeader carries what the router did not understand of a request
// it served anyway, e.g. `unknown nvext key "foo"`.
const WarningHeader = "X-Kvrouter-Warning"

// warn adds the warnings to the response's headers, one header each.
func warn(w http.ResponseWriter, warnings []string) {
	for _, m := range warnings {
		w.Header().Add(WarningHeader, m)
	}
}

// parseNvext reads in (absent or null is fine) into the routing fields of
// req and returns what the response should carry and the warnings to send
// with it. When several places name a knob, the most specific wins: the
// top-level router_config_override, then nvext's own keys, then
// nvext.router_config_override, then nvext.agent_hints.
func parseNvext(in nvextInput, req *router.Request) (nvext, extras, []string, *httpError) {
	var n nvext
	raw := in.nvext
	if present(raw) {
		if err := json.Unmarshal(raw, &n); err != nil {
			return n, extras{}, nil, badRequest("invalid_nvext", "nvext", "%s", jsonerr.Describe(err, &n, "nvext"))
		}
	}
	var top *overrideFields
	if present(in.override) {
		top = new(overrideFields)
		if err := json.Unmarshal(in.override, top); err != nil {
			return n, extras{}, nil, badRequest("invalid_router_config_override", "router_config_override", "%s", jsonerr.Describe(err, top, "router_config_override"))
		}
	}
	warnings := unknownNvext(raw, in.override)
	if in.strict && len(warnings) > 0 {
		return n, extras{}, nil, badRequest("unknown_nvext_key", "nvext", "%s (this router runs with --strict-nvext)", strings.Join(warnings, "; "))
	}
	top.apply(&req.Overrides)
	n.overrideFields.apply(&req.Overrides)
	n.RouterConfigOverride.apply(&req.Overrides)
	if n.AgentHints != nil {
		n.AgentHints.overrideFields.apply(&req.Overrides)
	}
	header := in.header

	target := first(n.BackendInstanceID, n.DecodeWorkerID)
	if h := header.Get("x-worker-instance-id"); h != "" {
		id, err := strconv.ParseUint(h, 10, 64)
		if err != nil {
			return n, extras{}, nil, badRequest("invalid_header", "x-worker-instance-id", "x-worker-instance-id %q is not a worker id", h)
		}
		target = &id
	}
	switch {
	case target != nil:
		w := kv.Worker{ID: *target}
		if n.DPRank != nil {
			w.DPRank = *n.DPRank
		}
		req.Target = &w
	case n.DPRank != nil:
		return n, extras{}, nil, badRequest("invalid_nvext", "nvext.dp_rank", "nvext.dp_rank needs nvext.backend_instance_id")
	}
	if n.PrefillDPRank != nil && n.PrefillWorkerID == nil {
		return n, extras{}, nil, badRequest("invalid_nvext", "nvext.prefill_dp_rank", "nvext.prefill_dp_rank needs nvext.prefill_worker_id")
	}

	if h := n.AgentHints; h != nil {
		if h.Priority != nil {
			req.Priority = *h.Priority
		}
		if h.StrictPriority != nil {
			req.StrictPriority = *h.StrictPriority
		}
		if h.OSL != nil {
			if *h.OSL < 0 {
				return n, extras{}, nil, badRequest("invalid_nvext", "nvext.agent_hints.osl", "nvext.agent_hints.osl must be ≥ 0, got %d", *h.OSL)
			}
			req.OSL = *h.OSL
		}
	}

	// Dynamo's session header names the session when nvext does not; alone
	// it binds the session to its first engine, as action "bind" does.
	if h := header.Get(SessionHeader); h != "" {
		switch {
		case n.SessionControl == nil:
			n.SessionControl = &sessionControl{SessionID: h, Action: string(sched.SessionBind)}
		case n.SessionControl.SessionID == "":
			n.SessionControl.SessionID = h
		}
	}
	if s := n.SessionControl; s != nil {
		if s.SessionID == "" {
			return n, extras{}, nil, badRequest("invalid_nvext", "nvext.session_control.session_id", "nvext.session_control needs a session_id")
		}
		action, err := sched.ParseSessionAction(s.Action)
		if err != nil {
			return n, extras{}, nil, badRequest("invalid_nvext", "nvext.session_control.action", "nvext.session_control.action must be open, bind, close or absent, got %q", s.Action)
		}
		sc := &sched.SessionControl{ID: s.SessionID, Action: action}
		if s.Timeout != nil {
			// The router bounds the timeout; this only keeps the conversion
			// to a duration from overflowing.
			t := *s.Timeout
			if math.IsNaN(t) || t < 0 || t > 1e9 {
				return n, extras{}, nil, badRequest("invalid_nvext", "nvext.session_control.timeout", "nvext.session_control.timeout must be a number of seconds ≥ 0, got %v", t)
			}
			sc.Timeout = time.Duration(t * float64(time.Second))
		}
		req.Session = sc
	}

	var ex extras
	for _, f := range n.ExtraFields {
		switch f {
		case "worker_id":
			ex.workerID = true
		case "timing":
			ex.timing = true
		}
	}
	return n, ex, warnings, nil
}

func (e extras) any() bool { return e.workerID || e.timing }

// responseNvext is the nvext object added to responses.
type responseNvext struct {
	WorkerID      *uint64 `json:"worker_id,omitempty"`
	DPRank        *uint32 `json:"dp_rank,omitempty"`
	OverlapBlocks *int    `json:"overlap_blocks,omitempty"`
	PromptBlocks  *int    `json:"prompt_blocks,omitempty"`
	// The prefill worker of a disaggregated request.
	PrefillWorkerID      *uint64 `json:"prefill_worker_id,omitempty"`
	PrefillDPRank        *uint32 `json:"prefill_dp_rank,omitempty"`
	PrefillOverlapBlocks *int    `json:"prefill_overlap_blocks,omitempty"`
	// TransferBlocks are the prompt blocks the decode worker lacked, as the
	// router's index saw them: what it had to pull.
	TransferBlocks *int    `json:"transfer_blocks,omitempty"`
	Timing         *timing `json:"timing,omitempty"`
}

type timing struct {
	// ReadMS is the time spent reading the client's request body, a part
	// of FrontendMS that the client's sending sets as much as the frontend.
	ReadMS        float64 `json:"read_ms"`
	TokenizeMS    float64 `json:"tokenize_ms"`
	RoutingMS     float64 `json:"routing_ms"`
	QueueMS       float64 `json:"queue_ms"`
	HashMS        float64 `json:"hash_ms"`
	FindMatchesMS float64 `json:"find_matches_ms"`
	SchedulingMS  float64 `json:"scheduling_ms"`
	// FrontendMS is the time the frontend held the request before sending
	// it to the engine: reading and parsing it, tokenizing, routing.
	FrontendMS float64  `json:"frontend_ms"`
	TTFTMS     float64  `json:"ttft_ms"`
	TotalMS    *float64 `json:"total_ms,omitempty"`
	// PrefillMS is a disaggregated request's remote prefill, routing
	// included; DecodeTTFTMS the rest of its time to first token, from the
	// decode request to its first token, which includes the KV transfer.
	PrefillMS    *float64 `json:"prefill_ms,omitempty"`
	DecodeTTFTMS *float64 `json:"decode_ttft_ms,omitempty"`
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// heldSpans are the parts of the time the frontend held a request before
// the engine got it (total).
type heldSpans struct{ read, tokenize, total time.Duration }

// build renders the response nvext; total < 0 leaves total_ms out.
func (e extras) build(d *router.Decision, pd *prefillResult, held heldSpans, ttft, total time.Duration) []byte {
	frontend := held.total
	var out responseNvext
	if e.workerID {
		id, rank, ov, pb := d.Worker.ID, d.Worker.DPRank, d.OverlapBlocks, d.PromptBlocks
		out.WorkerID, out.DPRank, out.OverlapBlocks, out.PromptBlocks = &id, &rank, &ov, &pb
		if pd != nil {
			pid, prank, pov := pd.decision.Worker.ID, pd.decision.Worker.DPRank, pd.decision.OverlapBlocks
			out.PrefillWorkerID, out.PrefillDPRank, out.PrefillOverlapBlocks = &pid, &prank, &pov
			moved := max(0, d.PromptBlocks-d.OverlapBlocks)
			out.TransferBlocks = &moved
		}
	}
	if e.timing {
		t := &timing{
			ReadMS: ms(held.read), TokenizeMS: ms(held.tokenize), RoutingMS: ms(d.Timings.Total), QueueMS: ms(d.Queued),
			HashMS: ms(d.Timings.Hash), FindMatchesMS: ms(d.Timings.FindMatches), SchedulingMS: ms(d.Timings.Schedule),
			FrontendMS: ms(frontend), TTFTMS: ms(ttft),
		}
		if total >= 0 {
			v := ms(total)
			t.TotalMS = &v
		}
		if pd != nil {
			p, dt := ms(pd.elapsed), ms(ttft-frontend-pd.elapsed)
			t.PrefillMS, t.DecodeTTFTMS = &p, &dt
		}
		out.Timing = t
	}
	b, _ := json.Marshal(out)
	return b
}

// injectNvext adds "nvext": ext to the JSON object obj, keeping obj's bytes
// otherwise. ok is false when obj is not a JSON object.
func injectNvext(obj, ext []byte) ([]byte, bool) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(obj, &m); err != nil || m == nil {
		return nil, false
	}
	if _, dup := m["nvext"]; dup {
		m["nvext"] = ext
		b, err := json.Marshal(m)
		return b, err == nil
	}
	end := len(obj) - 1
	for end >= 0 && isSpace(obj[end]) {
		end--
	}
	out := make([]byte, 0, len(obj)+len(ext)+12)
	out = append(out, obj[:end]...) // up to the closing brace
	if len(m) > 0 {
		out = append(out, ',')
	}
	out = append(out, `"nvext":`...)
	out = append(out, ext...)
	out = append(out, '}')
	out = append(out, obj[end+1:]...)
	return out, true
}

func isSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

// unknownNvext names the keys of nvext (and of its objects) and of a
// top-level router_config_override that neither kvrouter nor Dynamo knows:
// a misspelt override would otherwise be ignored without a word.
func unknownNvext(raw, override json.RawMessage) []string {
	var out []string
	out = unknownKeys(raw, reflect.TypeFor[nvext](), "nvext", out)
	return unknownKeys(override, reflect.TypeFor[overrideFields](), "router_config_override", out)
}

// unknownKeys appends, as `unknown nvext key "path.key"`, the keys of the
// JSON object raw that no field of the struct t names, descending into
// the fields that are structs themselves.
func unknownKeys(raw json.RawMessage, t reflect.Type, path string, out []string) []string {
	var obj map[string]json.RawMessage
	if !present(raw) || json.Unmarshal(raw, &obj) != nil {
		return out
	}
	fields := jsonFields(t)
	keys := slices.Sorted(maps.Keys(obj))
	for _, k := range keys {
		ft, ok := fields[k]
		switch {
		case !ok:
			out = append(out, fmt.Sprintf("unknown nvext key %q", path+"."+k))
		case ft.Kind() == reflect.Struct:
			out = unknownKeys(obj[k], ft, path+"."+k, out)
		}
	}
	return out
}

// jsonFields maps the JSON names of t's fields, those of embedded structs
// included, to their types (pointers followed).
func jsonFields(t reflect.Type) map[string]reflect.Type {
	out := map[string]reflect.Type{}
	for i := range t.NumField() {
		f := t.Field(i)
		if f.Anonymous {
			maps.Copy(out, jsonFields(f.Type))
			continue
		}
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name == "" || name == "-" {
			continue
		}
		ft := f.Type
		if ft.Kind() == reflect.Pointer {
			ft = ft.Elem()
		}
		out[name] = ft
	}
	return out
}
