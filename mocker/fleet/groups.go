package fleet

import (
	"github.com/kvrouter/kvrouter/adapters/vllmevents"
	"github.com/kvrouter/kvrouter/mocker/engine"
)

// labelGroups gives the events of a hybrid model's engine their group as
// vLLM publishes it: group_idx on every event, block size,
// kv_cache_spec_kind and kv_cache_spec_sliding_window on BlockStored.
// group(i) is out[i]'s group_idx. A plain model's events stay as they
// were, without groups.
func labelGroups(out []vllmevents.Event, group func(i int) int, cfg engine.Config) {
	if len(cfg.KVCacheGroups) == 0 {
		return
	}
	for i, ev := range out {
		labelGroup(ev, group(i), cfg)
	}
}

func labelGroup(ev vllmevents.Event, idx int, cfg engine.Config) {
	g := cfg.Group(idx)
	switch e := ev.(type) {
	case *vllmevents.BlockStored:
		e.GroupIdx, e.BlockSize, e.KVCacheSpecKind = idx, g.BlockSize, g.Kind
		if g.SlidingWindow > 0 {
			w := g.SlidingWindow
			e.KVCacheSpecSlidingWindow = &w
		}
	case *vllmevents.BlockRemoved:
		e.GroupIdx = idx
	}
}
