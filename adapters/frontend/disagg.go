package frontend

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"maps"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/adapters/metrics"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/core/sched"
)

// Disagg configures disaggregated serving. It applies to a model only while
// the router has both prefill and decode-capable workers for it: with no
// prefill worker the model is served aggregated, as before.
//
// A disaggregated request follows vLLM's P/D protocol (its NixlConnector
// proxy, which the Mooncake and LMCache connectors share):
//
//  1. the prefill worker, chosen by the router among the prefill pool by
//     cached prefix and prompt load, gets the client's request non-streamed,
//     with max_tokens (and max_completion_tokens, when given) 1, without
//     stream_options, and kv_transfer_params {"do_remote_decode": true,
//     "do_remote_prefill": false, "remote_engine_id": null,
//     "remote_block_ids": null, "remote_host": null, "remote_port": null};
//  2. its answer's kv_transfer_params, unchanged, go with the client's own
//     request to the decode worker the router then chooses, streamed or not
//     as the client asked; the client gets the decode worker's answer.
//
// A prefill that fails (an error status, no answer within PrefillTimeout,
// an unreachable engine, an answer without kv_transfer_params), or that no
// prefill worker can take (none left, every one busy), is done by the
// decode worker itself: the client never sees it.
type Disagg struct {
	// MinUncachedTokens is conditional disaggregation: a request whose
	// prompt the decode worker it would go to lacks fewer than this many
	// tokens of is prefilled there, sparing a transfer that would cost
	// more than the prefill it moves. 0 always disaggregates.
	MinUncachedTokens int
	// MaxUncachedRatio, when in (0, 1), also requires the uncached share
	// of the prompt to be below it for a local prefill (Dynamo's
	// --router-conditional-disagg-eff-isl-ratio-threshold); 0 or 1 does
	// not.
	MaxUncachedRatio float64
	// Enforce fails a request (503) that no prefill worker could take
	// (none, every one busy, a failed or timed-out prefill) instead of
	// prefilling it on the decode worker (Dynamo's --enforce-disagg).
	// Conditional disaggregation's local prefills still happen.
	Enforce bool
	// NoAssumeKVReuse routes decode as Dynamo does: with no cache credit
	// and every prompt block counted as new on the decode worker. By
	// default the blocks a decode worker already holds count for it, as
	// they need not cross the network.
	NoAssumeKVReuse bool
	// PrefillTimeout bounds the prefill request, routing included; 0 means
	// DefaultPrefillTimeout.
	PrefillTimeout time.Duration
	// Policy is when the decode worker prefills itself (Dynamo's
	// conditional disaggregation policies): PolicyISLBounding (the
	// default) when it lacks little of the prompt (MinUncachedTokens,
	// MaxUncachedRatio); PolicyPrefillLoad when the prefill worker the
	// router would pick is busy by PrefillBusyThreshold; PolicyISLOrLoad
	// when either holds.
	Policy string
	// PrefillBusyThreshold is the prefill load policies' threshold: a
	// prefill worker whose prompt backlog exceeds it × its max batched
	// tokens is busy (one whose budget is unknown never is).
	PrefillBusyThreshold float64
	// DecodeBusyThreshold, when set, lets the decode worker prefill
	// itself only if its KV blocks with the request stay within it × its
	// capacity: a full decode worker is not given prompt work too, and one
	// of unknown capacity never is.
	DecodeBusyThreshold *float64
}

// Conditional disaggregation policies, by Dynamo's names.
const (
	PolicyISLBounding = "isl_bounding"
	PolicyPrefillLoad = "prefill_load"
	PolicyISLOrLoad   = "isl_or_load"
)

// DefaultPrefillTimeout is Disagg.PrefillTimeout's default: a long prompt
// behind a full queue still prefills within it, and a request whose prefill
// engine hangs has not yet lost its client.
const DefaultPrefillTimeout = 60 * time.Second

// Why a request was not disaggregated: the causes the metrics count.
const (
	localShortUncached  = "short_uncached"
	localPrefillLoad    = "prefill_load"
	localPrefillBusy    = "prefill_busy"
	localNoPrefill      = "no_prefill_worker"
	localPrefillError   = "prefill_error"
	localPrefillTimeout = "prefill_timeout"
	localUnreachable    = "prefill_unreachable"
	localNoParams       = "no_transfer_params"
)

// prefillResult is what a remote prefill left for the decode half.
type prefillResult struct {
	decision router.Decision
	elapsed  time.Duration
	params   json.RawMessage // the prefill answer's kv_transfer_params
}

type disaggMetrics struct {
	decisions   *prometheus.CounterVec
	prefillTime *prometheus.HistogramVec
	transferred *prometheus.CounterVec
	// clientParams counts the kv_transfer_params clients sent, which no
	// engine gets.
	clientParams prometheus.Counter
}

func newDisaggMetrics(latency []float64) *disaggMetrics {
	return &disaggMetrics{
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: subsystem, Name: "prefill_decisions_total",
			Help: "Requests of disaggregated models by where their prompt was prefilled: remote (a prefill worker) or local (the decode worker), with why.",
		}, []string{"model", "prefill", "reason"}),
		prefillTime: histogram("prefill_duration_seconds", "Time a prefill worker took to answer a disaggregated request's prefill, routing included.",
			latency, "model"),
		transferred: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: subsystem, Name: "kv_transfer_blocks_total",
			Help: "Prompt blocks of disaggregated requests by whether their decode worker already held them (cached) or had to pull them from the prefill worker (transferred), as the router's index saw it.",
		}, []string{"model", "kind"}),
		clientParams: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: subsystem, Name: "client_kv_transfer_params_stripped_total",
			Help: "Requests whose client sent kv_transfer_params, removed before any engine saw them: only the router sets them.",
		}),
	}
}

func (m *disaggMetrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.decisions, m.prefillTime, m.transferred, m.clientParams}
}

// disaggregated reports whether req's model is served disaggregated now.
func (c *call) disaggregated() bool {
	p, d := c.f.cfg.Router.Pools(c.model)
	return p > 0 && d > 0
}

// prefillRemotely runs the prefill half of a disaggregated request on a
// prefill worker and returns what the decode half needs, or nil when the
// decode worker should prefill itself (the reason is counted).
func (c *call) prefillRemotely(req *router.Request) *prefillResult {
	f := c.f
	preq := router.Request{
		ID: req.ID + "-prefill", Tokens: req.Tokens, LoRA: req.LoRA, CacheSalt: req.CacheSalt, MM: req.MM, Model: req.Model,
		Priority: req.Priority, Overrides: req.Overrides, Target: c.prefillTarget,
		OverrideBusy: req.OverrideBusy, Prefill: true,
	}
	if reason := c.localByPolicy(req, &preq); reason != "" {
		c.local(reason)
		return nil
	}
	timeout := f.cfg.Disagg.PrefillTimeout
	if timeout <= 0 {
		timeout = DefaultPrefillTimeout
	}
	// A prefill's answer is its headers: a hung prefill engine costs no
	// more than a hung decode engine would.
	if f.cfg.HeaderTimeout > 0 {
		timeout = min(timeout, f.cfg.HeaderTimeout)
	}
	ctx, cancel := context.WithTimeout(c.ctx, timeout)
	defer cancel()
	start := time.Now()
	d, err := f.cfg.Router.BestWorker(ctx, f.withoutEjected(&preq))
	switch {
	case err == nil:
	case errors.Is(err, sched.ErrAllBusy):
		c.local(localPrefillBusy)
		return nil
	case errors.Is(err, router.ErrNoWorkers):
		c.local(localNoPrefill)
		return nil
	case ctx.Err() != nil && c.ctx.Err() == nil:
		c.local(localPrefillTimeout)
		return nil
	default:
		c.local(localPrefillError)
		return nil
	}
	defer f.cfg.Router.Free(preq.ID)
	f.observeDecision(c.label, poolPrefill, &d, true)
	wk, ok := findWorker(f.cfg.Workers(), d.Worker.ID)
	if !ok {
		c.local(localUnreachable)
		return nil
	}
	params, reason, blame := c.postPrefill(ctx, wk, preq.ID)
	if params == nil {
		if reason == localPrefillError && ctx.Err() != nil && c.ctx.Err() == nil {
			reason = localPrefillTimeout
		}
		if blame && c.ctx.Err() == nil {
			f.engineFailed(wk, prefillFailure[reason], errors.New(reason))
		}
		c.local(reason)
		return nil
	}
	f.engineServed(wk)
	elapsed := time.Since(start)
	f.dm.prefillTime.WithLabelValues(c.label).Observe(elapsed.Seconds())
	f.dm.decisions.WithLabelValues(c.label, "remote", "disaggregated").Inc()
	return &prefillResult{decision: d, elapsed: elapsed, params: params}
}

// prefillFailure is how outlier detection counts each way a prefill
// engine fails.
var prefillFailure = map[string]string{
	localPrefillError:   failStatus,
	localPrefillTimeout: failTimeout,
	localUnreachable:    failRefused,
	localNoParams:       failMalformed,
}

func (c *call) local(reason string) {
	c.localReason = reason
	c.f.dm.decisions.WithLabelValues(c.label, "local", reason).Inc()
}

// localByPolicy is conditional disaggregation: why the decode worker is to
// prefill req itself by the policy, or "". Every question is a preview:
// nothing is booked.
func (c *call) localByPolicy(req, preq *router.Request) string {
	d := c.f.cfg.Disagg
	rt := c.f.cfg.Router
	var decode *router.Preview
	reason := ""
	if d.Policy != PolicyPrefillLoad && d.MinUncachedTokens > 0 {
		if pv, err := rt.Preview(c.ctx, *req, d.DecodeBusyThreshold != nil); err == nil {
			decode = &pv
			if pv.Uncached < d.MinUncachedTokens && (d.MaxUncachedRatio <= 0 || d.MaxUncachedRatio >= 1 || len(req.Tokens) == 0 || float64(pv.Uncached)/float64(len(req.Tokens)) < d.MaxUncachedRatio) {
				reason = localShortUncached
			}
		}
	}
	if reason == "" && (d.Policy == PolicyPrefillLoad || d.Policy == PolicyISLOrLoad) {
		pv, err := rt.Preview(c.ctx, *c.f.withoutEjected(preq), true)
		if errors.Is(err, sched.ErrAllBusy) || (err == nil && pv.PrefillBusy(d.PrefillBusyThreshold)) {
			reason = localPrefillLoad
		}
	}
	if reason == "" || d.DecodeBusyThreshold == nil {
		return reason
	}
	if decode == nil {
		pv, err := rt.Preview(c.ctx, *req, true)
		if err != nil {
			return ""
		}
		decode = &pv
	}
	if busy, known := decode.DecodeBusy(*d.DecodeBusyThreshold); busy || !known {
		return ""
	}
	return reason
}

// refusedUndisaggregated is the answer, under Disagg.Enforce, to a
// request no prefill worker took.
func (c *call) refusedUndisaggregated() *httpError {
	return newError(http.StatusServiceUnavailable, "server_error", "prefill_unavailable", "",
		"no prefill worker could take the request (%s) and disaggregation is enforced", c.localReason)
}

// postPrefill sends the prefill request to wk and returns its answer's
// kv_transfer_params, or nil, why not, and whether the engine is to blame
// (an error status of 400s is the request's own).
func (c *call) postPrefill(ctx context.Context, wk Worker, id string) (params json.RawMessage, reason string, blame bool) {
	body, err := prefillBody(c.top)
	if err != nil {
		return nil, localPrefillError, false
	}
	ereq, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimRight(wk.BaseURL, "/")+c.ep.path, strings.NewReader(string(body)))
	if err != nil {
		return nil, localPrefillError, false
	}
	ereq.Header.Set("Content-Type", "application/json")
	ereq.Header.Set("X-Request-Id", id)
	if c.sent.IsZero() {
		c.sent = time.Now()
	}
	resp, err := c.f.cfg.Client.Do(ereq)
	if err != nil {
		if connectFailure(err) {
			if c.f.cfg.EngineRefused != nil {
				c.f.cfg.EngineRefused(wk.ID)
			}
			c.f.log.Warn("prefill engine unreachable; prefilling on the decode engine", "worker", wk.Name, "request", id, "err", err)
			return nil, localUnreachable, true
		}
		return nil, localPrefillError, true
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, maxEngineError))
	if err != nil || resp.StatusCode != http.StatusOK {
		c.f.log.Warn("prefill failed; prefilling on the decode engine", "worker", wk.Name, "request", id, "status", resp.StatusCode, "err", err, "engine", engineMessage(data))
		return nil, localPrefillError, err != nil || resp.StatusCode >= 500
	}
	var answer struct {
		Params json.RawMessage `json:"kv_transfer_params"`
	}
	if json.Unmarshal(data, &answer) != nil || !isObject(answer.Params) {
		c.f.log.Warn("prefill answer without kv_transfer_params; prefilling on the decode engine", "worker", wk.Name, "request", id)
		return nil, localNoParams, true
	}
	return answer.Params, "", false
}

// prefillRequestParams are the kv_transfer_params of vLLM's P/D proxy's
// prefill request: "prefill, keep the KV for a remote decode".
var prefillRequestParams = json.RawMessage(`{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`)

// prefillBody is the client's request as the prefill worker gets it.
func prefillBody(top map[string]json.RawMessage) ([]byte, error) {
	out := maps.Clone(top)
	delete(out, "nvext")
	delete(out, "router_config_override")
	delete(out, "stream_options")
	delete(out, "data_parallel_rank")
	out["stream"] = json.RawMessage("false")
	out["max_tokens"] = json.RawMessage("1")
	if present(out["max_completion_tokens"]) {
		out["max_completion_tokens"] = json.RawMessage("1")
	}
	out["kv_transfer_params"] = prefillRequestParams
	return json.Marshal(out)
}

// decodeBody is the client's request as the decode worker gets it after a
// remote prefill: its own members less nvext, the prefill's transfer
// parameters, and the routed data-parallel rank.
func decodeBody(top map[string]json.RawMessage, wk Worker, rank uint32, params json.RawMessage) (pieces, error) {
	out := maps.Clone(top)
	delete(out, "nvext")
	delete(out, "router_config_override")
	if wk.DPSize > 1 {
		out["data_parallel_rank"] = json.RawMessage(strconv.FormatUint(uint64(rank), 10))
	}
	out["kv_transfer_params"] = params
	b, err := json.Marshal(out)
	return pieces{b}, err
}

// kvTransferKey is the member through which vLLM's KV connectors are told
// to hold a prompt's blocks for another engine or to pull them from one, by
// host, port and engine id, and through which an engine answers where it
// holds them. Only the router may set it: a client's would make an engine
// dial an address the client chose, or pin KV blocks and hand the client
// the engine's internal address. A client's is removed on every path, and
// an engine's never reaches the client.
const kvTransferKey = "kv_transfer_params"

var kvTransferQuoted = []byte(`"` + kvTransferKey + `"`)

// withoutKVTransfer returns the JSON object obj less its top-level
// kv_transfer_params, its other members' bytes as they were; obj itself
// when it has none (or is not an object).
func withoutKVTransfer(obj []byte) []byte {
	if !bytes.Contains(obj, kvTransferQuoted) {
		return obj
	}
	ms, err := objectMembers(obj)
	if err != nil || !slices.ContainsFunc(ms, func(m member) bool { return m.key == kvTransferKey }) {
		return obj
	}
	return bytes.Join(without(obj, ms, []string{kvTransferKey}), nil)
}

// countTransfer records how much of the prompt the decode worker held.
func (c *call) countTransfer(d *router.Decision) {
	held := min(d.OverlapBlocks, d.PromptBlocks)
	c.f.dm.transferred.WithLabelValues(c.label, "cached").Add(float64(held))
	c.f.dm.transferred.WithLabelValues(c.label, "transferred").Add(float64(d.PromptBlocks - held))
}
