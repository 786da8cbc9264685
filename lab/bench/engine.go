package bench

import "github.com/kvrouter/kvrouter/core/kv"

// Engine is a simulated engine's prefix cache for callers outside the
// bench (kvrouter up): the bench's LRU engine cache behind an API that
// speaks KV events. Blocks are keyed by their content (the router's
// sequence hashes, which the simulation may use as a content key) and known
// to the outside only by opaque engine ids, as vLLM's own block hashes are.
// An Engine is not safe for concurrent use.
type Engine struct {
	w  kv.Worker
	c  *engineCache
	sc serveScratch
}

// NewEngine returns an empty engine cache of capacityBlocks blocks for
// worker w; seed drives its engine block ids.
func NewEngine(w kv.Worker, capacityBlocks int, seed uint64) *Engine {
	return &Engine{w: w, c: newEngineCache(max(1, capacityBlocks), mix64(seed^mix64(w.ID+1)))}
}

// Serve admits a prompt whose blocks have the given sequence hashes (seq,
// the content keys) and local hashes. It returns how many leading blocks
// the engine found cached and the KV events the engine emits for it, in
// order: at most one Removed (the blocks evicted to make room) and one
// Stored (the new chain, hanging below the last cached block). The events
// own their slices. At most the cache's capacity of blocks is kept.
func (e *Engine) Serve(seq, local []uint64) (hit int, events []kv.Event) {
	hit, parent, hasParent := e.c.serve(seq, local, &e.sc)
	if len(e.sc.removed) > 0 {
		e.c.eventID++
		events = append(events, kv.RemovedEvent(e.w, e.c.eventID, append([]uint64(nil), e.sc.removed...)...))
	}
	if len(e.sc.blocks) > 0 {
		e.c.eventID++
		var p *uint64
		if hasParent {
			p = kv.Ptr(parent)
		}
		events = append(events, kv.StoredEvent(e.w, e.c.eventID, p, append([]kv.Block(nil), e.sc.blocks...)...))
	}
	return hit, events
}

// Blocks is the number of blocks the engine holds.
func (e *Engine) Blocks() int { return e.c.size }

// Capacity is the most blocks the engine holds.
func (e *Engine) Capacity() int { return e.c.cap }
