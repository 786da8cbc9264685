package frontend

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/adapters/metrics"
)

const subsystem = "frontend"

// The pools a decision is made in, as metrics label them.
const (
	poolPrefill = "prefill"
	poolDecode  = "decode"
)

type frontendMetrics struct {
	requests     *prometheus.CounterVec
	inflight     *prometheus.GaugeVec
	ttft         *prometheus.HistogramVec
	itl          *prometheus.HistogramVec
	duration     *prometheus.HistogramVec
	inputTokens  *prometheus.HistogramVec
	outputTokens *prometheus.HistogramVec
	hitRate      *prometheus.HistogramVec
	routing      *prometheus.HistogramVec
	migrations   *prometheus.CounterVec
	speculative  *prometheus.CounterVec
	rejected     prometheus.Counter
	tokenized    *prometheus.CounterVec
	// refusedReads counts the reads answered 429 because as many of them
	// were being served as are allowed at once.
	refusedReads *prometheus.CounterVec
	dumpsRefused prometheus.Counter
}

func histogram(name, help string, buckets []float64, labels ...string) *prometheus.HistogramVec {
	return prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: metrics.Namespace, Subsystem: subsystem, Name: name, Help: help, Buckets: buckets,
	}, labels)
}

var latencyBuckets = []float64{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300}

func newFrontendMetrics() *frontendMetrics {
	latency := latencyBuckets
	tokens := prometheus.ExponentialBuckets(16, 2, 14) // 16 … 131072
	m := &frontendMetrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: subsystem, Name: "requests_total",
			Help: "OpenAI requests by model, endpoint and outcome (the HTTP status, or stream_error / cancelled).",
		}, []string{"model", "endpoint", "status"}),
		inflight: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: metrics.Namespace, Subsystem: subsystem, Name: "inflight_requests",
			Help: "OpenAI requests being served.",
		}, []string{"model"}),
		ttft:         histogram("time_to_first_token_seconds", "Time from the request's arrival to its first streamed chunk (or its whole answer).", latency, "model"),
		itl:          histogram("inter_token_latency_seconds", "Time between consecutive streamed chunks.", []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5}, "model"),
		duration:     histogram("request_duration_seconds", "Time from the request's arrival to the end of its answer.", latency, "model"),
		inputTokens:  histogram("input_sequence_tokens", "Prompt tokens of routed requests.", tokens, "model"),
		outputTokens: histogram("output_sequence_tokens", "Generated tokens (the engine's usage when reported, else streamed chunks).", tokens, "model"),
		hitRate:      histogram("kv_hit_rate", "Prompt blocks cached on the chosen worker over prompt blocks, per routed request.", prometheus.LinearBuckets(0, 0.1, 11), "model"),
		routing: histogram("routing_overhead_seconds", "The router's own time per decision, by phase and pool (prefill: the prefill half of a disaggregated request; decode: every other decision).",
			[]float64{0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1}, "phase", "pool"),
		migrations: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: subsystem, Name: "model_migration_total",
			Help: "Requests moved to another engine: new_request when the engine failed before answering, ongoing_request when its stream broke and was continued elsewhere.",
		}, []string{"model", "migration_type"}),
		speculative: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: subsystem, Name: "speculative_prefills_total",
			Help: "Next-turn prefixes prefilled after turns with agent_hints.speculative_prefill, by result: sent, skipped (engine busy or gone, or too many at once), failed.",
		}, []string{"result"}),
		tokenized: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: subsystem, Name: "tokenize_total",
			Help: "Text and chat prompts tokenized, by where: in_process (the model's own tokenizer) or engine (its /tokenize).",
		}, []string{"model", "where"}),
		rejected: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: subsystem, Name: "rejected_requests_total",
			Help: "Requests answered 503 because the router was serving its maximum of concurrent requests.",
		}),
		refusedReads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: metrics.Namespace, Subsystem: subsystem, Name: "refused_reads_total",
			Help: "Reads answered 429 because as many were being served as are allowed at once, by endpoint: dump_events (one at a time) or metrics (scrapes).",
		}, []string{"endpoint"}),
	}
	m.dumpsRefused = m.refusedReads.WithLabelValues("dump_events")
	return m
}

func (m *frontendMetrics) collectors() []prometheus.Collector {
	return []prometheus.Collector{m.requests, m.inflight, m.ttft, m.itl, m.duration, m.inputTokens, m.outputTokens, m.hitRate, m.routing, m.migrations, m.speculative, m.rejected, m.tokenized, m.refusedReads}
}
