package enginesource

import "github.com/kvrouter/kvrouter/adapters/vllmevents"

// KV-cache groups.
//
// A hybrid model (Gemma 3 and gpt-oss mixing sliding-window and full
// attention layers, Jamba or Qwen3-Next mixing Mamba and attention) keeps
// one KV-cache group per kind of layer, each with its own blocks and block
// size, and vLLM publishes the events of every group. Their block ids are
// computed the same way from the same tokens, so at equal block sizes two
// groups name the same content with the same id: indexing more than one
// group mixes them up. The router indexes exactly one group per engine:
//
//   - the first main-attention group (full_attention, mla_attention,
//     sink_full_attention, as Dynamo's is_main_attention) that stores a
//     block; within a batch, the lowest group_idx. vLLM stores a step's
//     blocks group by group in index order, so this is the engine's first
//     main-attention group. Its kind is learnt from BlockStored's
//     kv_cache_spec_kind; a BlockRemoved carries only group_idx and is
//     routed by what the group's BlockStored events said.
//   - Without kv_cache_spec_kind (vLLM before it, SGLang), group 0, as
//     Dynamo does: what kvrouter did before it knew of groups.
//
// Every other group's events are skipped (Stats.OtherGroup). Sliding-window
// kinds (sliding_window, sliding_window_mla, chunked_local_attention) are a
// reusable prefix only within their window: a block that has left the
// window is no longer attended to, so matching a request's prefix on it
// would credit cache the engine cannot reuse. They are never indexed, not
// even when the engine has no main-attention group; there they are also
// counted as unsupported, since the router then sees nothing of that
// engine's cache. Mamba groups (a recurrent state, not a block per prefix)
// and kinds kvrouter does not know are counted as unsupported too. So is a
// group_idx other than the indexed one that no BlockStored has described.

// GroupVerdict is what the router does with one event's group.
type GroupVerdict uint8

const (
	// GroupIndexed: the event belongs to the group the router indexes.
	GroupIndexed GroupVerdict = iota
	// GroupSkipped: the event belongs to another group; its field, when
	// not "", names what the router cannot honour (see unsupported).
	GroupSkipped
)

// maxGroups bounds the groups whose kind a filter remembers: group_idx comes
// from the wire, and a broken publisher may name any number of them.
const maxGroups = 64

// GroupFilter chooses, event by event, whether an engine's event belongs to
// the KV-cache group the router indexes. The zero value is ready; one filter
// serves one engine rank, from one goroutine.
type GroupFilter struct {
	kinds  map[int]string // group_idx → kv_cache_spec_kind, from BlockStored
	chosen int            // the indexed group + 1; 0 while none is chosen
}

// Indexed names the group the filter has chosen by its kind; ok is false
// while none is (group 0 is then indexed by default).
func (f *GroupFilter) Indexed() (group int, kind string, ok bool) {
	if f.chosen == 0 {
		return 0, "", false
	}
	return f.chosen - 1, f.kinds[f.chosen-1], true
}

// Reset forgets what was learnt: a restarted engine may serve another model.
func (f *GroupFilter) Reset() { *f = GroupFilter{} }

// Learn notes the kinds a batch's BlockStored events announce, and chooses
// the indexed group when none is yet. It must see a batch before its events
// are judged, so that a main-attention group named later in the batch
// decides for the events before it.
func (f *GroupFilter) Learn(events []vllmevents.Event) {
	best := -1
	for _, ev := range events {
		st, ok := ev.(*vllmevents.BlockStored)
		if ok && f.learn(st.GroupIdx, st.KVCacheSpecKind) && (best < 0 || st.GroupIdx < best) {
			best = st.GroupIdx
		}
	}
	if f.chosen == 0 && best >= 0 {
		f.chosen = best + 1
	}
}

// LearnGroup is Learn for one BlockStored of group idx announcing kind, for
// a caller that has no decoded batch: a main-attention group is chosen at
// once when none is yet.
func (f *GroupFilter) LearnGroup(idx int, kind string) {
	if f.learn(idx, kind) && f.chosen == 0 {
		f.chosen = idx + 1
	}
}

// learn remembers group idx's kind and reports whether it is main attention.
func (f *GroupFilter) learn(idx int, kind string) bool {
	if kind == "" || idx < 0 {
		return false
	}
	if _, known := f.kinds[idx]; !known && len(f.kinds) >= maxGroups {
		return false
	}
	if f.kinds == nil {
		f.kinds = map[int]string{}
	}
	f.kinds[idx] = kind
	return MainAttention(kind)
}

// Stored judges a BlockStored event of group idx announcing kind ("" when
// the engine does not say). field, when not "", is the name under which the
// router counts what it cannot honour.
func (f *GroupFilter) Stored(idx int, kind string) (v GroupVerdict, field string) {
	if kind == "" {
		return f.Removed(idx)
	}
	return f.byKind(idx, kind)
}

// Removed judges a BlockRemoved event of group idx: by the kind its group's
// BlockStored events announced, else by number.
func (f *GroupFilter) Removed(idx int) (v GroupVerdict, field string) {
	if kind, ok := f.kinds[idx]; ok {
		return f.byKind(idx, kind)
	}
	switch {
	case f.chosen == 0 && idx == 0:
		return GroupIndexed, ""
	case f.chosen == 0:
		return GroupSkipped, "group_idx"
	}
	// The indexed group was described; this one never was: not it.
	return GroupSkipped, ""
}

func (f *GroupFilter) byKind(idx int, kind string) (GroupVerdict, string) {
	switch {
	case MainAttention(kind):
		if f.chosen == idx+1 {
			return GroupIndexed, ""
		}
		// Another main-attention group holds the same prefix as the one
		// indexed: indexing it too would count every block twice.
		return GroupSkipped, ""
	case kind == "mamba":
		return GroupSkipped, "kv_cache_spec_kind=mamba"
	}
	field := knownKinds[kind]
	if field == "" {
		return GroupSkipped, "kv_cache_spec_kind=unknown"
	}
	if f.chosen == 0 {
		// No main-attention group to route on: this engine's cache is
		// invisible to the router.
		return GroupSkipped, field
	}
	return GroupSkipped, ""
}

// MainAttention reports whether a kv_cache_spec_kind is one whose blocks
// form a reusable prefix of any length: full attention and its variants.
func MainAttention(kind string) bool {
	switch kind {
	case "full_attention", "mla_attention", "sink_full_attention":
		return true
	}
	return false
}

// knownKinds are vLLM's kinds that are neither main attention nor Mamba,
// with the field name they are counted under when an engine has nothing
// else (constant strings: metric labels never come from the wire).
var knownKinds = map[string]string{
	"sliding_window":          "kv_cache_spec_kind=sliding_window",
	"sliding_window_mla":      "kv_cache_spec_kind=sliding_window_mla",
	"chunked_local_attention": "kv_cache_spec_kind=chunked_local_attention",
	"encoder_only_attention":  "kv_cache_spec_kind=encoder_only_attention",
	"cross_attention":         "kv_cache_spec_kind=cross_attention",
}
