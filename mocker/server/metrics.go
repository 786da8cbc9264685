package server

import (
	"github.com/prometheus/client_golang/prometheus"
)

// The names of the pacing counters (Timing's Model and Actual, per engine).
const (
	StepModelSecondsMetric = "kvrouter_mocker_step_model_seconds_total"
	StepWallSecondsMetric  = "kvrouter_mocker_step_wall_seconds_total"
)

// serverMetrics are the metrics of one engine under vLLM's names, so that
// dashboards and routers built for vLLM read the simulator unchanged.
// Latencies are in simulated seconds (wall time × speedup): what a real
// engine at the model's speed would report.
type serverMetrics struct {
	prompt, generation, success, aborted prometheus.Counter
	ttft, e2e, tpot                      prometheus.Histogram

	// A decode engine's KV pulls. vLLM names the bytes, the transfer time
	// and the failures (its NixlConnector's metrics); the pulls and blocks
	// are ours: a router's benchmark reads them as the transferred blocks.
	pulls, blocksPulled, pullFailures prometheus.Counter
	bytesTransferred, xferTime        prometheus.Histogram
}

func newServerMetrics(s *Server) serverMetrics {
	labels := prometheus.Labels{"model_name": s.cfg.Model, "engine": s.cfg.Name}
	counter := func(name, help string) prometheus.Counter {
		c := prometheus.NewCounter(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: labels})
		s.reg.MustRegister(c)
		return c
	}
	histogram := func(name, help string, buckets []float64) prometheus.Histogram {
		h := prometheus.NewHistogram(prometheus.HistogramOpts{Name: name, Help: help, ConstLabels: labels, Buckets: buckets})
		s.reg.MustRegister(h)
		return h
	}
	gauge := func(name, help string, read func() float64) {
		s.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: name, Help: help, ConstLabels: labels}, read))
	}
	counterFunc := func(name, help string, read func() float64) {
		s.reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: labels}, read))
	}
	sum := func(f func(r *Runner) float64) func() float64 {
		return func() float64 {
			total := 0.0
			for _, r := range s.ranks {
				total += f(r)
			}
			return total
		}
	}
	gauge("vllm:num_requests_running", "Requests in the running batch.", sum(func(r *Runner) float64 { return float64(r.Metrics().Running) }))
	gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", sum(func(r *Runner) float64 { return float64(r.Metrics().Waiting) }))
	gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", func() float64 {
		return sum(func(r *Runner) float64 { return r.Metrics().KVUsage })() / float64(len(s.ranks))
	})
	gauge("kvrouter_mocker_open_sessions", "Engine sessions open (SGLang's /open_session).", func() float64 { return float64(s.sessions.count()) })
	counterFunc("kvrouter_mocker_sessions_opened_total", "Engine sessions opened (SGLang's /open_session).", func() float64 { return float64(s.sessions.opened()) })
	counterFunc("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", sum(func(r *Runner) float64 { return float64(r.Metrics().PrefixQueries) }))
	counterFunc("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", sum(func(r *Runner) float64 { return float64(r.Metrics().PrefixHits) }))
	counterFunc("kvrouter_mocker_prefix_cache_loaded_queries", "The part of vllm:prefix_cache_queries due to requests whose KV a decode engine pulled.", sum(func(r *Runner) float64 { return float64(r.Metrics().LoadedQueries) }))
	counterFunc("kvrouter_mocker_prefix_cache_loaded_hits", "The part of vllm:prefix_cache_hits due to requests whose KV a decode engine pulled: they spared a transfer, not a prefill.", sum(func(r *Runner) float64 { return float64(r.Metrics().LoadedHits) }))
	counterFunc("vllm:num_preemptions_total", "Requests preempted for lack of KV blocks.", sum(func(r *Runner) float64 { return float64(r.Metrics().Preemptions) }))
	// The pacing pair: a process watching engines it did not start (a
	// benchmark with the engines in a child process) tells from them
	// whether the simulation kept the model's pace (see Timing).
	counterFunc(StepModelSecondsMetric, "Model time of the steps run, divided by the speedup: the wall time they should have taken.", sum(func(r *Runner) float64 { return r.Timing().Model.Seconds() }))
	counterFunc(StepWallSecondsMetric, "Wall time the steps took; above "+StepModelSecondsMetric+" the simulation ran behind the model's pace.", sum(func(r *Runner) float64 { return r.Timing().Actual.Seconds() }))

	gauge("kvrouter_mocker_kv_transfer_held_blocks", "KV blocks a prefill engine holds for decode engines to pull.", sum(func(r *Runner) float64 { return float64(r.Metrics().HeldBlocks) }))
	counterFunc("vllm:nixl_num_kv_expired_reqs_total", "Requests whose held KV blocks no decode engine pulled within --kv-transfer-timeout.", sum(func(r *Runner) float64 { return float64(r.HoldsExpired()) }))

	latency := []float64{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160, 640, 2560}
	return serverMetrics{
		prompt:     counter("vllm:prompt_tokens_total", "Prompt tokens received."),
		generation: counter("vllm:generation_tokens_total", "Tokens generated."),
		success:    counter("vllm:request_success_total", "Requests that finished."),
		aborted:    counter("vllm:request_aborted_total", "Requests whose client went away."),
		ttft:       histogram("vllm:time_to_first_token_seconds", "Time to first token (simulated seconds).", latency),
		e2e:        histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency (simulated seconds).", latency),
		tpot:       histogram("vllm:time_per_output_token_seconds", "Time per output token after the first (simulated seconds).", []float64{0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5}),

		pulls:        counter("kvrouter_mocker_kv_transfer_pulls_total", "Requests whose prompt KV a decode engine pulled from a prefill engine (a pull of no block only releases the prefill's hold)."),
		blocksPulled: counter("kvrouter_mocker_kv_transfer_blocks_pulled_total", "KV blocks pulled from prefill engines."),
		pullFailures: counter("vllm:nixl_num_failed_transfers_total", "KV pulls that failed; the request was prefilled locally instead."),
		bytesTransferred: histogram("vllm:nixl_bytes_transferred", "Bytes of one KV pull (_sum: bytes pulled in all).",
			prometheus.ExponentialBuckets(1<<20, 4, 10)),
		xferTime: histogram("vllm:nixl_xfer_time_seconds", "Simulated time of one KV pull.", latency),
	}
}
