package sim

import (
	"github.com/kvrouter/kvrouter/adapters/enginesource"
	"github.com/kvrouter/kvrouter/mocker/engine"
)

// indexed reports whether a hybrid model's event reaches the router: its
// group is judged as the router judges the groups of a live engine's
// events (enginesource.GroupFilter).
func (se *simEngine) indexed(ev engine.BlockEvent, cfg engine.Config) bool {
	var v enginesource.GroupVerdict
	switch ev.Kind {
	case engine.Stored:
		kind := cfg.Group(ev.Group).Kind
		se.groups.LearnGroup(ev.Group, kind)
		v, _ = se.groups.Stored(ev.Group, kind)
	case engine.Removed:
		v, _ = se.groups.Removed(ev.Group)
	}
	return v == enginesource.GroupIndexed
}
