package router

import (
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/kvrouter/kvrouter/core/kv"
)

// Offloaded blocks named by id alone. vLLM's offloading connector
// publishes the blocks it copies to the host (or disk) as BlockStored with
// medium CPU, no parent_block_hash and no token_ids: only the engine's ids
// of blocks the engine computed, hence stored on its GPU first
// (vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py,
// take_events). Without tokens the router cannot hash them, and without a
// parent it cannot chain them; both are what the engine's own device
// event said under the same id. So, once an engine publishes such a
// block, the router books its device blocks by id (their local hash and
// parent), and places its token-less lower-tier blocks from the book:
// each run of blocks that chain one to the next is one stored event below
// its first block's parent. A block stored on the device before the
// engine's first token-less block, or never on the device, cannot be
// placed: it is counted (Stats.UnplacedOffloadedBlocks) and skipped.
//
// An entry lives while the block is on the device or on a lower tier, so
// the book holds at most the engine's device and offloaded blocks.
// Engines that publish their lower tiers with tokens (SGLang's HiCache,
// LMCache) never open a book.

type bookEntry struct {
	local, parent uint64
	root          bool
	device, lower bool
}

type offloadBook struct {
	mu     sync.Mutex
	blocks map[uint64]bookEntry
}

type offloadBooks struct {
	any   atomic.Bool
	books sync.Map // kv.Worker → *offloadBook
}

func (o *offloadBooks) of(w kv.Worker) *offloadBook {
	if !o.any.Load() {
		return nil
	}
	b, _ := o.books.Load(w)
	bk, _ := b.(*offloadBook)
	return bk
}

func (o *offloadBooks) open(w kv.Worker) *offloadBook {
	if b := o.of(w); b != nil {
		return b
	}
	b, _ := o.books.LoadOrStore(w, &offloadBook{blocks: map[uint64]bookEntry{}})
	o.any.Store(true)
	return b.(*offloadBook)
}

// tokenless tells whether es names its blocks by id alone.
func tokenless(es *EngineStored) bool {
	return len(es.Tokens) == 0 && len(es.EngineHashes) > 0 && es.Tier != "" && es.Tier != kv.TierDevice
}

// recordDevice books the device blocks of a hashed stored event.
func (b *offloadBook) recordDevice(ev *kv.Event) {
	b.mu.Lock()
	defer b.mu.Unlock()
	parent, root := uint64(0), ev.Stored.Parent == nil
	if !root {
		parent = *ev.Stored.Parent
	}
	for _, blk := range ev.Stored.Blocks {
		e := b.blocks[blk.EngineHash]
		e.local, e.parent, e.root, e.device = blk.LocalHash, parent, root, true
		b.blocks[blk.EngineHash] = e
		parent, root = blk.EngineHash, false
	}
}

// removed updates the book after a removal (or clear) on tier t.
func (b *offloadBook) removed(t kv.StorageTier, hashes []uint64, cleared bool) {
	device := t == "" || t == kv.TierDevice
	b.mu.Lock()
	defer b.mu.Unlock()
	drop := func(h uint64, e bookEntry) {
		if device {
			e.device = false
		} else {
			e.lower = false
		}
		if !e.device && !e.lower {
			delete(b.blocks, h)
		} else {
			b.blocks[h] = e
		}
	}
	if cleared {
		for h, e := range b.blocks {
			drop(h, e)
		}
		return
	}
	for _, h := range hashes {
		if e, ok := b.blocks[h]; ok {
			drop(h, e)
		}
	}
}

// place turns token-less lower-tier blocks into stored events, one per
// chained run, and reports how many blocks it could not place.
func (b *offloadBook) place(es *EngineStored) (evs []kv.Event, unplaced int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	var run []kv.Block
	var runParent *uint64
	flush := func() {
		if len(run) > 0 {
			ev := kv.StoredEvent(es.Worker, es.EventID, runParent, run...)
			ev.Tier = es.Tier
			evs = append(evs, ev)
		}
		run, runParent = nil, nil
	}
	for _, h := range es.EngineHashes {
		e, ok := b.blocks[h]
		if !ok {
			flush()
			unplaced++
			continue
		}
		e.lower = true
		b.blocks[h] = e
		chained := len(run) > 0 && !e.root && e.parent == run[len(run)-1].EngineHash
		if !chained {
			flush()
			if !e.root {
				p := e.parent
				runParent = &p
			}
		}
		run = append(run, kv.Block{EngineHash: h, LocalHash: e.local})
	}
	flush()
	return evs, unplaced
}

// OffloadPlacer hashes an engine's stored events as a Router does, placing
// its token-less lower-tier blocks from its own book, for what forwards
// events to routers without being one (the agent): the routers behind it
// never see the engine's own events, so they could not place them.
type OffloadPlacer struct{ books offloadBooks }

// Stored returns the events es makes: its blocks hashed in blockSize
// unless es names its own, or the runs its token-less blocks are placed
// in. The error is HashEngineStored's, or ErrUnplacedBlocks.
func (p *OffloadPlacer) Stored(es *EngineStored, blockSize int) ([]kv.Event, error) {
	if tokenless(es) {
		evs, unplaced := p.books.open(es.Worker).place(es)
		if unplaced > 0 {
			return evs, fmt.Errorf("%w: %d of %d offloaded blocks never seen on the device", ErrUnplacedBlocks, unplaced, len(es.EngineHashes))
		}
		return evs, nil
	}
	ev, _, err := HashEngineStored(es, blockSize)
	if len(ev.Stored.Blocks) == 0 {
		return nil, err
	}
	if b := p.books.of(es.Worker); b != nil && (ev.Tier == "" || ev.Tier == kv.TierDevice) {
		b.recordDevice(&ev)
	}
	return []kv.Event{ev}, err
}

// Removed updates the book after a removed or cleared event.
func (p *OffloadPlacer) Removed(ev *kv.Event) {
	if b := p.books.of(ev.Worker); b != nil && ev.Kind != kv.KindStored {
		b.removed(ev.Tier, ev.Removed.EngineHashes, ev.Kind == kv.KindCleared)
	}
}
