package router

import (
	"maps"
	"slices"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/index"
)

// Engines do not all use the router's --kv-cache-block-size: a fleet may
// mix engines of different block sizes, and an operator may simply give
// the router the wrong one. An engine's blocks are indexed under hashes of
// its own block size (the size its Stored events carry), and a request is
// matched against it with hashes of that size: the request is hashed once
// per distinct block size among the engines, and only once while they all
// agree with the router.
//
// Costs compare engines in the router's blocks: an engine's overlap of n
// blocks of s tokens counts as floor(n·s / router block size) router
// blocks, the router blocks whose tokens are all cached there. Load
// (active blocks, prefill tokens) is booked in the router's blocks too,
// so every term of the cost is in one unit whatever the engines use.

// BlockSizeChange says that the events of engine ID carry blocks of
// BlockSize tokens where the router assumed Previous (the announced size,
// or the router's own).
type BlockSizeChange struct {
	ID                  uint64
	BlockSize, Previous int
	// RouterBlockSize is the router's --kv-cache-block-size.
	RouterBlockSize int
}

// SetBlockSizeObserver calls fn whenever an engine's events reveal a
// block size other than the one the router was using for it, so that the
// layer above can tell the operator. nil removes the observer. fn runs on
// the event path: it must be quick and must not call back into the Router.
func (r *Router) SetBlockSizeObserver(fn func(BlockSizeChange)) {
	if fn == nil {
		r.sizeObserver.Store(nil)
		return
	}
	r.sizeObserver.Store(&fn)
}

// maxBlockSize bounds the block sizes learnt from events or taken from
// discovery; engines use 1 to a few hundred tokens.
const maxBlockSize = 1 << 16

// BlockSizeConsistent tells whether the event's block size may be learnt:
// its tokens fill its blocks exactly. One malformed event must not switch
// how an engine is matched.
func (es *EngineStored) BlockSizeConsistent() bool {
	return es.BlockSize > 0 && es.BlockSize <= maxBlockSize && len(es.EngineHashes) > 0 &&
		len(es.Tokens) == len(es.EngineHashes)*es.BlockSize
}

// learnBlockSize records that engine id's events carry blocks of size
// tokens.
func (r *Router) learnBlockSize(id uint64, size int) {
	r.fleetMu.Lock()
	old := r.fleet.Load()
	info, known := old.infos[id]
	if !known || old.learned[id] == size {
		r.fleetMu.Unlock()
		return
	}
	previous := old.blockSize(id, r.cfg.BlockSize)
	learned := maps.Clone(old.learned)
	learned[id] = size
	r.fleet.Store(r.buildFleet(old.infos, learned))
	r.fleetMu.Unlock()
	if fn := r.sizeObserver.Load(); fn != nil && previous != size {
		(*fn)(BlockSizeChange{ID: info.ID, BlockSize: size, Previous: previous, RouterBlockSize: r.cfg.BlockSize})
	}
}

// WorkerBlockSize is the block size the router matches an engine with.
type WorkerBlockSize struct {
	ID        uint64
	BlockSize int
	// Learned: the engine's events carried it; otherwise it was announced
	// or is the router's own.
	Learned bool
}

// Mismatched tells whether the engine's block size differs from the
// router's.
func (w WorkerBlockSize) Mismatched(routerBlockSize int) bool { return w.BlockSize != routerBlockSize }

// WorkerBlockSize is the block size engine id is matched with: the one its
// events carry, else the announced one, else the router's.
func (r *Router) WorkerBlockSize(id uint64) int {
	return r.fleet.Load().blockSize(id, r.cfg.BlockSize)
}

// WorkerBlockSizes lists every registered engine's block size, by id.
func (r *Router) WorkerBlockSizes() []WorkerBlockSize {
	f := r.fleet.Load()
	out := make([]WorkerBlockSize, 0, len(f.infos))
	for id := range f.infos {
		_, learned := f.learned[id]
		out = append(out, WorkerBlockSize{ID: id, BlockSize: f.blockSize(id, r.cfg.BlockSize), Learned: learned})
	}
	slices.SortFunc(out, func(a, b WorkerBlockSize) int { return cmpU64(a.ID, b.ID) })
	return out
}

// altHashes are a request's hashes for a block size other than the
// router's.
type altHashes struct {
	size       int
	local, seq []uint64
	matchable  int
}

// hashesFor returns the request's hashes for block size size, computing
// them once per decision.
func (p *prepared) hashesFor(size int) *altHashes {
	for i := range p.alt {
		if p.alt[i].size == size {
			return &p.alt[i]
		}
	}
	if len(p.alt) < cap(p.alt) {
		p.alt = p.alt[:len(p.alt)+1]
	} else {
		p.alt = append(p.alt, altHashes{})
	}
	a := &p.alt[len(p.alt)-1]
	a.size = size
	h := blockhash.NewKeyed(size, p.req.LoRA, p.req.CacheSalt)
	a.local, a.seq = h.AppendHashes(a.local[:0], a.seq[:0], p.req.Tokens)
	a.matchable = appendMMHashes(h, p.req.Tokens, p.req.MM, a.local, a.seq)
	return a
}

// localFor returns the request's local hashes in engine id's block size,
// the ones its events will name, up to those that may be matched.
func (p *prepared) localFor(f *fleet, id uint64) []uint64 {
	if size, ok := f.odd[id]; ok {
		a := p.hashesFor(size)
		return a.local[:a.matchable]
	}
	return p.local[:p.matchable]
}

// matchOtherSizes replaces the overlaps of the engines whose block size is
// not the router's (p.overlaps holds the router-size match) with a match
// of the request hashed in their block size, converted to router blocks.
func (r *Router) matchOtherSizes(p *prepared, sc *scratch, f *fleet) {
	// An engine that changed block size may still hold blocks hashed the
	// old way: only a match in its current size counts.
	p.overlaps = slices.DeleteFunc(p.overlaps, func(o index.Overlap) bool { _, odd := f.odd[o.Worker.ID]; return odd })
	for _, size := range f.sizes {
		h := p.hashesFor(size)
		for _, o := range r.exact.FindMatches(&sc.m, h.seq[:h.matchable]) {
			if f.odd[o.Worker.ID] == size {
				o.Blocks = uint32(int(o.Blocks) * size / r.cfg.BlockSize)
				p.overlaps = append(p.overlaps, o)
			}
		}
	}
}
