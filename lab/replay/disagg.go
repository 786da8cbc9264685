package replay

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	dto "github.com/prometheus/client_model/go"

	"github.com/kvrouter/kvrouter/lab/bench"
	"github.com/kvrouter/kvrouter/mocker/fleet"
	"github.com/kvrouter/kvrouter/mocker/server"
)

// Setup is one run of a replay: a routing mode on a fleet layout. It is
// written MODE[@PpDd][+uncached=N][+no-reuse]:
//
//	kv                      kv on Config's layout (aggregated unless Config.Prefill/Decode say otherwise)
//	kv@4p4d                 4 prefill and 4 decode engines, served disaggregated
//	kv@8                    8 aggregated engines
//	kv@4p4d+uncached=512    conditional disaggregation: --disagg-min-uncached-tokens 512
//	kv@4p4d+no-reuse        decode routed as Dynamo does (--no-router-assume-kv-reuse)
//
// so that one replay compares layouts and policies on the same workload.
type Setup struct {
	Mode            string // a mode of --modes
	Workers         int    // aggregated engines, when Prefill is 0
	Prefill, Decode int
	// MinUncached is --disagg-min-uncached-tokens; -1 keeps Config's.
	MinUncached int
	NoReuse     bool
	// Replicas, when above 0, serves the setup with that many router
	// replicas on a NATS plane with replica sync (+replicas=N), requests
	// spread over them round-robin; 0 is one frontend given the engines.
	Replicas int
}

// Disaggregated reports whether the setup splits prefill and decode.
func (s Setup) Disaggregated() bool { return s.Prefill > 0 }

// Engines is the setup's fleet size.
func (s Setup) Engines() int {
	if s.Disaggregated() {
		return s.Prefill + s.Decode
	}
	return s.Workers
}

// ParseSetup reads a setup; a name without a layout takes workers
// aggregated engines, or prefill + decode when both are set.
func ParseSetup(name string, workers, prefill, decode int) (Setup, error) {
	parts := strings.Split(strings.TrimSpace(name), "+")
	head, layout, hasLayout := strings.Cut(parts[0], "@")
	s := Setup{Mode: head, Workers: workers, Prefill: prefill, Decode: decode, MinUncached: -1}
	if _, err := ParseMode(head); err != nil {
		return Setup{}, err
	}
	if hasLayout {
		s.Prefill, s.Decode = 0, 0
		if p, d, ok := strings.Cut(strings.TrimSuffix(layout, "d"), "p"); ok && strings.HasSuffix(layout, "d") {
			var err1, err2 error
			s.Prefill, err1 = strconv.Atoi(p)
			s.Decode, err2 = strconv.Atoi(d)
			if err1 != nil || err2 != nil || s.Prefill < 1 || s.Decode < 1 {
				return Setup{}, fmt.Errorf("setup %q: layout %q: want PpDd with P and D ≥ 1, e.g. 4p4d", name, layout)
			}
		} else {
			n, err := strconv.Atoi(layout)
			if err != nil || n < 1 {
				return Setup{}, fmt.Errorf("setup %q: layout %q: want a number of engines or PpDd, e.g. 8 or 4p4d", name, layout)
			}
			s.Workers = n
		}
	}
	for _, opt := range parts[1:] {
		switch k, v, _ := strings.Cut(opt, "="); k {
		case "uncached":
			n, err := strconv.Atoi(v)
			if err != nil || n < 0 {
				return Setup{}, fmt.Errorf("setup %q: uncached=%q: want a number of tokens ≥ 0", name, v)
			}
			s.MinUncached = n
		case "no-reuse":
			s.NoReuse = true
		case "replicas":
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 || n > maxReplicas {
				return Setup{}, fmt.Errorf("setup %q: replicas=%q: want a number of routers from 1 to %d", name, v, maxReplicas)
			}
			s.Replicas = n
		default:
			return Setup{}, fmt.Errorf("setup %q: unknown option %q (uncached=N, no-reuse, replicas=N)", name, opt)
		}
	}
	if s.Replicas > 0 && s.Disaggregated() {
		return Setup{}, fmt.Errorf("setup %q: replicas= applies to an aggregated layout", name)
	}
	if (s.MinUncached >= 0 || s.NoReuse) && !s.Disaggregated() {
		return Setup{}, fmt.Errorf("setup %q: uncached= and no-reuse apply to a disaggregated layout (e.g. %s@4p4d+...)", name, head)
	}
	return s, nil
}

// maxReplicas bounds +replicas=N: each replica follows every engine's
// events on one machine.
const maxReplicas = 16

// roles lays the fleet out: prefill engines first, then decode ones.
func (s Setup) roles() []server.Role {
	if !s.Disaggregated() {
		return nil
	}
	return fleet.DisaggregatedRoles(s.Prefill, s.Decode)
}

// DisaggResult is what a disaggregated run moved between its pools.
type DisaggResult struct {
	PrefillWorkers int `json:"prefill_workers"`
	DecodeWorkers  int `json:"decode_workers"`
	// Prefills counts requests by where their prompt was computed:
	// "remote" on a prefill engine, or a local reason (short_uncached,
	// prefill_busy, prefill_error, ...) on the decode engine.
	Prefills map[string]int `json:"prefills"`
	// TransferredBlocks and TransferredBytes are what decode engines pulled
	// from prefill engines, as the engines counted them.
	TransferredBlocks           int     `json:"transferred_blocks"`
	TransferredBytes            float64 `json:"transferred_bytes"`
	TransferredBlocksPerRequest float64 `json:"transferred_blocks_per_request"`
	// PrefillHitRate is the prefix-cache hits that spared prefill work
	// over the prompts' lookups: on the prefill engines, and on the decode
	// engines for the prompts they prefilled themselves. (Engines'
	// per-request cached tokens count pulled blocks as cached.)
	PrefillHitRate float64 `json:"prefill_hit_rate"`
}

// disaggStats reads a disaggregated run's figures from the engines' and
// the frontend's /metrics once the run is over.
func disaggStats(ctx context.Context, s Setup, engines *fleet.Fleet, frontend string, requests int) (*DisaggResult, error) {
	d := &DisaggResult{PrefillWorkers: s.Prefill, DecodeWorkers: s.Decode, Prefills: map[string]int{}}
	var hits, queries float64
	for _, e := range engines.Engines() {
		fams, err := bench.ScrapeMetrics(ctx, e.HTTPURL)
		if err != nil {
			return nil, fmt.Errorf("engine %s: %w", e.Name, err)
		}
		// Prefill work spared: the prefill engines' hits, and the decode
		// engines' hits on the prompts they prefilled themselves (a
		// pulled prompt's hits spared a transfer instead).
		hits += total(fams["vllm:prefix_cache_hits"]) - total(fams["kvrouter_mocker_prefix_cache_loaded_hits"])
		queries += total(fams["vllm:prefix_cache_queries"]) - total(fams["kvrouter_mocker_prefix_cache_loaded_queries"])
		if e.Role == server.RoleDecode {
			d.TransferredBlocks += int(total(fams["kvrouter_mocker_kv_transfer_blocks_pulled_total"]))
			d.TransferredBytes += total(fams["vllm:nixl_bytes_transferred"])
		}
	}
	if queries > 0 {
		d.PrefillHitRate = hits / queries
	}
	if requests > 0 {
		d.TransferredBlocksPerRequest = float64(d.TransferredBlocks) / float64(requests)
	}
	fams, err := bench.ScrapeMetrics(ctx, frontend)
	if err != nil {
		return nil, fmt.Errorf("frontend: %w", err)
	}
	if mf := fams["kvrouter_frontend_prefill_decisions_total"]; mf != nil {
		for _, m := range mf.Metric {
			where := label(m, "reason")
			if label(m, "prefill") == "remote" {
				where = "remote"
			}
			d.Prefills[where] += int(m.GetCounter().GetValue())
		}
	}
	return d, nil
}

// total sums a family over its series: counters and gauges by value,
// histograms by their sum.
func total(mf *dto.MetricFamily) float64 {
	if mf == nil {
		return 0
	}
	sum := 0.0
	for _, m := range mf.Metric {
		switch {
		case m.Counter != nil:
			sum += m.Counter.GetValue()
		case m.Gauge != nil:
			sum += m.Gauge.GetValue()
		case m.Histogram != nil:
			sum += m.Histogram.GetSampleSum()
		case m.Untyped != nil:
			sum += m.Untyped.GetValue()
		}
	}
	return sum
}

func label(m *dto.Metric, name string) string {
	for _, l := range m.Label {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}
