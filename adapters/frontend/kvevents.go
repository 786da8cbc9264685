package frontend

import (
	"fmt"
	"strings"

	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
)

// KVEventsHint tells an operator how to make vLLM publish the KV events
// the router follows.
const KVEventsHint = `start vLLM with --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}' and check the worker's events endpoint`

// kvEventsHealth is /health's kv_events entry of engine wk: "" when the
// router follows no events for it, "ok" once every rank's events arrive,
// "awaited" before, and while some rank has sent none in the grace period
// a description that also makes /health degraded.
func (f *Frontend) kvEventsHealth(wk Worker) (state string, degraded bool) {
	var missing []string
	awaited := false
	ranks := max(wk.DPSize, 1)
	for rank := range ranks {
		switch f.cfg.Router.KVEvents(kv.Worker{ID: wk.ID, DPRank: uint32(rank)}) {
		case router.EventsNotFollowed:
			return "", false
		case router.EventsAwaited:
			awaited = true
		case router.EventsMissing:
			missing = append(missing, fmt.Sprint(rank))
		}
	}
	switch {
	case len(missing) > 0:
		which := ""
		if ranks > 1 {
			which = " on dp ranks " + strings.Join(missing, ", ")
		}
		return "none received" + which + ": routing by predicted cache (approximate); " + KVEventsHint, true
	case awaited:
		return "awaited", false
	}
	return "ok", false
}
