package metrics

import (
	"context"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
)

func TestCollectorExportsRouterCounters(t *testing.T) {
	cfg := router.DefaultConfig()
	cfg.MaxIndexedPairs = 8
	cfg.EventThreads = 1
	r, err := router.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	r.AddWorker(router.WorkerInfo{ID: 3, TotalKVBlocks: 100})
	r.AddWorker(router.WorkerInfo{ID: 4, Role: router.RolePrefill})
	for i := range 12 {
		ev := kv.StoredEvent(kv.Worker{ID: 3}, 0, nil, kv.Block{EngineHash: uint64(i), LocalHash: uint64(i)})
		_ = r.ApplyEvent(&ev)
	}
	bad := kv.StoredEvent(kv.Worker{ID: 3}, 0, kv.Ptr(999), kv.Block{EngineHash: 1, LocalHash: 1})
	_ = r.ApplyEvent(&bad)
	stranger := kv.ClearedEvent(kv.Worker{ID: 42}, 0)
	_ = r.ApplyEvent(&stranger)
	if _, err := r.BestWorker(context.Background(), &router.Request{ID: "a", Tokens: make([]uint32, 64)}); err != nil {
		t.Fatal(err)
	}

	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(NewCollector(r))
	want := `
# HELP kvrouter_kv_events_rejected_total KV events refused whole, by reason.
# TYPE kvrouter_kv_events_rejected_total counter
kvrouter_kv_events_rejected_total{reason="dp_rank_out_of_range"} 0
kvrouter_kv_events_rejected_total{reason="empty_stored"} 0
kvrouter_kv_events_rejected_total{reason="unknown_kind"} 0
kvrouter_kv_events_rejected_total{reason="unknown_parent"} 1
kvrouter_kv_events_rejected_total{reason="unknown_worker"} 1
# HELP kvrouter_index_lookup_waits_total Lookups of an index shard that found it taken by a KV-event writer and waited: how often routing decisions queue behind event application.
# TYPE kvrouter_index_lookup_waits_total counter
kvrouter_index_lookup_waits_total 0
# HELP kvrouter_worker_active_requests Booked requests on a worker rank.
# TYPE kvrouter_worker_active_requests gauge
kvrouter_worker_active_requests{dp_rank="0",worker_id="3"} 1
kvrouter_worker_active_requests{dp_rank="0",worker_id="4"} 0
# HELP kvrouter_worker_role 1 for each worker, labelled with its role (prefill, decode or both): join the per-worker gauges on worker_id to see each pool's load.
# TYPE kvrouter_worker_role gauge
kvrouter_worker_role{role="both",worker_id="3"} 1
kvrouter_worker_role{role="prefill",worker_id="4"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "kvrouter_kv_events_rejected_total", "kvrouter_index_lookup_waits_total", "kvrouter_worker_active_requests", "kvrouter_worker_role"); err != nil {
		t.Fatal(err)
	}
	evicted := testutil.ToFloat64(prometheus.CollectorFunc(func(ch chan<- prometheus.Metric) {
		c := NewCollector(r)
		all := make(chan prometheus.Metric, 64)
		c.Collect(all)
		close(all)
		for m := range all {
			if strings.Contains(m.Desc().String(), "index_evicted_pairs_total") {
				ch <- m
			}
		}
	}))
	if evicted == 0 {
		t.Fatal("the memory cap evicted nothing, or the metric does not say so")
	}
	if n, err := testutil.GatherAndCount(reg); err != nil || n < 20 {
		t.Fatalf("gathered %d series, err %v", n, err)
	}
}
