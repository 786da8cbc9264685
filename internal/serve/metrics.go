package serve

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/adapters/metrics"
)

// sourceCollector exports each engine rank's event-stream health: what was
// received, what could not be used, and how gaps were closed.
type sourceCollector struct {
	s       *Server
	counter *prometheus.Desc
	up      *prometheus.Desc
	// unroutable alerts on one series, whatever the engines' names.
	unroutable *prometheus.Desc
	// unsupported is per engine, its ranks summed: the fields are the
	// engine's configuration, the same on every rank.
	unsupported *prometheus.Desc
}

func newSourceCollector(s *Server) *sourceCollector {
	return &sourceCollector{
		s: s,
		counter: prometheus.NewDesc(prometheus.BuildFQName(metrics.Namespace, "engine", "kv_event_stream_total"),
			"KV-event stream of an engine rank, by what happened: batches, replayed, malformed (payloads that did not decode), skipped (events), bad_frames, gaps, recovered (by replay), rebuilds (blocks dropped), resets (engine restarts), apply_errors, dumps (the rank's blocks reloaded from the engine's dump), dump_errors, history_lost (went on without the earlier events: the index is rebuilt from traffic), oversized (connections dropped for a message above --zmq-max-message-bytes), bad_handshakes (connections dropped for a malformed or stalled ZMTP handshake), replay_truncated (replays stopped at their bound), probes (replay requests sent after a silence, to find batches lost at the end of the stream or an unheard engine restart), joins (subscriptions that joined the engine's stream, each followed by a replay of what was published before it).",
			[]string{"worker_id", "dp_rank", "what"}, nil),
		up: prometheus.NewDesc(prometheus.BuildFQName(metrics.Namespace, "engine", "up"),
			"1 while the engine answers /health and takes part in routing.", []string{"worker_id", "name"}, nil),
		unroutable: prometheus.NewDesc(prometheus.BuildFQName(metrics.Namespace, "", "configured_workers_unroutable"),
			"Engines the router knows of (configured with --worker, or drained) that are not in routing: unreachable, failing /health, or drained. /health says why.", nil, nil),
		unsupported: prometheus.NewDesc(prometheus.BuildFQName(metrics.Namespace, "worker", "kv_events_unsupported_total"),
			"KV events (or blocks) of an engine whose field the router does not honour, by field (e.g. group_idx, medium=unknown): routing goes on without it. docs/engines.md says what each field means.",
			[]string{"worker_id", "field"}, nil),
	}
}

func (c *sourceCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.counter
	ch <- c.up
	ch <- c.unroutable
	ch <- c.unsupported
}

func (c *sourceCollector) Collect(ch chan<- prometheus.Metric) {
	c.s.mu.Lock()
	defer c.s.mu.Unlock()
	unroutable := 0
	for _, w := range c.s.workers {
		if !w.up {
			unroutable++
		}
		id := strconv.FormatUint(w.spec.ID, 10)
		up := 0.0
		if w.up {
			up = 1
		}
		ch <- prometheus.MustNewConstMetric(c.up, prometheus.GaugeValue, up, id, w.spec.Name)
		for rank, src := range w.sources {
			st := src.Stats()
			r := strconv.Itoa(rank)
			for _, kv := range []struct {
				what string
				v    uint64
			}{
				{"batches", st.Batches}, {"replayed", st.Replayed}, {"malformed", st.Malformed}, {"skipped", st.Skipped},
				{"bad_frames", st.BadFrames}, {"gaps", st.Gaps}, {"recovered", st.Recovered}, {"rebuilds", st.Rebuilds},
				{"resets", st.Resets}, {"apply_errors", st.ApplyErrors},
				{"dumps", st.Dumps}, {"dump_errors", st.DumpErrors}, {"history_lost", st.HistoryLost},
				{"oversized", st.Oversized},
				{"bad_handshakes", st.BadHandshakes}, {"replay_truncated", st.ReplayTruncated},
				{"probes", st.Probes}, {"joins", st.Joins}, {"other_group", st.OtherGroup},
			} {
				ch <- prometheus.MustNewConstMetric(c.counter, prometheus.CounterValue, float64(kv.v), id, r, kv.what)
			}
		}
		for field, n := range c.s.unsupportedLocked(w) {
			ch <- prometheus.MustNewConstMetric(c.unsupported, prometheus.CounterValue, float64(n), id, field)
		}
	}
	ch <- prometheus.MustNewConstMetric(c.unroutable, prometheus.GaugeValue, float64(unroutable))
}

// unsupportedLocked is an engine's KV-event fields the router does not
// honour, its ranks summed: counted by the router's own event sources, or
// by the engine's agent and carried in its load reports. s.mu is held.
func (s *Server) unsupportedLocked(w *supervised) map[string]uint64 {
	var out map[string]uint64
	add := func(fields map[string]uint64) {
		for field, n := range fields {
			if out == nil {
				out = map[string]uint64{}
			}
			out[field] += n
		}
	}
	for _, src := range w.sources {
		add(src.Stats().Unsupported)
	}
	if w.discovered && s.plane != nil && s.plane.sub != nil {
		add(s.plane.sub.Unsupported(w.spec.ID))
	}
	return out
}
