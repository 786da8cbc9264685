package frontend

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/adapters/metrics"
	"github.com/kvrouter/kvrouter/core/outlier"
	"github.com/kvrouter/kvrouter/core/router"
)

// DefaultHeaderTimeout is Config.HeaderTimeout's default. An engine sends
// a stream's headers once it has read and tokenized the request, before
// it schedules it (vLLM and SGLang alike), so a healthy engine answers in
// milliseconds even under a full queue; 30 s leaves room for tokenizing a
// prompt of the largest body the frontend takes (16 MiB) on a busy CPU,
// while a client still waits for the retry.
const DefaultHeaderTimeout = 30 * time.Second

// DefaultResponseTimeout is Config.ResponseTimeout's default. An engine
// sends a non-streamed answer's headers with the whole answer, after the
// last token, so the bound has to outlast the longest generation; 10
// minutes is the OpenAI client's own default timeout: a client that kept
// it has given up by then anyway.
const DefaultResponseTimeout = 10 * time.Minute

// errHeaderTimeout: the engine did not send its response headers in time.
var errHeaderTimeout = errors.New("no response headers in time")

// engineStatus is an error status an engine answered before sending
// anything else: kept to be relayed if no other engine does better.
type engineStatus struct {
	code   int
	header map[string][]string
	body   []byte
}

func (e *engineStatus) Error() string {
	return fmt.Sprintf("answered %d: %s", e.code, engineMessage(e.body))
}

// errMalformedStart: the engine's stream was broken before its first event
// reached the client.
var errMalformedStart = errors.New("malformed stream")

// The reasons an engine failed a request, as /health shows its ejection.
const (
	failTimeout   = "timeout"
	failReset     = "reset"
	failRefused   = "refused"
	failStatus    = "error status"
	failMalformed = "malformed stream"
	failCut       = "stream broken off"
)

// failureReason classifies an attempt's error for outlier detection.
func failureReason(err error) string {
	var st *engineStatus
	switch {
	case errors.Is(err, errHeaderTimeout), errors.Is(err, context.DeadlineExceeded):
		return failTimeout
	case errors.As(err, &st):
		return failStatus
	case errors.Is(err, errMalformedStart), errors.Is(err, errMalformed):
		return failMalformed
	case connectFailure(err):
		return failRefused
	}
	return failReset
}

// headerBound is how long the engine gets to send response headers: a
// stream's come at once, a non-streamed answer's with its last token.
func (f *Frontend) headerBound(streamed bool) time.Duration {
	d := f.cfg.HeaderTimeout
	if !streamed {
		d = f.cfg.ResponseTimeout
	}
	return max(d, 0)
}

// withHeaderBound returns ctx ended with errHeaderTimeout after d (none
// for 0), and a function to call once the headers are in: it reports
// whether they came in time.
func withHeaderBound(ctx context.Context, d time.Duration) (context.Context, func() bool, context.CancelFunc) {
	if d <= 0 {
		return ctx, func() bool { return true }, func() {}
	}
	ctx, cancel := context.WithCancelCause(ctx)
	timer := time.AfterFunc(d, func() { cancel(errHeaderTimeout) })
	arrived := func() bool {
		return timer.Stop() || !errors.Is(context.Cause(ctx), errHeaderTimeout)
	}
	return ctx, arrived, func() {
		timer.Stop()
		cancel(nil)
	}
}

type outlierMetrics struct {
	ejections *prometheus.CounterVec
	ejected   prometheus.GaugeFunc
}

func newOutlierMetrics(d *outlier.Detector) *outlierMetrics {
	return &outlierMetrics{
		ejections: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Name: "worker_ejections_total",
			Help: "Engines taken out of routing for failing requests in a row (outlier detection), by engine.",
		}, []string{"worker_id"}),
		ejected: prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Namespace: metrics.Namespace, Name: "workers_ejected",
			Help: "Engines out of routing now for failing requests (outlier detection).",
		}, func() float64 { return float64(len(d.Ejected(time.Now(), nil))) }),
	}
}

func (m *outlierMetrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.ejections, m.ejected}
}

// withoutEjected returns req with the ejected engines excluded; a request
// pinned to an engine goes there regardless.
func (f *Frontend) withoutEjected(req *router.Request) *router.Request {
	if req.Target != nil {
		return req
	}
	ejected := f.outliers.Ejected(time.Now(), nil)
	if len(ejected) == 0 {
		return req
	}
	q := *req
	q.Exclude = append(append([]uint64(nil), req.Exclude...), ejected...)
	return &q
}

// engineFailed counts a failure of wk against it, ejecting it when it
// keeps failing.
func (f *Frontend) engineFailed(wk Worker, reason string, err error) {
	pool := f.ejectionPool(wk.ID)
	e, ok := f.outliers.Failure(wk.ID, reason, pool, time.Now())
	if !ok {
		return
	}
	f.om.ejections.WithLabelValues(strconv.FormatUint(wk.ID, 10)).Inc()
	f.log.Warn("engine ejected from routing: it keeps failing requests", "worker", wk.Name, "reason", reason, "err", err,
		"for", e.Until.Sub(e.Since).String(), "ejections", e.Count)
}

// engineServed resets wk's failures.
func (f *Frontend) engineServed(wk Worker) { f.outliers.Success(wk.ID, time.Now()) }

// ejectionPool lists the engines that could take the requests of engine
// id: for a decode-capable engine the model's other decode-capable ones;
// for a prefill engine every engine of its model, as the decode engines
// prefill themselves when no prefill engine is left.
func (f *Frontend) ejectionPool(id uint64) []uint64 {
	infos := f.cfg.Router.Workers()
	var self *router.WorkerInfo
	for i := range infos {
		if infos[i].ID == id {
			self = &infos[i]
		}
	}
	if self == nil {
		return []uint64{id}
	}
	var pool []uint64
	for _, in := range infos {
		if self.Model != "" && in.Model != "" && in.Model != self.Model {
			continue
		}
		if self.Role != router.RolePrefill && in.Role == router.RolePrefill {
			continue
		}
		pool = append(pool, in.ID)
	}
	return pool
}

// ejectionHealth is an ejected engine's entry in /health.
type ejectionHealth struct {
	Reason     string    `json:"reason"`
	Since      time.Time `json:"since"`
	Until      time.Time `json:"until"`
	Ejections  int       `json:"ejections"`
	RemainingS float64   `json:"remaining_s"`
}

// ejectionsHealth maps each ejected engine to its /health entry.
func (f *Frontend) ejectionsHealth() map[uint64]*ejectionHealth {
	now := time.Now()
	out := map[uint64]*ejectionHealth{}
	for _, e := range f.outliers.Ejections(now) {
		out[e.Worker] = &ejectionHealth{Reason: e.Reason, Since: e.Since, Until: e.Until, Ejections: e.Count, RemainingS: e.Until.Sub(now).Seconds()}
	}
	return out
}
