package enginesource

import (
	"maps"
	"sync"
)

// An engine may send what the router cannot honour yet (a KV-cache group
// kind it cannot index, an extra key it cannot place in a block's identity,
// a field of a newer engine). Routing then goes on with what the router does
// understand, and the operator must be able to see what was left out and
// how often: each such field is counted per engine, by a name from the
// fixed set below, and logged once per source.
//
// The names are the engines' own field names (or field=value where the
// value is what cannot be honoured), so that an operator can search the
// engine's docs for them. Only code chooses them, never input, so the set
// of metric labels stays bounded.

type unsupportedFields struct {
	mu     sync.Mutex // guards counts
	counts map[string]uint64
}

// unsupported counts one event (or block) of this engine whose field the
// router cannot honour, and warns the first time per field.
func (s *Source) unsupported(field string) {
	u := &s.unsup
	u.mu.Lock()
	if u.counts == nil {
		u.counts = map[string]uint64{}
	}
	u.counts[field]++
	first := u.counts[field] == 1
	u.mu.Unlock()
	if first {
		s.log.Warn("kv event field not honoured by the router; counted in kvrouter_worker_kv_events_unsupported_total",
			"field", field)
	}
}

// snapshot copies the counts; nil when there are none.
func (u *unsupportedFields) snapshot() map[string]uint64 {
	u.mu.Lock()
	defer u.mu.Unlock()
	if len(u.counts) == 0 {
		return nil
	}
	return maps.Clone(u.counts)
}
