// Package index keeps, for every worker rank, an exact record of the KV
// blocks it caches, fed by the workers' KV events, and answers the routing
// question: how many leading blocks of this request does each worker hold?
//
// It is pure: no I/O, no goroutines, no clock. Index (event-fed, exact, with
// an optional memory cap) and Approx (fed by routing decisions, expiring by
// TTL) share one tree representation; see tree.go.
//
// Contract for callers:
//   - Apply may be called from many goroutines. Events of one worker rank
//     must be applied in the order the worker emitted them; Index preserves
//     the order of the calls it receives for a rank (each rank belongs to
//     one shard, serialised by the shard's lock), so one goroutine per
//     event source is enough.
//   - FindMatches may run concurrently with Apply and with other reads.
//     It reads each shard under that shard's read lock, one after the
//     other, leaving shards a writer holds for last (see eachShard): every
//     worker's overlap is one it had at some moment of the call (a state
//     between two of its events, or between two blocks of one event;
//     TestLookupsSeeStatesTheIndexPassedThrough), but two workers of
//     different shards may be seen at different moments.
//   - Requests are matched by their sequence hashes (blockhash), events by
//     the blocks' local hashes; both must come from the same block size and
//     LoRA adapter. Workers of different block sizes share one index (their
//     hashes never collide); each is matched with hashes of its own size.
//
// How long a lookup waits for a writer. A writer holds a shard for at most
// one chunk of an event (applyChunk blocks), and for one block once a
// lookup waits for the shard (tree.lookupsWait): a lookup reads the shards
// no writer holds first, and then waits for one block's work of a writer
// that runs. A writer whose thread lost its core inside a shard still
// holds the lookups of that shard until it runs again.
//
// Why lookups still take the shard's read lock. A lookup that never waits
// must read, in any state a writer may leave a shard in when its thread
// stops anywhere, every structure it walks: the sequence-hash table (a
// removal shifts entries back, a resize replaces a part), nodes (freed and
// reused for other blocks), holder sets (grown, swapped in place, freed
// and reused for other nodes), the paged arrays' headers and the worker
// ids. A sequence lock alone cannot serve a reader while a writer is
// inside a block's change, which is where a writer that lost its core most
// often stops (docs/benchmarks.md "A sequence lock, measured"), and a
// version per node or a published copy of the lookup's structures breaks
// the 64-byte budget of a (block, worker) pair: a pair costs 62 bytes and
// at 1000 workers a node has 1.00–1.01 holders, so 4 bytes a node are 4 a
// pair. A design that fits (docs/benchmarks.md "Lookups that never wait:
// the ceiling again, and a design within 64 bytes") makes each change a
// lookup can observe one atomic store of a node's holder word, counted by
// a per-shard counter a lookup checks around its walk, with the table
// deleting by tombstone, holder sets copied on write and freed nodes and
// sets reused only after a grace period. A prototype of it, reading the
// tree without atomics, took bench index's find_matches p99 from
// 0.45–6.3 ms to 17.5–47 µs at 1000 workers, with no more bytes a pair,
// and made the writer slower; it still fails one run in 600 of
// TestLookupsSeeStatesTheIndexPassedThrough. Until it passes that and its
// reads are ones the race detector accepts, lookups keep the lock.
// Dynamo's Flash Indexer does not avoid locks either: its lookups take a
// read lock on each node (or run) they step through, and only the root's
// child table is published read-only, under epoch-based reclamation; each
// event thread owns its workers, as each shard here has one writer per
// event source.
package index

import (
	"cmp"
	"errors"
	"math/bits"
	"runtime"
	"sync/atomic"

	"github.com/kvrouter/kvrouter/core/kv"
)

// Errors returned by Apply. In every case the event was counted and
// skipped as a whole; the index is unchanged.
var (
	ErrUnknownParent = errors.New("index: stored event names a parent block the worker does not hold")
	ErrEmptyStored   = errors.New("index: stored event without blocks")
	ErrUnknownKind   = errors.New("index: event of unknown kind")
)

// Overlap is one worker's share of a match: the number of leading blocks
// of the request it holds.
type Overlap struct {
	Worker kv.Worker
	Blocks uint32
}

// Stats counts what the index did; every field only grows.
type Stats struct {
	Events, StoredEvents, RemovedEvents, ClearedEvents uint64
	BlocksStored, BlocksRemoved                        uint64
	// Rejections and skips, by cause.
	UnknownParent   uint64 // stored events rejected whole
	EmptyStored     uint64 // stored events without blocks
	UnknownBlocks   uint64 // removed hashes the worker never stored
	DuplicateBlocks uint64 // stored hashes the worker already had
	UnknownKind     uint64
	// PairsEvicted counts (block, worker) pairs dropped by the memory cap.
	PairsEvicted uint64
	// BlocksOverBound counts stored blocks refused because their rank
	// held its bound (see RankBound).
	BlocksOverBound uint64
	// Reanchored counts stored events whose unknown parent Config.Locate
	// placed; BlocksInferred the blocks above it held on that evidence.
	Reanchored, BlocksInferred uint64
	// LookupWaits counts lookups of a shard that found it taken by a
	// writer and waited.
	LookupWaits uint64
	// UnknownTier counts events of a storage tier the index does not know.
	UnknownTier uint64
}

func (s *Stats) add(o Stats) {
	s.Events += o.Events
	s.StoredEvents += o.StoredEvents
	s.RemovedEvents += o.RemovedEvents
	s.ClearedEvents += o.ClearedEvents
	s.BlocksStored += o.BlocksStored
	s.BlocksRemoved += o.BlocksRemoved
	s.UnknownParent += o.UnknownParent
	s.EmptyStored += o.EmptyStored
	s.UnknownBlocks += o.UnknownBlocks
	s.DuplicateBlocks += o.DuplicateBlocks
	s.UnknownKind += o.UnknownKind
	s.PairsEvicted += o.PairsEvicted
	s.BlocksOverBound += o.BlocksOverBound
	s.Reanchored += o.Reanchored
	s.BlocksInferred += o.BlocksInferred
	s.LookupWaits += o.LookupWaits
	s.UnknownTier += o.UnknownTier
}

// Config tunes an Index.
type Config struct {
	// Shards is the write parallelism (--router-event-threads): worker ranks
	// are spread over this many independently locked trees. Default 4.
	Shards int
	// MaxPairs caps the indexed (block, worker) pairs; beyond it the least
	// recently matched leaves are evicted. 0 means no cap.
	MaxPairs uint64
	// BudgetPairs, used when MaxPairs is 0, caps the pairs too, but evicts
	// leaves in no particular order: least recently matched would cost
	// every lookup a stamp per matched block and the skipping of levels
	// (see find), while a budget sized from memory is only a last resort
	// against running out of it. 0 means none.
	BudgetPairs uint64
	// PruneRatio is the fraction of MaxPairs an eviction pass brings the
	// index down to, so that passes are rare. Default 0.9.
	PruneRatio float64
	// Locate, when set, re-anchors stored events whose parent the worker
	// is not known to hold, instead of refusing them.
	Locate Locator
}

// Locator says where a stored event whose parent engine id is unknown
// hangs: the local hashes of the path from the root down to and including
// the parent block, or nil when it cannot tell. blocks are the event's
// blocks. The worker then holds that whole path (see Index.Inferred). It
// is called with the worker's shard locked and must not call the Index.
type Locator func(w kv.Worker, blocks []kv.Block) []uint64

// DefaultShards is the default of --router-event-threads.
const DefaultShards = 4

// Index is the exact, event-fed index of cached blocks. Safe for concurrent
// use; see the package contract.
type Index struct {
	shards     []shard
	maxPerShrd uint64
	pruneTo    uint64
	// hasLower is set once any shard holds a lower tier (see tiers.go);
	// until then lookups skip the tiers entirely.
	hasLower atomic.Bool
}

type shard struct {
	// mu guards t. Writers (Apply, removals, eviction) hold it exclusively;
	// FindMatches holds it shared and only writes node stamps, atomically.
	mu shardLock
	t  *tree
	// lower are the trees of the lower tiers, made on their first event.
	lower    [lowerTiers]*tree
	hasLower bool
	_        [32]byte // keep neighbouring shard locks off one cache line
}

// New returns an empty Index.
func New(cfg Config) *Index {
	if cfg.Shards <= 0 {
		cfg.Shards = DefaultShards
	}
	if cfg.PruneRatio <= 0 || cfg.PruneRatio >= 1 {
		cfg.PruneRatio = 0.9
	}
	ix := &Index{shards: make([]shard, cfg.Shards)}
	for i := range ix.shards {
		ix.shards[i].t = newTree(cfg.MaxPairs > 0)
		ix.shards[i].t.locate = cfg.Locate
		ix.shards[i].t.readersWaiting = &ix.shards[i].mu.waitingReaders
	}
	if limit := cmp.Or(cfg.MaxPairs, cfg.BudgetPairs); limit > 0 {
		ix.maxPerShrd = max(1, limit/uint64(cfg.Shards))
		ix.pruneTo = uint64(float64(ix.maxPerShrd) * cfg.PruneRatio)
	}
	return ix
}

func (ix *Index) shardOf(w kv.Worker) *shard { return &ix.shards[ix.ShardOf(w)] }

// ShardOf is the shard, in [0, Shards()), whose lock serialises worker
// rank w's events. Two goroutines applying events of one shard take turns
// at its lock, one waiting while the other writes; event sources that give
// each applying goroutine whole shards (one writer per shard, as Dynamo's
// Flash Indexer has one event thread per worker partition) never wait on
// each other.
func (ix *Index) ShardOf(w kv.Worker) int {
	h := w.ID*0x9e3779b97f4a7c15 ^ uint64(w.DPRank)*0xbf58476d1ce4e5b9
	h ^= h >> 29
	return int(h % uint64(len(ix.shards)))
}

// Shards is the number of independently locked shards.
func (ix *Index) Shards() int { return len(ix.shards) }

// Apply applies one event to its storage tier. A rejected event (unknown
// tier, unknown parent, no blocks, unknown kind) is counted and leaves the
// index unchanged; removals of blocks the worker never stored are counted
// and skipped one by one.
func (ix *Index) Apply(ev *kv.Event) error {
	// An event source applies events back to back while they keep
	// coming, and the Go scheduler preempts a goroutine that has run for
	// 10 ms without yielding wherever it stands: often inside a shard,
	// where every lookup of that shard then waits until the preempted
	// writer gets a processor back, behind every runnable goroutine. A
	// writer that yields before each event is never preempted that way.
	// Measured (bench overhead, speedup 1000, the frontend at
	// GOMAXPROCS=1): find_matches p99 55 ms without, 0.36 ms with.
	runtime.Gosched()
	sh := ix.shardOf(ev.Worker)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	t, lt := sh.t, -1
	if ev.Tier != kv.TierDevice {
		var ok bool
		if lt, ok = lowerOf(ev.Tier); !ok {
			t.stats.Events++
			t.stats.UnknownTier++
			return ErrUnknownTier
		}
		switch {
		case lt < 0:
		case sh.lower[lt] != nil || ev.Kind == kv.KindStored:
			t = ix.lowerTree(sh, lt)
		case ev.Kind == kv.KindRemoved:
			// Nothing to remove from a tier never stored to; making its
			// tree would only take every lookup off the device-only path.
			t.stats.Events++
			t.stats.RemovedEvents++
			t.stats.UnknownBlocks += uint64(len(ev.Removed.EngineHashes))
			return nil
		case ev.Kind == kv.KindCleared:
			t.stats.Events++
			t.stats.ClearedEvents++
			return nil
		}
	}
	t.stats.Events++
	var err error
	switch ev.Kind {
	case kv.KindStored:
		t.stats.StoredEvents++
		err = storeChunked(sh, t, ev)
		if err == nil && ix.maxPerShrd > 0 && sh.pairs() > ix.maxPerShrd {
			sh.evictTo(ix.pruneTo)
		}
		t.renormalizeTicks()
	case kv.KindRemoved:
		t.stats.RemovedEvents++
		removeChunked(sh, t, ev)
	case kv.KindCleared:
		t.stats.ClearedEvents++
		if lt >= 0 {
			t.clearWorker(ev.Worker)
			break
		}
		// A clear of the device (engines' reset, which names no medium,
		// and the clears routers and event sources make before rebuilding
		// a rank from a dump or after a lost history) drops the rank on
		// every tier: what follows rebuilds every tier.
		for i := -1; i < lowerTiers; i++ {
			if tt := sh.tree(i); tt != nil {
				tt.clearWorker(ev.Worker)
			}
		}
	default:
		t.stats.UnknownKind++
		err = ErrUnknownKind
	}
	return err
}

// applyChunk bounds how many blocks one writer applies per hold of a
// shard's lock. Engines publish hundreds of blocks per event; readers
// waiting behind a whole event would see its full cost in their latency.
// At 1000 workers (bench index, two runs each) chunks of 64 left lookups a
// p99 of 118–146 µs, 32 gave 102–115 and 16 gave 89–94, with the same
// throughput: a chunk's warm pass still has 16 loads to overlap.
const applyChunk = 16

// storeChunked applies a stored event with sh.mu held, releasing it
// between chunks, and after the next block while a lookup waits for the
// shard. Readers may see a prefix of the chain meanwhile, which is a state
// the worker was in anyway. If another writer removed the point the chain
// hangs from, the rest is refused like an unknown parent.
func storeChunked(sh *shard, t *tree, ev *kv.Event) error {
	s, cur, err := t.beginStored(ev.Worker, &ev.Stored)
	if err != nil {
		return err
	}
	blocks := ev.Stored.Blocks
	for {
		n := min(len(blocks), applyChunk)
		if bound := t.workers[s].bound; bound > 0 {
			if room := bound - t.workers[s].blocks.Len(); room < n {
				t.overBound(s, len(blocks)-max(room, 0))
				blocks, n = blocks[:max(room, 0)], max(room, 0)
			}
		}
		cur, n = t.storeBlocks(s, cur, blocks[:n])
		t.unplace()
		if blocks = blocks[n:]; len(blocks) == 0 {
			return nil
		}
		sh.mu.Unlock()
		sh.mu.Lock()
		if !t.stillAt(ev.Worker, s, cur) {
			t.stats.UnknownParent++
			return ErrUnknownParent
		}
	}
}

// removeChunked applies a removed event with sh.mu held, releasing it
// between chunks, and after the next block while a lookup waits.
func removeChunked(sh *shard, t *tree, ev *kv.Event) {
	hashes := ev.Removed.EngineHashes
	for {
		n := min(len(hashes), applyChunk)
		n = t.applyRemoved(ev.Worker, &kv.Removed{EngineHashes: hashes[:n]})
		if hashes = hashes[n:]; len(hashes) == 0 {
			return
		}
		sh.mu.Unlock()
		sh.mu.Lock()
	}
}

// Reserve tells the index that worker rank w caches up to blocks blocks
// (an engine's num_gpu_blocks), so that its tables are sized once instead
// of growing block by block, and bounds what the rank may hold to
// RankBound(blocks). 0 forgets the capacity and lifts the bound.
func (ix *Index) Reserve(w kv.Worker, blocks int) {
	sh := ix.shardOf(w)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if blocks <= 0 {
		delete(sh.t.reserved, w)
	} else {
		sh.t.reserved[w] = blocks
	}
	if s, ok := sh.t.slotOf[w]; ok {
		if blocks > 0 {
			sh.t.workers[s].blocks.reserve(blocks)
		}
		sh.t.workers[s].bound = RankBound(blocks)
	}
	sh.t.reserveNodes()
}

// RankBound is the most blocks the index keeps for a rank that announced
// capacity blocks (0: unknown, no bound). An engine never holds more than
// its capacity, but its events may run ahead of it: a batch stores a
// request's blocks before it removes those they evicted, and a block stored
// under two ids counts twice. A quarter more, and rankBoundSlack blocks
// (a 16k-token prompt at 16 tokens a block) for small engines, absorb
// that; what goes beyond is a claim no engine can make, from a buggy or
// hostile one. The index then refuses the rest of the stored chain, its
// tail: every block still indexed is one the engine announced, no block is
// kept without its parent, and the engine's later removals of the
// refused blocks, like stored chains hanging below them, are counted and
// skipped as usual.
func RankBound(capacity int) int {
	if capacity <= 0 {
		return 0
	}
	return capacity + capacity/4 + rankBoundSlack
}

const rankBoundSlack = 1024

// OverBound is a rank whose stored blocks the index refused past its bound.
type OverBound struct {
	Worker  kv.Worker
	Bound   int    // RankBound of its capacity
	Blocks  int    // held now
	Refused uint64 // blocks refused since it was announced
}

// OverBound lists the ranks that went past their bound, in no particular
// order.
func (ix *Index) OverBound() []OverBound {
	var out []OverBound
	for i := range ix.shards {
		sh := &ix.shards[i]
		sh.mu.RLock()
		for w, n := range sh.t.refused {
			ob := OverBound{Worker: w, Bound: RankBound(sh.t.reserved[w]), Refused: n}
			if s, ok := sh.t.slotOf[w]; ok {
				ob.Blocks = sh.t.workers[s].blocks.Len()
			}
			out = append(out, ob)
		}
		sh.mu.RUnlock()
	}
	return out
}

// RemoveWorker drops every block of every rank of engine id, on every
// tier.
func (ix *Index) RemoveWorker(id uint64) {
	for i := range ix.shards {
		sh := &ix.shards[i]
		sh.mu.Lock()
		for j := -1; j < lowerTiers; j++ {
			if t := sh.tree(j); t != nil {
				t.removeWorkerID(id)
			}
		}
		sh.mu.Unlock()
	}
}

// RemoveRank drops every block of one worker rank, on every tier.
func (ix *Index) RemoveRank(w kv.Worker) {
	sh := ix.shardOf(w)
	sh.mu.Lock()
	for j := -1; j < lowerTiers; j++ {
		if t := sh.tree(j); t != nil {
			t.clearWorker(w)
		}
	}
	sh.mu.Unlock()
}

// Matcher holds the scratch memory of FindMatches. Reuse one per goroutine
// to keep lookups allocation-free; the zero value is ready.
type Matcher struct {
	sc      scratch
	out     []Overlap
	dropped []int32 // Predicted: the workers a lookup is extending
	tiers   tierScratch
}

// FindMatches returns, for every worker rank that holds the request's first
// block on the device, how many leading blocks of seq it holds there. seq
// are the request's sequence hashes. The result is valid until the next
// call on m; so are the lower tiers' overlaps (m.Tiers) it finds when the
// index holds any.
func (ix *Index) FindMatches(m *Matcher, seq []uint64) []Overlap {
	m.out = m.out[:0]
	m.tiers.out = m.tiers.out[:0]
	if ix.hasLower.Load() {
		return ix.findTiered(m, seq)
	}
	ix.eachShard(func(sh *shard) {
		m.out = sh.t.find(seq, &m.sc, m.out)
	})
	return m.out
}

// findTiered is FindMatches over every tier.
func (ix *Index) findTiered(m *Matcher, seq []uint64) []Overlap {
	ix.eachShard(func(sh *shard) {
		start := len(m.out)
		m.out = sh.t.find(seq, &m.sc, m.out)
		m.findLower(sh, seq, m.out[start:])
	})
	ix.findShared(m, seq)
	return m.out
}

// eachShard calls read on every shard, each under its read lock, in no
// particular order. A lookup's shards are read one after the other, each
// as it stood at that moment, so their order changes nothing it may
// answer; a shard a writer holds is left for later rather than waited
// for, and read once the writer has let go, while the lookup reads the
// others. It waits only when every shard it has left is held.
func (ix *Index) eachShard(read func(*shard)) {
	var later uint64 // shards a writer held, by bit
	for i := range ix.shards {
		sh := &ix.shards[i]
		if !sh.mu.tryRLock() {
			if i < 64 {
				later |= 1 << i
				continue
			}
			sh.mu.RLock()
		}
		read(sh)
		sh.mu.RUnlock()
	}
	for later != 0 {
		waited := true
		for rest := later; rest != 0; rest &= rest - 1 {
			i := bits.TrailingZeros64(rest)
			sh := &ix.shards[i]
			if sh.mu.tryRLock() {
				read(sh)
				sh.mu.RUnlock()
				later &^= 1 << i
				waited = false
			}
		}
		if waited {
			i := bits.TrailingZeros64(later)
			sh := &ix.shards[i]
			sh.mu.RLock()
			read(sh)
			sh.mu.RUnlock()
			later &^= 1 << i
		}
	}
}

// Blocks returns how many blocks worker rank w has indexed (the tree size
// used to break ties between equally good workers).
func (ix *Index) Blocks(w kv.Worker) int {
	sh := ix.shardOf(w)
	sh.mu.RLock()
	defer sh.mu.RUnlock()
	if s, ok := sh.t.slotOf[w]; ok {
		return sh.t.workers[s].blocks.Len()
	}
	return 0
}

// Held returns the sequence hashes of the blocks worker rank w holds on
// the device, in no particular order: the router's view of that rank's
// cache.
func (ix *Index) Held(w kv.Worker) []uint64 {
	out, _ := ix.HeldOn(w, kv.TierDevice)
	return out
}

// Inferred returns how many blocks worker rank w holds under ids the index
// inferred while re-anchoring (see Config.Locate) rather than learnt from
// its events. Such a block is dropped with the last block of w hanging
// from it, and takes the engine's id when an event names it.
func (ix *Index) Inferred(w kv.Worker) int {
	sh := ix.shardOf(w)
	sh.mu.RLock()
	defer sh.mu.RUnlock()
	if s, ok := sh.t.slotOf[w]; ok {
		return len(sh.t.workers[s].inferred)
	}
	return 0
}

// Pairs is the number of indexed (block, worker rank, tier) pairs.
func (ix *Index) Pairs() uint64 {
	var n uint64
	for i := range ix.shards {
		sh := &ix.shards[i]
		sh.mu.RLock()
		n += sh.pairs()
		sh.mu.RUnlock()
	}
	return n
}

// Stats returns the counters summed over shards.
func (ix *Index) Stats() Stats {
	var st Stats
	for i := range ix.shards {
		sh := &ix.shards[i]
		sh.mu.RLock()
		for j := -1; j < lowerTiers; j++ {
			if t := sh.tree(j); t != nil {
				st.add(t.stats)
			}
		}
		sh.mu.RUnlock()
		st.LookupWaits += sh.mu.readerWaits.Load()
	}
	return st
}
