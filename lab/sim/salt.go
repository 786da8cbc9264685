package sim

import (
	"github.com/kvrouter/kvrouter/adapters/vllmevents"
	"github.com/kvrouter/kvrouter/lab/workload"
	"github.com/kvrouter/kvrouter/mocker/engine"
)

// salt is the cache salt the router is told for req: none when the run
// ignores salts.
func (s *sim) salt(req *workload.Request) string {
	if s.cfg.IgnoreCacheSalt {
		return ""
	}
	return req.CacheSalt
}

// eventSalt is the salt of a stored event's blocks as an event source
// derives it: from the first block's extra keys when the event starts a
// request's chain, else from the block it continues.
func (s *sim) eventSalt(se *simEngine, ev *engine.BlockEvent) string {
	if s.cfg.IgnoreCacheSalt {
		return ""
	}
	own := ""
	if ev.Parent == nil && len(ev.ExtraKeys) > 0 {
		own = vllmevents.CacheSalt([][]vllmevents.ExtraKey{extraKeysOf(ev.ExtraKeys[0])}, ev.LoRAName)
	}
	return se.salts.Stored(ev.Parent, ev.BlockHashes, own)
}

// extraKeysOf types the mocker's extra keys of one block as the event
// decoder types vLLM's.
func extraKeysOf(keys []any) []vllmevents.ExtraKey {
	out := make([]vllmevents.ExtraKey, 0, len(keys))
	for _, k := range keys {
		switch v := k.(type) {
		case string:
			out = append(out, vllmevents.ExtraKey{Kind: vllmevents.ExtraString, Str: v})
		case []any:
			id, _ := v[0].(string)
			off, _ := v[1].(int)
			out = append(out, vllmevents.ExtraKey{Kind: vllmevents.ExtraIdentifierOffset, Str: id, Offset: int64(off)})
		default:
			out = append(out, vllmevents.ExtraKey{Kind: vllmevents.ExtraOther})
		}
	}
	return out
}
