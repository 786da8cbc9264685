package frontend

import (
	"fmt"
	"maps"
	"slices"
	"strings"
)

// What an engine's KV events carried that the router cannot honour (a
// KV-cache group kind it does not index, an extra key it cannot place in a
// block's identity, a medium it does not know) is shown, not hidden: per
// engine in /health (kv_events_unsupported, and a note), on the dashboard's
// engine card, and as kvrouter_worker_kv_events_unsupported_total. It does
// not make /health "degraded": routing goes on, exactly, with what the
// router does understand, and a field the router knowingly ignores is the
// engine's configuration, not a fault. docs/engines.md says what the router
// does with each field.

// uiUnsupported is one such field on the dashboard.
type uiUnsupported struct {
	Field string `json:"field"`
	Count uint64 `json:"count"`
}

// unsupportedList orders the counts by field name, [] when there are none.
func unsupportedList(m map[string]uint64) []uiUnsupported {
	out := make([]uiUnsupported, 0, len(m))
	for _, k := range slices.Sorted(maps.Keys(m)) {
		out = append(out, uiUnsupported{Field: k, Count: m[k]})
	}
	return out
}

// unsupportedNote is /health's note for one engine; "" when it has none.
func unsupportedNote(e EngineStatus) string {
	if len(e.Unsupported) == 0 {
		return ""
	}
	parts := make([]string, 0, len(e.Unsupported))
	for _, u := range unsupportedList(e.Unsupported) {
		parts = append(parts, fmt.Sprintf("%s (%d)", u.Field, u.Count))
	}
	return fmt.Sprintf("engine %s (%d): KV event fields the router does not honour, routing without them: %s", e.Name, e.ID, strings.Join(parts, ", "))
}
