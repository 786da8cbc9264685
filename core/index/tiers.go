package index

import (
	"errors"
	"slices"

	"github.com/kvrouter/kvrouter/core/kv"
)

// Tiers. Engines that offload KV blocks (vLLM's offloading connector,
// SGLang's HiCache, LMCache) publish the same events for their host, disk
// and shared caches, with the medium that holds the block. The device
// tier is the shard's own tree, unchanged; each lower tier is another
// tree of the same shard, made when the first event of that tier comes.
// A (block, worker) pair thus holds a set of tiers: a block evicted from
// the GPU and kept on the host (Removed on the device, Stored on the host)
// stays matched, on the host tier, and a removal names one tier only. An
// index fed by device events alone has no lower tree and looks up exactly
// as before.
//
// An offloading engine stores a block on a lower tier below a parent it
// may hold on another tier only (the host pool receives a request's
// blocks as they complete, while their prefix stays on the GPU). Such a
// parent is placed in the lower tree by its sequence hash alone, as a
// node below the root that the worker does not hold (see parentSeq): its
// descendants chain from it exactly, and the tree, which knows the worker
// holds a block without its parent, walks level by level.

// ErrUnknownTier is returned by Apply for an event of a storage tier the
// index does not know. The event is counted (Stats.UnknownTier) and
// skipped; a medium is never guessed.
var ErrUnknownTier = errors.New("index: event of an unknown storage tier")

// The lower tiers, fastest first.
const (
	tierHost = iota
	tierDisk
	tierShared
	lowerTiers
)

var lowerTierNames = [lowerTiers]kv.StorageTier{kv.TierHostPinned, kv.TierDisk, kv.TierExternal}

// lowerOf is the lower tier of an event's tier, -1 for the device.
func lowerOf(t kv.StorageTier) (int, bool) {
	switch t {
	case kv.TierDevice, "":
		return -1, true
	case kv.TierHostPinned:
		return tierHost, true
	case kv.TierDisk:
		return tierDisk, true
	case kv.TierExternal:
		return tierShared, true
	}
	return 0, false
}

// TierOverlap is one worker's match on every tier, when the index holds
// lower tiers. Host and Disk are cumulative, as Dynamo's indexer reports
// them: the device match continued on the host tier, then on disk, so
// Device <= Host <= Disk. Shared is the run of blocks held in the shared
// (external) cache by any worker right after the device match: a shared
// pool serves every worker alike.
type TierOverlap struct {
	Worker                     kv.Worker
	Device, Host, Disk, Shared uint32
}

// tierScratch is FindMatches' working memory for the lower tiers.
type tierScratch struct {
	out  []TierOverlap
	seen map[kv.Worker]struct{}
	// pool caches, per position of the request, whether the shared tier
	// holds it (0 unknown, 1 yes, 2 no).
	pool       []uint8
	sharedRoot uint32
}

// Tiers returns, after FindMatches, every matched worker's overlaps on
// every tier: the workers FindMatches returned and those that hold the
// request's first block on a lower tier only. Empty while the index holds
// no lower tier. Valid until the next call on m.
func (m *Matcher) Tiers() []TierOverlap { return m.tiers.out }

// SharedRoot is, after FindMatches, the shared cache's run from the
// request's first block: the Shared of a worker that matched nothing.
func (m *Matcher) SharedRoot() uint32 { return m.tiers.sharedRoot }

// tree returns the shard's tree of lower tier i, -1 for the device.
func (sh *shard) tree(i int) *tree {
	if i < 0 {
		return sh.t
	}
	return sh.lower[i]
}

// lowerTree returns the shard's tree of lower tier i, making it.
func (ix *Index) lowerTree(sh *shard, i int) *tree {
	if t := sh.lower[i]; t != nil {
		return t
	}
	t := newTree(sh.t.lru)
	t.foreign = func(w kv.Worker, h uint64) (uint64, bool) { return sh.parentSeq(t, w, h) }
	t.readersWaiting = &sh.mu.waitingReaders
	sh.lower[i] = t
	sh.hasLower = true
	ix.hasLower.Store(true)
	return t
}

// parentSeq is the sequence hash of the block worker w holds under
// engine id h on a tier other than self's (the device first).
func (sh *shard) parentSeq(self *tree, w kv.Worker, h uint64) (uint64, bool) {
	for i := -1; i < lowerTiers; i++ {
		t := sh.tree(i)
		if t == nil || t == self {
			continue
		}
		if s, ok := t.slotOf[w]; ok {
			if n, ok := t.workers[s].blocks.Get(h); ok {
				return t.nodes.at(n).seq(), true
			}
		}
	}
	return 0, false
}

// pairs counts the shard's pairs on every tier.
func (sh *shard) pairs() uint64 {
	n := sh.t.pairs
	for _, t := range sh.lower {
		if t != nil {
			n += t.pairs
		}
	}
	return n
}

// evictTo brings the shard's pairs on every tier down to target, from the
// slowest tier up: a block the worker would have to load is worth less
// than one it holds on the device.
func (sh *shard) evictTo(target uint64) {
	total := sh.pairs()
	for i := lowerTiers - 1; i >= -1 && total > target; i-- {
		t := sh.tree(i)
		if t == nil {
			continue
		}
		other := total - t.pairs
		t.evictTo(target - min(target, other))
		total = other + t.pairs
	}
}

// findLower appends to m.tiers the shard's workers' overlaps on every
// tier; dev are the device overlaps the shard's find returned.
func (m *Matcher) findLower(sh *shard, seq []uint64, dev []Overlap) {
	sc := &m.tiers
	start := len(sc.out)
	for _, o := range dev {
		sc.out = append(sc.out, TierOverlap{Worker: o.Worker, Device: o.Blocks, Host: o.Blocks, Disk: o.Blocks})
	}
	if !sh.hasLower || len(seq) == 0 {
		return
	}
	sc.addFirstHolders(sh, seq[0], len(dev))
	// Most workers' device matches end at one block (the end of a shared
	// prefix, or the first block): a probe of it, remembered, stops them
	// there without looking the worker up.
	host, disk := sh.lower[tierHost], sh.lower[tierDisk]
	hostAt, diskAt := probeMemo{t: host, seq: seq}, probeMemo{t: disk, seq: seq}
	for i := start; i < len(sc.out); i++ {
		o := &sc.out[i]
		o.Host = hostAt.extend(o.Worker, o.Device)
		o.Disk = diskAt.extend(o.Worker, o.Host)
	}
}

// addFirstHolders appends the workers that hold the request's first block
// (seq0) on the shard's host or disk tier but not on its device: the last
// dev entries of the overlaps are the device's.
func (sc *tierScratch) addFirstHolders(sh *shard, seq0 uint64, dev int) {
	var one [1]uint32
	for _, t := range sh.lower[:tierShared] {
		if t == nil {
			continue
		}
		n, ok := t.bySeq.get(seq0, &t.nodes)
		if !ok || !t.nodes.at(n).held() {
			continue
		}
		if sc.seen == nil {
			sc.seen = make(map[kv.Worker]struct{})
		}
		if len(sc.seen) == 0 {
			for _, o := range sc.out[len(sc.out)-dev:] {
				sc.seen[o.Worker] = struct{}{}
			}
		}
		for _, s := range t.workerSet(t.nodes.at(n), &one) {
			w := t.workers[s].id
			if _, ok := sc.seen[w]; !ok {
				sc.seen[w] = struct{}{}
				sc.out = append(sc.out, TierOverlap{Worker: w})
			}
		}
	}
	clear(sc.seen)
}

// probeMemo continues device matches on one lower tier's tree (nil:
// none), remembering the last position it probed.
type probeMemo struct {
	t    *tree
	seq  []uint64
	pos  uint32
	node uint32
	ok   bool
	set  bool
}

// at is the tree's node of seq[i].
func (p *probeMemo) at(i uint32) (uint32, bool) {
	if !p.set || p.pos != i {
		p.node, p.ok = p.t.bySeq.get(p.seq[i], &p.t.nodes)
		p.pos, p.set = i, true
	}
	return p.node, p.ok
}

// extend is from plus the run of seq's blocks from position from that w
// holds in the tree.
func (p *probeMemo) extend(w kv.Worker, from uint32) uint32 {
	t := p.t
	if t == nil || int(from) >= len(p.seq) {
		return from
	}
	n, ok := p.at(from)
	if !ok {
		return from
	}
	s, ok := t.slotOf[w]
	if !ok {
		return from
	}
	var tick uint32
	if t.lru {
		tick = t.tick.Add(1)
	}
	for ok && t.holds(t.nodes.at(n), s) {
		t.touch(n, tick)
		if from++; int(from) == len(p.seq) {
			break
		}
		n, ok = t.bySeq.get(p.seq[from], &t.nodes)
	}
	return from
}

// findShared fills the Shared overlaps of m.tiers: the shared pool's run
// after each worker's device match. The pool spans every shard.
func (ix *Index) findShared(m *Matcher, seq []uint64) {
	sc := &m.tiers
	sc.sharedRoot = 0
	any := false
	for i := range ix.shards {
		sh := &ix.shards[i]
		sh.mu.RLock()
		any = any || sh.lower[tierShared] != nil
		sh.mu.RUnlock()
	}
	if !any {
		return
	}
	sc.pool = slices.Grow(sc.pool[:0], len(seq))[:len(seq)]
	clear(sc.pool)
	run := func(from uint32) uint32 {
		for int(from) < len(seq) && ix.pooled(sc, seq, int(from)) {
			from++
		}
		return from
	}
	sc.sharedRoot = run(0)
	for i := range sc.out {
		o := &sc.out[i]
		o.Shared = run(o.Device) - o.Device
	}
}

// pooled says whether any worker holds seq[i] on the shared tier.
func (ix *Index) pooled(sc *tierScratch, seq []uint64, i int) bool {
	if sc.pool[i] == 0 {
		sc.pool[i] = 2
		for j := range ix.shards {
			sh := &ix.shards[j]
			sh.mu.RLock()
			if t := sh.lower[tierShared]; t != nil {
				if n, ok := t.bySeq.get(seq[i], &t.nodes); ok && t.nodes.at(n).held() {
					sc.pool[i] = 1
				}
			}
			sh.mu.RUnlock()
			if sc.pool[i] == 1 {
				break
			}
		}
	}
	return sc.pool[i] == 1
}

// HeldOn returns the sequence hashes of the blocks worker rank w holds on
// tier, in no particular order; false for a tier the index does not know.
func (ix *Index) HeldOn(w kv.Worker, tier kv.StorageTier) ([]uint64, bool) {
	lt, ok := lowerOf(tier)
	if !ok {
		return nil, false
	}
	sh := ix.shardOf(w)
	sh.mu.RLock()
	defer sh.mu.RUnlock()
	t := sh.tree(lt)
	if t == nil {
		return nil, true
	}
	s, ok := t.slotOf[w]
	if !ok {
		return nil, true
	}
	ws := &t.workers[s]
	out := make([]uint64, 0, ws.blocks.Len())
	seen := make(map[uint32]bool, ws.blocks.Len())
	ws.blocks.Range(func(_ uint64, n uint32) bool {
		if !seen[n] {
			seen[n] = true
			out = append(out, t.nodes.at(n).seq())
		}
		return true
	})
	return out, true
}
