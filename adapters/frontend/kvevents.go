package frontend

import (
	"fmt"
	"strings"

	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
)

// KVEventsHint tells an operator how to make vLLM publish the KV events
// the router follows, on the port of events, the engine's events endpoint
// ("" when the router was not given one: vLLM's usual 5557).
func KVEventsHint(events string) string {
	port := "5557"
	if i := strings.LastIndexByte(events, ':'); i >= 0 && i+1 < len(events) {
		port = events[i+1:]
	}
	hint := `start vLLM with --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:` + port + `"}'`
	if events == "" {
		return hint + " and give the engine's events endpoint (events=tcp://HOST:" + port + ", or the agent's --events)"
	}
	return hint + " (dp rank r on port + r), and check that events=" + events + " is that engine's endpoint"
}

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
		return "none received" + which + ": routing by predicted cache (approximate); " + KVEventsHint(wk.Events), true
	case awaited:
		return "awaited", false
	}
	return "ok", false
}
