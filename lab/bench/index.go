// Package bench holds kvrouter's benchmark harnesses. IndexBench replays a
// request trace against core/index the way a KV-routed fleet would feed
// it, and measures the index alone.
package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/index"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/lab/trace"
)

// IndexConfig configures IndexBench. Zero values take the defaults noted.
type IndexConfig struct {
	Workers        int    // simulated engines (default 64)
	GroupSize      int    // engines per group; group c serves copy c of the trace (default 8)
	CapacityBlocks int    // blocks each engine caches (default 16384)
	BlockSize      int    // router block size, must divide 512 (default 16)
	Threads        int    // replay goroutines, each owning disjoint groups (default GOMAXPROCS)
	Shards         int    // index write parallelism, --router-event-threads (default 4)
	MaxPairs       uint64 // index memory cap in (block, worker) pairs; 0 = none
	Seed           uint64 // engine ids and tie-breaking
	// StepTokens is the engines' token budget per scheduler step
	// (--max-num-batched-tokens, default 8192): each KV event carries the
	// blocks of at most this many tokens, as an engine's events do.
	StepTokens int

	// TraceLengthFactor stretches every request's chain of hash ids by this
	// factor (trace.Stretch; default 1), TraceDuplication replays that many
	// disjoint copies of the trace through every group, interleaved request
	// by request (default 1): Dynamo's indexer benchmarks shape their
	// workload with the same two knobs.
	TraceLengthFactor int
	TraceDuplication  int

	// The run stops at Duration or after MaxRequests requests, whichever
	// comes first; at least one must be set.
	Duration    time.Duration
	MaxRequests int64

	// Chunk is how many consecutive trace requests a goroutine replays on one
	// group before moving to its next group (default 1: strict round robin,
	// so every group, and the whole index, grows from the start). Groups are
	// independent, so this only changes interleaving; larger chunks warm the
	// hash cache but leave later groups idle early in a run.
	Chunk int
	// HashCacheEntries sizes each goroutine's cache of per-id hashes
	// (default trace.DefaultCacheEntries).
	HashCacheEntries int

	// Pregenerate records every request's lookup and the engines' events
	// first, with routing decided on the engines' own caches, and then
	// times only their replay against the index, as Dynamo's indexer
	// benchmarks do: the simulated engines and the prompt hashing stay out
	// of the measured time. Needs MaxRequests.
	Pregenerate bool

	// Progress, if set, receives one line per second: requests done and
	// throughput so far.
	Progress io.Writer
}

// IndexReport is the outcome of IndexBench; it marshals to the bench's JSON.
type IndexReport struct {
	// OpsPerSec counts FindMatches calls plus events applied, per second of
	// wall time.
	OpsPerSec float64 `json:"ops_per_sec"`
	// BlockOpsPerSec counts blocks looked up by FindMatches plus blocks
	// stored plus blocks removed, per second.
	BlockOpsPerSec float64 `json:"block_ops_per_sec"`
	// DynamoBlockOpsPerSec leaves removed blocks out: blocks offered to
	// FindMatches plus blocks stored, per second, the count behind Dynamo's
	// indexer throughput figures, so the two compare directly.
	DynamoBlockOpsPerSec float64 `json:"dynamo_block_ops_per_sec"`
	DynamoBlockOps       uint64  `json:"dynamo_block_ops"`
	FindMatchesP50us     float64 `json:"find_matches_p50_us"`
	FindMatchesP99us     float64 `json:"find_matches_p99_us"`
	ApplyP50us           float64 `json:"apply_p50_us"`
	ApplyP99us           float64 `json:"apply_p99_us"`
	Requests             uint64  `json:"requests"`
	FindMatches          uint64  `json:"find_matches"`
	Events               uint64  `json:"events"`
	BlocksLookedUp       uint64  `json:"blocks_looked_up"`
	BlocksStored         uint64  `json:"blocks_stored"`
	BlocksRemoved        uint64  `json:"blocks_removed"`
	ApplyErrors          uint64  `json:"apply_errors"`
	// OverlapMismatches counts requests where the index's overlap for the
	// chosen engine differed from the engine's real cached prefix. Always 0
	// without a memory cap; with one, evicted pairs show up here.
	OverlapMismatches uint64 `json:"overlap_mismatches"`
	// CrossGroupMatches counts matches on engines outside the request's
	// group; copies are disjoint, so it is 0.
	CrossGroupMatches uint64 `json:"cross_group_matches"`
	// LookupWaits counts lookups of a shard that found a writer in it and
	// waited for it (index.Stats.LookupWaits).
	LookupWaits  uint64 `json:"lookup_waits"`
	IndexedPairs uint64 `json:"indexed_pairs"`
	// IndexHeapBytes is the heap the index holds: HeapAlloc after a GC with
	// the index alive minus HeapAlloc after dropping it and collecting again.
	IndexHeapBytes uint64  `json:"index_heap_bytes"`
	BytesPerPair   float64 `json:"bytes_per_pair"`
	// HeapInuseBytes is the process's in-use heap at the end of the run,
	// harness included.
	HeapInuseBytes uint64 `json:"heap_inuse_bytes"`
	// HitRate is overlap blocks / request blocks, from the index.
	HitRate        float64 `json:"hit_rate"`
	HashCacheHit   float64 `json:"hash_cache_hit_rate"`
	Workers        int     `json:"workers"`
	Groups         int     `json:"groups"`
	GroupSize      int     `json:"group_size"`
	CapacityBlocks int     `json:"capacity_blocks"`
	BlockSize      int     `json:"block_size"`
	StepTokens     int     `json:"max_num_batched_tokens"`
	Threads        int     `json:"threads"`
	Shards         int     `json:"shards"`
	// WriterPerShard: every index shard took events from one replay
	// goroutine only (more goroutines than shards cannot have it).
	WriterPerShard bool    `json:"writer_per_shard"`
	MaxPairs       uint64  `json:"max_pairs"`
	Seed           uint64  `json:"seed"`
	DurationS      float64 `json:"duration_s"`

	TraceLengthFactor int  `json:"trace_length_factor"`
	TraceDuplication  int  `json:"trace_duplication_factor"`
	Pregenerated      bool `json:"pregenerated"`
	// PregenerateS is the wall time spent recording the run before it was
	// timed (Pregenerate only).
	PregenerateS float64 `json:"pregenerate_s,omitempty"`
}

func (c *IndexConfig) defaults() error {
	if c.Workers <= 0 {
		c.Workers = 64
	}
	if c.GroupSize <= 0 {
		c.GroupSize = 8
	}
	if c.CapacityBlocks <= 0 {
		c.CapacityBlocks = 16384
	}
	if c.BlockSize <= 0 {
		c.BlockSize = 16
	}
	if trace.BlockTokens%c.BlockSize != 0 {
		return fmt.Errorf("bench: block size %d does not divide %d", c.BlockSize, trace.BlockTokens)
	}
	if c.StepTokens <= 0 {
		c.StepTokens = 8192
	}
	if c.StepTokens < c.BlockSize {
		return fmt.Errorf("bench: a step of %d tokens holds no %d-token block", c.StepTokens, c.BlockSize)
	}
	if c.Shards <= 0 {
		c.Shards = index.DefaultShards
	}
	if c.Threads <= 0 {
		c.Threads = runtime.GOMAXPROCS(0)
	}
	if c.Chunk <= 0 {
		c.Chunk = 1
	}
	if c.TraceLengthFactor <= 0 {
		c.TraceLengthFactor = 1
	}
	if c.TraceDuplication <= 0 {
		c.TraceDuplication = 1
	}
	if c.Duration <= 0 && c.MaxRequests <= 0 {
		return errors.New("bench: set a duration or a request count")
	}
	if c.Pregenerate && c.MaxRequests <= 0 {
		return errors.New("bench: a pregenerated run needs a request count")
	}
	return nil
}

// group is GroupSize engines serving one copy of the trace.
type group struct {
	copy    int
	ids     []uint64 // engines' worker ids
	engines []*engineCache
	rot     int

	// Load: how many of the group's last len(window) requests each engine
	// took, and the bound above which an engine is passed over.
	window []uint16
	filled int
	next   int
	recent []int
	bound  int
}

func newGroup(copy int, ids []uint64, engines []*engineCache, seed uint64) *group {
	ne := len(engines)
	win := loadWindowPerEngine * ne
	// At most (1 + loadSlack) times the fair share of the window, and
	// fewer than win/(ne-1): then the other engines can never fill the
	// window between them, so an engine that no request favours (one that
	// lacks even the system prompt) still gets its turn.
	bound := int(math.Ceil(float64(win) * (1 + loadSlack) / float64(ne)))
	if ne > 1 {
		bound = min(bound, (win+ne-2)/(ne-1)-1)
	}
	return &group{
		copy: copy, ids: ids, engines: engines,
		rot:    int(mix64(seed+uint64(copy)) % uint64(ne)),
		window: make([]uint16, win),
		recent: make([]int, ne),
		bound:  bound,
	}
}

// Bounded-load routing: among the group's last loadWindowPerEngine × G
// requests an engine may take at most about (1 + loadSlack) times its fair
// share (see newGroup). Without a bound, every request, since all share
// block 0 (the system prompt), would follow the first engine that cached
// it, and one engine per group would serve everything.
const (
	loadWindowPerEngine = 8
	loadSlack           = 0.25
)

// choose picks the engine for a request given each engine's overlap: the
// most overlap among engines within the load bound; ties go to the engine
// with fewer recent requests, then to the first in the group's rotating
// order (which advances every request). Deterministic given the seed.
func (g *group) choose(overlap []uint32) int {
	ne := len(g.engines)
	// The oldest request leaves the window before the choice, not after:
	// the other len(window)-1 requests then leave some engine below the
	// bound (bound·ne ≥ len(window)), where a full window could hold every
	// engine at it in groups of more than 9.
	if g.filled == len(g.window) {
		g.recent[g.window[g.next]]--
	} else {
		g.filled++
	}
	best := -1
	for j := range ne {
		k := g.rot + j
		if k >= ne {
			k -= ne
		}
		if g.recent[k] >= g.bound {
			continue
		}
		if best < 0 || overlap[k] > overlap[best] ||
			(overlap[k] == overlap[best] && g.recent[k] < g.recent[best]) {
			best = k
		}
	}
	if g.rot++; g.rot == ne {
		g.rot = 0
	}
	g.window[g.next] = uint16(best)
	g.recent[best]++
	if g.next++; g.next == len(g.window) {
		g.next = 0
	}
	return best
}

// counters are one goroutine's totals, read atomically by the progress
// reporter.
type counters struct {
	requests, ops, blockOps atomic.Uint64
	_                       [40]byte
}

type runner struct {
	cfg    IndexConfig
	tr     *trace.Trace
	ix     *index.Index
	groups []*group
	// member places a worker id: its group and its position there.
	member []member
	// aligned: every shard is written by one replay goroutine (engineIDs).
	aligned bool
	stop    atomic.Bool
	issued  atomic.Int64 // requests claimed, for MaxRequests
}

type member struct {
	group, k int32 // group -1: no engine has this id
}

// memberOf places worker id, or reports that no engine has it.
func (r *runner) memberOf(id uint64) (member, bool) {
	if id >= uint64(len(r.member)) || r.member[id].group < 0 {
		return member{}, false
	}
	return r.member[id], true
}

// engineIDs names the engines of each group (group g is replayed by
// goroutine g mod threads) so that every goroutine's engines fall in index
// shards no other goroutine writes: one writer per shard, as the Flash
// Indexer has one event thread per partition of the workers. Events of
// one shard from two goroutines would take turns at its lock, one
// goroutine idle while the other writes. With more goroutines than shards
// that cannot be had, and engines are numbered in order (aligned false).
func engineIDs(ix *index.Index, workers, groupSize, threads int) (ids [][]uint64, aligned bool) {
	groups := (workers + groupSize - 1) / groupSize
	ids = make([][]uint64, groups)
	size := func(g int) int { return min(groupSize, workers-g*groupSize) }
	inOrder := func() ([][]uint64, bool) {
		next := uint64(0)
		for g := range ids {
			ids[g] = ids[g][:0]
			for range size(g) {
				ids[g] = append(ids[g], next)
				next++
			}
		}
		return ids, false
	}
	if threads <= 1 || threads > ix.Shards() {
		return inOrder()
	}
	// open[t] lists goroutine t's groups still short of engines; ids are
	// taken in order, each by the goroutine that owns its shard. The
	// shards' hash spreads ids evenly, so a few times workers ids suffice;
	// the bound only keeps a degenerate hash from looping for ever.
	open := make([][]int, threads)
	for g := groups - 1; g >= 0; g-- {
		open[g%threads] = append(open[g%threads], g)
	}
	for id, left := uint64(0), workers; left > 0; id++ {
		if id > uint64(64*workers+1024) {
			return inOrder()
		}
		t := ix.ShardOf(kv.Worker{ID: id}) % threads
		if len(open[t]) == 0 {
			continue
		}
		g := open[t][len(open[t])-1]
		ids[g] = append(ids[g], id)
		left--
		if len(ids[g]) == size(g) {
			open[t] = open[t][:len(open[t])-1]
		}
	}
	return ids, true
}

// replayer is one goroutine's state.
type replayer struct {
	r      *runner
	ix     *index.Index
	groups []*group
	cache  *trace.HashCache
	m      index.Matcher
	cnt    *counters

	seq, local []uint64
	overlap    []uint32
	sc         serveScratch
	parent     uint64
	ev         kv.Event

	// log, when set, receives the run's operations instead of the index
	// (recording a pregenerated run) and is then played (see play).
	log       *opLog
	recording bool
	// stepBlocks is the most blocks one event carries (StepTokens).
	stepBlocks int

	fm, apply                           histogram
	findMatches, events                 uint64
	lookedUp, stored, removed, hits     uint64
	applyErrors, mismatches, crossGroup uint64
}

// IndexBench replays tr against a fresh index with cfg and reports the
// throughput and latency of the index. It returns early, with what was
// measured, if ctx is cancelled.
func IndexBench(ctx context.Context, tr *trace.Trace, cfg IndexConfig) (*IndexReport, error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	if len(tr.Requests) == 0 {
		return nil, errors.New("bench: empty trace")
	}
	tr, err := tr.Stretch(cfg.TraceLengthFactor)
	if err != nil {
		return nil, err
	}
	hasher := blockhash.New(cfg.BlockSize, "")
	r := &runner{cfg: cfg, tr: tr, ix: index.New(index.Config{Shards: cfg.Shards, MaxPairs: cfg.MaxPairs})}
	threads := min(cfg.Threads, (cfg.Workers+cfg.GroupSize-1)/cfg.GroupSize)
	groupIDs, aligned := engineIDs(r.ix, cfg.Workers, cfg.GroupSize, threads)
	r.aligned = aligned
	for g, ids := range groupIDs {
		var engines []*engineCache
		for _, id := range ids {
			engines = append(engines, newEngineCache(cfg.CapacityBlocks, mix64(cfg.Seed^mix64(id+1))))
			// As the router does when an engine registers its KV capacity.
			r.ix.Reserve(kv.Worker{ID: id}, cfg.CapacityBlocks)
			for uint64(len(r.member)) <= id {
				r.member = append(r.member, member{group: -1})
			}
			r.member[id] = member{group: int32(g), k: int32(len(engines) - 1)}
		}
		r.groups = append(r.groups, newGroup(g, ids, engines, cfg.Seed))
	}
	if len(r.groups)*cfg.TraceDuplication > trace.MaxCopies {
		return nil, fmt.Errorf("bench: %d groups of %d copies each exceed %d trace copies", len(r.groups), cfg.TraceDuplication, trace.MaxCopies)
	}
	reps := make([]*replayer, threads)
	cnts := make([]counters, threads)
	for t := range reps {
		cache, err := trace.NewHashCache(tr, hasher, cfg.HashCacheEntries)
		if err != nil {
			return nil, err
		}
		rp := &replayer{r: r, ix: r.ix, cache: cache, cnt: &cnts[t], overlap: make([]uint32, cfg.GroupSize), stepBlocks: cfg.StepTokens / cfg.BlockSize}
		for g := t; g < len(r.groups); g += threads {
			rp.groups = append(rp.groups, r.groups[g])
		}
		reps[t] = rp
	}

	var pregenerate time.Duration
	if cfg.Pregenerate {
		t0 := time.Now()
		if cfg.Progress != nil {
			fmt.Fprintf(cfg.Progress, "recording %d requests\n", cfg.MaxRequests)
		}
		var wg sync.WaitGroup
		for _, rp := range reps {
			rp.log, rp.recording = &opLog{}, true
			wg.Go(rp.run)
		}
		wg.Wait()
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		for t, rp := range reps {
			cache, log := rp.cache, rp.log
			*rp = replayer{r: r, ix: r.ix, cache: cache, cnt: &cnts[t], log: log}
			cnts[t] = counters{}
		}
		r.stop.Store(false)
		pregenerate = time.Since(t0)
	}

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if cfg.Duration > 0 {
		ctx, cancel = context.WithTimeout(ctx, cfg.Duration)
		defer cancel()
	}
	go func() {
		<-ctx.Done()
		r.stop.Store(true)
	}()
	start := time.Now()
	progressDone := make(chan struct{})
	if cfg.Progress != nil {
		go progress(ctx, cfg.Progress, start, cnts, progressDone)
	} else {
		close(progressDone)
	}
	var wg sync.WaitGroup
	for _, rp := range reps {
		if rp.log != nil {
			wg.Go(rp.play)
		} else {
			wg.Go(rp.run)
		}
	}
	wg.Wait()
	elapsed := time.Since(start)
	cancel()
	<-progressDone

	rep := &IndexReport{
		Workers: cfg.Workers, Groups: len(r.groups), GroupSize: cfg.GroupSize, CapacityBlocks: cfg.CapacityBlocks,
		BlockSize: cfg.BlockSize, StepTokens: cfg.StepTokens, Threads: threads, Shards: cfg.Shards, WriterPerShard: r.aligned, MaxPairs: cfg.MaxPairs, Seed: cfg.Seed,
		DurationS: elapsed.Seconds(), TraceLengthFactor: cfg.TraceLengthFactor, TraceDuplication: cfg.TraceDuplication,
		Pregenerated: cfg.Pregenerate, PregenerateS: pregenerate.Seconds(),
	}
	var fm, ap histogram
	var cacheHits, cacheMisses uint64
	for _, rp := range reps {
		fm.merge(&rp.fm)
		ap.merge(&rp.apply)
		rep.Requests += rp.cnt.requests.Load()
		rep.FindMatches += rp.findMatches
		rep.Events += rp.events
		rep.BlocksLookedUp += rp.lookedUp
		rep.BlocksStored += rp.stored
		rep.BlocksRemoved += rp.removed
		rep.ApplyErrors += rp.applyErrors
		rep.OverlapMismatches += rp.mismatches
		rep.CrossGroupMatches += rp.crossGroup
		rep.HitRate += float64(rp.hits)
		cacheHits += rp.cache.Hits
		cacheMisses += rp.cache.Misses
	}
	if rep.BlocksLookedUp > 0 {
		rep.HitRate /= float64(rep.BlocksLookedUp)
	}
	if cacheHits+cacheMisses > 0 {
		rep.HashCacheHit = float64(cacheHits) / float64(cacheHits+cacheMisses)
	}
	secs := elapsed.Seconds()
	rep.OpsPerSec = float64(rep.FindMatches+rep.Events) / secs
	rep.BlockOpsPerSec = float64(rep.BlocksLookedUp+rep.BlocksStored+rep.BlocksRemoved) / secs
	rep.DynamoBlockOps = rep.BlocksLookedUp + rep.BlocksStored
	rep.DynamoBlockOpsPerSec = float64(rep.DynamoBlockOps) / secs
	rep.FindMatchesP50us = float64(fm.quantile(0.50)) / 1e3
	rep.FindMatchesP99us = float64(fm.quantile(0.99)) / 1e3
	rep.ApplyP50us = float64(ap.quantile(0.50)) / 1e3
	rep.ApplyP99us = float64(ap.quantile(0.99)) / 1e3

	// Memory. The index is reachable only from r.ix and the replayers:
	// measure with it alive, drop those references, measure again. The
	// harness (engine caches, hash caches) stays alive across both reads,
	// so the difference is the index's own heap.
	rep.IndexedPairs = r.ix.Pairs()
	rep.LookupWaits = r.ix.Stats().LookupWaits
	var ms runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&ms)
	rep.HeapInuseBytes = ms.HeapInuse
	withIndex := ms.HeapAlloc
	r.ix = nil
	for _, rp := range reps {
		rp.ix = nil
	}
	runtime.GC()
	runtime.ReadMemStats(&ms)
	if withIndex > ms.HeapAlloc {
		rep.IndexHeapBytes = withIndex - ms.HeapAlloc
	}
	if rep.IndexedPairs > 0 {
		rep.BytesPerPair = float64(rep.IndexHeapBytes) / float64(rep.IndexedPairs)
	}
	runtime.KeepAlive(r)
	runtime.KeepAlive(reps)
	return rep, nil
}

func progress(ctx context.Context, w io.Writer, start time.Time, cnts []counters, done chan<- struct{}) {
	defer close(done)
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	var lastOps uint64
	last := start
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-tick.C:
			var req, ops, bops uint64
			for i := range cnts {
				req += cnts[i].requests.Load()
				ops += cnts[i].ops.Load()
				bops += cnts[i].blockOps.Load()
			}
			el := now.Sub(start).Seconds()
			fmt.Fprintf(w, "%6.1fs  requests %9d  ops/s %10.0f (now %10.0f)  block ops/s %11.0f\n",
				el, req, float64(ops)/el, float64(ops-lastOps)/now.Sub(last).Seconds(), float64(bops)/el)
			lastOps, last = ops, now
		}
	}
}

// run replays the trace over the goroutine's groups: Chunk consecutive
// requests on one group, then the same span on the next group, looping
// over the trace until the run stops. With TraceDuplication d, group g's
// stream is every trace request in copies g·d … g·d+d-1 in turn.
func (rp *replayer) run() {
	r := rp.r
	reqs := r.tr.Requests
	chunk := r.cfg.Chunk
	dup := r.cfg.TraceDuplication
	for base := 0; ; base += chunk {
		for _, g := range rp.groups {
			for i := base; i < base+chunk; i++ {
				if r.stop.Load() {
					return
				}
				if r.cfg.MaxRequests > 0 && r.issued.Add(1) > r.cfg.MaxRequests {
					r.stop.Store(true)
					return
				}
				rp.serve(g, &reqs[i/dup%len(reqs)], g.copy*dup+i%dup)
			}
		}
	}
}

// serve routes one request, in trace copy cp, within group g and plays the
// chosen engine's cache response back to the index as events.
func (rp *replayer) serve(g *group, req *trace.Request, cp int) {
	rp.seq, rp.local = rp.cache.AppendSequence(rp.seq[:0], rp.local[:0], req, cp)
	seq := rp.seq
	n := len(seq)
	if n == 0 {
		rp.cnt.requests.Add(1)
		return
	}

	clear(rp.overlap)
	if rp.recording {
		for k, eng := range g.engines {
			rp.overlap[k] = uint32(eng.cachedPrefix(seq))
		}
	} else {
		t0 := time.Now()
		ov := rp.ix.FindMatches(&rp.m, seq)
		rp.fm.record(uint64(time.Since(t0)))
		rp.findMatches++
		rp.lookedUp += uint64(n)
		for _, o := range ov {
			if m, ok := rp.r.memberOf(o.Worker.ID); ok && int(m.group) == g.copy {
				rp.overlap[m.k] = o.Blocks
			} else {
				rp.crossGroup++
			}
		}
	}
	best := g.choose(rp.overlap)
	eng := g.engines[best]
	rp.hits += uint64(rp.overlap[best])
	if rp.recording {
		rp.log.recordFind(seq, kv.Worker{ID: g.ids[best]}, int(rp.overlap[best]))
	}

	hit, parent, hasParent := eng.serve(seq, rp.local, &rp.sc)
	if uint32(hit) != rp.overlap[best] {
		rp.mismatches++
	}
	w := kv.Worker{ID: g.ids[best]}
	ops := uint64(1)
	// Engines announce KV blocks per scheduler step, and a step computes at
	// most StepTokens tokens: a long prompt's blocks arrive in several
	// events, each chained to the one before, never in one.
	step := rp.stepBlocks
	for rest := rp.sc.removed; len(rest) > 0; {
		n := min(len(rest), step)
		eng.eventID++
		rp.ev = kv.Event{Worker: w, Tier: kv.TierDevice, EventID: eng.eventID, Kind: kv.KindRemoved,
			Removed: kv.Removed{EngineHashes: rest[:n]}}
		rp.applyEvent()
		rest = rest[n:]
		ops++
	}
	rp.removed += uint64(len(rp.sc.removed))
	for rest := rp.sc.blocks; len(rest) > 0; {
		n := min(len(rest), step)
		eng.eventID++
		rp.ev = kv.Event{Worker: w, Tier: kv.TierDevice, EventID: eng.eventID, Kind: kv.KindStored,
			Stored: kv.Stored{Blocks: rest[:n]}}
		if hasParent {
			rp.parent = parent
			rp.ev.Stored.Parent = &rp.parent
		}
		rp.applyEvent()
		parent, hasParent = rest[n-1].EngineHash, true
		rest = rest[n:]
		ops++
	}
	rp.stored += uint64(len(rp.sc.blocks))
	rp.cnt.requests.Add(1)
	rp.cnt.ops.Add(ops)
	rp.cnt.blockOps.Add(uint64(n + len(rp.sc.blocks) + len(rp.sc.removed)))
}

func (rp *replayer) applyEvent() {
	if rp.recording {
		rp.log.recordEvent(&rp.ev)
		return
	}
	t0 := time.Now()
	err := rp.ix.Apply(&rp.ev)
	rp.apply.record(uint64(time.Since(t0)))
	rp.events++
	if err != nil {
		rp.applyErrors++
	}
}
