package frontend

import (
	"slices"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// DynamoMetricNames maps kvrouter's metrics to the names Dynamo's frontend
// and router export for the same quantity, in the same unit, so that
// dashboards and alerts written for Dynamo keep working under
// --metrics-dynamo-names. A kvrouter metric may stand for several of
// Dynamo's (its frontend and its router count the same requests). Dynamo's
// routing-overhead histograms are in milliseconds, kvrouter's in seconds:
// they are left out rather than exported under a name that lies about the
// unit. docs/dynamo-compat.md has the table.
var DynamoMetricNames = map[string][]string{
	"kvrouter_frontend_requests_total":              {"dynamo_frontend_requests_total", "dynamo_component_router_requests_total"},
	"kvrouter_frontend_inflight_requests":           {"dynamo_frontend_inflight_requests"},
	"kvrouter_frontend_time_to_first_token_seconds": {"dynamo_frontend_time_to_first_token_seconds", "dynamo_component_router_time_to_first_token_seconds"},
	"kvrouter_frontend_inter_token_latency_seconds": {"dynamo_frontend_inter_token_latency_seconds", "dynamo_component_router_inter_token_latency_seconds"},
	"kvrouter_frontend_request_duration_seconds":    {"dynamo_frontend_request_duration_seconds"},
	"kvrouter_frontend_input_sequence_tokens":       {"dynamo_frontend_input_sequence_tokens", "dynamo_component_router_input_sequence_tokens"},
	"kvrouter_frontend_output_sequence_tokens":      {"dynamo_frontend_output_sequence_tokens", "dynamo_component_router_output_sequence_tokens"},
	"kvrouter_frontend_kv_hit_rate":                 {"dynamo_component_router_kv_hit_rate"},
	"kvrouter_frontend_model_migration_total":       {"dynamo_frontend_model_migration_total"},
	"kvrouter_router_queue_pending_requests":        {"dynamo_frontend_router_queue_pending_requests"},
	"kvrouter_worker_active_decode_blocks":          {"dynamo_frontend_worker_active_decode_blocks"},
	"kvrouter_worker_active_prefill_tokens":         {"dynamo_frontend_worker_active_prefill_tokens"},
}

// dynamoNames gathers g and adds, for each family DynamoMetricNames maps,
// a copy under each of Dynamo's names.
type dynamoNames struct{ g prometheus.Gatherer }

func (d dynamoNames) Gather() ([]*dto.MetricFamily, error) {
	mfs, err := d.g.Gather()
	out := slices.Clone(mfs)
	for _, mf := range mfs {
		for _, name := range DynamoMetricNames[mf.GetName()] {
			cp := &dto.MetricFamily{Name: &name, Help: mf.Help, Type: mf.Type, Unit: mf.Unit, Metric: mf.Metric}
			out = append(out, cp)
		}
	}
	slices.SortFunc(out, func(a, b *dto.MetricFamily) int {
		switch {
		case a.GetName() < b.GetName():
			return -1
		case a.GetName() > b.GetName():
			return 1
		}
		return 0
	})
	return out, err
}
