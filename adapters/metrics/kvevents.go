package metrics

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
)

// KVEventsCollector exports, per worker rank, whether the router routes it
// by predicted blocks because its KV events never came (router.Eventless).
// Every rank whose events the router awaits or receives has a series, so
// that the gauge falls back to 0 when the events arrive instead of
// vanishing.
type KVEventsCollector struct {
	r       *router.Router
	missing *prometheus.Desc
}

// NewKVEventsCollector returns the collector for r.
func NewKVEventsCollector(r *router.Router) *KVEventsCollector {
	return &KVEventsCollector{r: r, missing: prometheus.NewDesc(prometheus.BuildFQName(Namespace, "", "worker_kv_events_missing"),
		"1 while a worker rank serves requests but has sent no KV event within --router-kv-events-grace-secs: it is routed by predicted caches (is vLLM started with --kv-events-config?).",
		[]string{"worker_id", "dp_rank"}, nil)}
}

// Describe implements prometheus.Collector.
func (c *KVEventsCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.missing }

// Collect implements prometheus.Collector.
func (c *KVEventsCollector) Collect(ch chan<- prometheus.Metric) {
	for _, in := range c.r.Workers() {
		for rank := range max(in.DPSize, 1) {
			v := 0.0
			switch c.r.KVEvents(kv.Worker{ID: in.ID, DPRank: uint32(rank)}) {
			case router.EventsNotFollowed:
				continue
			case router.EventsMissing:
				v = 1
			}
			ch <- prometheus.MustNewConstMetric(c.missing, prometheus.GaugeValue, v, strconv.FormatUint(in.ID, 10), strconv.Itoa(rank))
		}
	}
}
