// Package load predicts each worker's active load from the requests the
// router itself has sent it (the "slot manager" of SPEC §5).
//
// Engines report their real load late and coarsely; a router that waited for
// those reports would send a burst of requests to the same idle worker. So
// the router books every decision here the moment it makes it, and unbooks
// it when the stream ends, and scores candidates against that prediction.
//
// Decode load is counted in KV blocks. Prompt blocks are identified by their
// chained sequence hashes (package blockhash): two active requests on one
// worker that share a prefix share its blocks, so a block counts once per
// worker however many requests hold it. Prefill load is counted in prompt
// tokens not already cached on the worker, until the first output token.
//
// Because the hashes are chained, two prompts share block i only if they
// share blocks 0..i, so the active prompts form a trie, and the tracker keeps
// them as one radix trie for all workers rather than as a set of hashes.
// Booking or freeing a prompt then costs a few node visits and a run of
// integer compares instead of a hash-map operation per block, and scoring a
// prompt is one walk down the trie for every worker at once.
//
// The package does no I/O; time comes from an injected clock.
package load

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/core/buffers"
	"github.com/kvrouter/kvrouter/core/kv"
)

// Config fixes what a Tracker counts. The zero value counts nothing but
// requests; start from DefaultConfig, which matches the router's flag
// defaults (every --no-router-* flag maps to one switch turned off).
type Config struct {
	// BlockSize is the engines' KV block size in tokens; it converts cached
	// blocks to cached tokens for prefill and paces output blocks.
	// Values below 1 mean 16.
	BlockSize int
	// TrackActiveBlocks off makes every decode-block figure 0 and skips all
	// block bookkeeping (--no-router-track-active-blocks).
	TrackActiveBlocks bool
	// TrackPrefillTokens off makes every prefill figure 0, whatever a
	// request asks for (--no-router-track-prefill-tokens).
	TrackPrefillTokens bool
	// TrackOutputBlocks books a block each time a request's generated tokens
	// fill one (--router-track-output-blocks). Needs TrackActiveBlocks.
	TrackOutputBlocks bool
	// AssumeKVReuse is the default for Request.AssumeReuse and
	// Query.AssumeReuse (--no-router-assume-kv-reuse turns it off).
	AssumeKVReuse bool
	// RequestTTL frees requests whose end the router never saw (a lost
	// stream must not hold load forever). 0 means 300 s; negative disables
	// expiry.
	RequestTTL time.Duration
	// ExpiryInterval bounds how often the expiry scan runs, so that the
	// O(active requests) scan stays off the per-call cost. 0 means 30 s.
	ExpiryInterval time.Duration
	// Now is the clock; nil means time.Now. Tests inject a fake one.
	Now func() time.Time
}

// DefaultConfig returns the router's defaults: block size 16, active blocks
// and prefill tokens tracked, KV reuse assumed, output blocks not tracked,
// 300 s TTL checked at most every 30 s.
func DefaultConfig() Config {
	return Config{
		BlockSize:          16,
		TrackActiveBlocks:  true,
		TrackPrefillTokens: true,
		AssumeKVReuse:      true,
		RequestTTL:         300 * time.Second,
		ExpiryInterval:     30 * time.Second,
	}
}

// Request is one routing decision to book.
type Request struct {
	// Now is as in Query.
	Now    time.Time
	ID     string
	Worker kv.Worker
	// Blocks are the prompt's block sequence hashes from block 0, as
	// package blockhash chains them. The tracker relies on the chaining:
	// it shares a block between requests only as part of a common prefix,
	// so equal hashes on different paths would count twice.
	// The tracker copies them; the caller may reuse the slice.
	Blocks []uint64
	// ISL is the prompt length in tokens.
	ISL int
	// OverlapBlocks is how many leading prompt blocks Worker already caches.
	OverlapBlocks int
	// OSL is the expected output length in tokens (agent_hints.osl); 0 means
	// unknown, and output blocks then keep full weight.
	OSL int
	// TrackPrefill and AssumeReuse are the nvext per-request overrides; nil
	// means "use the Config". They are pointers because "not given" must
	// differ from "false". TrackPrefill can only turn tracking off: with
	// Config.TrackPrefillTokens off nothing is counted.
	//
	// Without reuse the prompt blocks are booked as a count of blocks
	// private to the request rather than under random hashes: the loads are
	// the same, a count can never collide, and it costs no trie nodes.
	TrackPrefill *bool
	AssumeReuse  *bool
	// TrackBlocks false books no active blocks for the request: it runs on
	// a prefill-only engine of a disaggregated pool, which frees its KV
	// once the decode engine has pulled it, and never decodes. Like
	// TrackPrefill it can only turn tracking off.
	TrackBlocks *bool
}

// Query describes a request being scored, before any worker is chosen.
type Query struct {
	// Now, when set, is the caller's reading of the tracker's clock
	// (Config.Now): a router that has read it for its decision spares the
	// tracker a read.
	Now time.Time
	// WorkersID, when not 0, names the workers list PotentialLoads is
	// given: a list passed again under the same WorkersID must be the same
	// list, unchanged, and the tracker then trusts its cached slots for it
	// without comparing the list, a thousandth of a decision per worker.
	WorkersID uint64
	// Blocks are the prompt's block sequence hashes.
	Blocks []uint64
	// ISL is the prompt length in tokens.
	ISL int
	// TrackPrefill and AssumeReuse are the same overrides as in Request.
	// Without reuse, every prompt block counts as new on every worker.
	TrackPrefill *bool
	AssumeReuse  *bool
	TrackBlocks  *bool
}

// WorkerLoad is a worker's predicted load now.
type WorkerLoad struct {
	// ActiveDecodeBlocks is fractional because output blocks decay with an
	// OSL hint.
	ActiveDecodeBlocks  float64
	ActivePrefillTokens int
	ActiveRequests      int
}

// Potential is a worker's load now and what it would be with the queried
// request added. The potential figures are 0 when their kind of load is
// not tracked, like the current ones.
type Potential struct {
	Worker kv.Worker
	WorkerLoad
	PotentialDecodeBlocks  float64
	PotentialPrefillTokens int
}

// Stats are cumulative counters for metrics, plus current sizes.
type Stats struct {
	Added   uint64 // requests booked
	Freed   uint64 // requests released by Free
	Expired uint64 // requests released by the TTL
	Dropped uint64 // requests released by RemoveWorker

	Active  int // requests booked now
	Workers int // workers with a slot (seen and not removed)
	Blocks  int // distinct prompt block hashes active on any worker
}

// ErrDuplicateRequest is returned by AddRequest for an ID already active.
var ErrDuplicateRequest = errors.New("load: duplicate request id")

// node is one edge of the trie of active prompt chains: a run of
// consecutive block hashes that every request reaching the run's first
// block covers in full. Nodes are split wherever a booked chain diverges or
// ends, so each worker holds either all of a node or none of it, and its
// distinct blocks are the sum of the runs of the nodes it holds. Runs are
// path-compressed because prompts share long prefixes (a system prompt) and
// then diverge for good: a 512-block prompt is typically two or three
// nodes, so booking it costs a few child lookups and a run of compares.
//
// total counts the requests whose chain covers the node, the sum of the
// holders' refs. It never grows from parent to child, and a node with one
// child and the same total is one no request ends at; Free merges such
// pairs back, so the trie stays as compressed as the chains allow.
type node struct {
	run     []uint64
	parent  *node
	kids    kids
	holders []holder // unordered; usually short, as most nodes serve one worker
	total   int32
}

// holder is one worker's references to a node: its requests covering it.
type holder struct {
	slot int32
	refs int32
}

// maxKidSlice is how many children a node scans linearly before it switches
// to a map. Most nodes have one or two children; the root and the end of a
// shared system prompt may have hundreds.
const maxKidSlice = 8

// kids are a node's children keyed by the first hash of their run, which
// is unique among siblings since the hashes are chained.
type kids struct {
	keys  []uint64
	nodes []*node
	m     map[uint64]*node // non-nil: used instead of the slices
	// spare is an emptied map kept across recycling, so a node that gains
	// many children again (a system prompt coming back) does not reallocate.
	spare map[uint64]*node
}

func (k *kids) get(h uint64) *node {
	if k.m != nil {
		return k.m[h]
	}
	for i, x := range k.keys {
		if x == h {
			return k.nodes[i]
		}
	}
	return nil
}

// put adds n under h, which must be absent.
func (k *kids) put(h uint64, n *node) {
	if k.m == nil && len(k.keys) < maxKidSlice {
		k.keys = append(k.keys, h)
		k.nodes = append(k.nodes, n)
		return
	}
	if k.m == nil {
		k.m, k.spare = k.spare, nil
		if k.m == nil {
			k.m = make(map[uint64]*node, 2*maxKidSlice)
		}
		for i, x := range k.keys {
			k.m[x] = k.nodes[i]
		}
		clear(k.nodes)
		k.keys, k.nodes = k.keys[:0], k.nodes[:0]
	}
	k.m[h] = n
}

// replace puts n under h in place of the child there.
func (k *kids) replace(h uint64, n *node) {
	if k.m != nil {
		k.m[h] = n
		return
	}
	for i, x := range k.keys {
		if x == h {
			k.nodes[i] = n
			return
		}
	}
}

func (k *kids) del(h uint64) {
	if k.m != nil {
		delete(k.m, h)
		return
	}
	for i, x := range k.keys {
		if x == h {
			last := len(k.keys) - 1
			k.keys[i], k.nodes[i] = k.keys[last], k.nodes[last]
			k.nodes[last] = nil
			k.keys, k.nodes = k.keys[:last], k.nodes[:last]
			return
		}
	}
}

func (k *kids) len() int {
	if k.m != nil {
		return len(k.m)
	}
	return len(k.keys)
}

// only returns the child of a node that has exactly one.
func (k *kids) only() *node {
	if k.m == nil {
		return k.nodes[0]
	}
	for _, n := range k.m {
		return n
	}
	return nil
}

func (k *kids) reset() {
	clear(k.nodes)
	k.keys, k.nodes = k.keys[:0], k.nodes[:0]
	if k.m != nil {
		clear(k.m)
		k.m, k.spare = nil, k.m
	}
}

// matchLen returns how many leading elements a and b share.
func matchLen(a, b []uint64) int {
	n := min(len(a), len(b))
	a, b = a[:n], b[:n]
	for i := range a {
		if a[i] != b[i] {
			return i
		}
	}
	return n
}

// slot is one worker's state. Workers live in a dense slice so the hot
// path can keep per-worker scratch in a plain array instead of a map.
type slot struct {
	requests map[string]*request // for RemoveWorker

	shared  int // distinct prompt blocks held (the runs of the nodes listing this slot)
	private int // blocks nobody else can share: no-reuse prompts, output blocks without OSL
	// decayed is the sum of the OSL-weighted output blocks. It is kept
	// incrementally so AddOutputTokens is O(1); decayedReqs lets it be
	// reset to exactly 0 when its last contributor leaves, so float
	// rounding cannot accumulate over the worker's lifetime.
	decayed     float64
	decayedReqs int
	prefill     int
	// active is len(requests), kept apart: reading a map's length loads
	// its header, a cache miss per worker when a decision lists a thousand.
	active int
}

func (s *slot) decodeBlocks() float64 {
	return float64(s.shared+s.private) + s.decayed
}

// rankSlot maps one DP rank of an engine to its slot. Workers are looked up
// by engine ID in a map with a uint64 key (the runtime's fast path; a struct
// key hashes several times slower) and then by rank in a short list, as an
// engine has few ranks.
type rankSlot struct {
	rank uint32
	slot int32
}

type request struct {
	id    string
	slot  int32
	added time.Time
	// end is the node where the request's chain ends, nil without one.
	// Splits keep the lower half in the old node and merges keep the child,
	// so it stays valid, and Free follows parents from it: it needs neither
	// the request's hashes nor a lookup.
	end     *node
	private int  // prompt blocks booked without reuse
	blocks  bool // active blocks are tracked for this request
	isl     int
	osl     int
	prefill int // tokens still counted as prefill; 0 once completed
	done    bool
	gen     int     // generated tokens so far
	out     int     // output blocks booked
	weight  float64 // out's decayed weight, as added to slot.decayed (OSL > 0 only)
}

// Tracker is the per-worker load prediction; build it with New. It is safe
// for concurrent use, as the router books, releases and scores from many
// request goroutines; one mutex suffices because every call is short.
type Tracker struct {
	cfg      Config
	now      func() time.Time
	ttl      time.Duration
	interval time.Duration
	pool     sync.Pool // *request

	// mu guards every field below. Every exported method holds it for its
	// whole duration and runs the lazy expiry first; nothing is called
	// with it held that could call back into the Tracker.
	mu        sync.Mutex
	slotOf    map[uint64][]rankSlot
	nWorkers  int
	slots     []slot
	freeSlots []int32
	root      *node   // the empty chain; its children start at block 0
	freeNodes []*node // recycled with their buffers (up to maxRecycledRun), so booking rarely allocates
	// longRuns are the run buffers of freed nodes too long for freeNodes
	// (up to maxLongRun blocks, at most maxLongRuns of them), for the
	// next long prompt: at 16-token blocks nearly a quarter of a conversation
	// trace's prompts exceed maxRecycledRun, and each one's fresh buffer,
	// cleared and faulted in, cost more than the rest of its booking.
	longRuns buffers.Longest[uint64]

	blocks   int // distinct blocks in the trie: Stats.Blocks
	requests map[string]*request
	lastScan time.Time
	stats    Stats

	// PotentialLoads scratch. run[s] packs walkGen<<32 | leading blocks
	// held by slot s, so nothing is cleared between calls: a stale
	// generation never matches.
	run     []uint64
	walkGen uint32
	// resolved caches the slots of the workers list of the last call, as
	// long as no slot came or went (slotsGen): callers pass the same fleet
	// call after call, and comparing it costs less than a map lookup per
	// worker.
	resolvedFor []kv.Worker
	resolvedID  uint64 // Query.WorkersID of resolvedFor
	resolved    []int32
	resolvedGen uint64
	slotsGen    uint64
}

// New returns a Tracker configured by cfg (see Config for the defaults of
// zero fields).
func New(cfg Config) *Tracker {
	if cfg.BlockSize < 1 {
		cfg.BlockSize = 16
	}
	t := &Tracker{
		cfg:      cfg,
		now:      cfg.Now,
		ttl:      cfg.RequestTTL,
		interval: cfg.ExpiryInterval,
		slotOf:   make(map[uint64][]rankSlot),
		root:     new(node),
		requests: make(map[string]*request),
	}
	if t.now == nil {
		t.now = time.Now
	}
	if t.ttl == 0 {
		t.ttl = 300 * time.Second
	}
	if t.interval <= 0 {
		t.interval = 30 * time.Second
	}
	t.lastScan = t.now()
	return t
}

func or(p *bool, def bool) bool {
	if p == nil {
		return def
	}
	return *p
}

// AddRequest books r on r.Worker. It fails, changing nothing, if r.ID is
// empty or already active, or a count is negative.
func (t *Tracker) AddRequest(r Request) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	now := t.nowOr(r.Now)
	t.expire(now)
	switch {
	case r.ID == "":
		return errors.New("load: empty request id")
	case r.ISL < 0 || r.OverlapBlocks < 0 || r.OSL < 0:
		return fmt.Errorf("load: request %q: negative isl, overlap or osl", r.ID)
	}
	if _, ok := t.requests[r.ID]; ok {
		return fmt.Errorf("%w: %q", ErrDuplicateRequest, r.ID)
	}
	si := t.slotFor(r.Worker)
	s := &t.slots[si]
	q, _ := t.pool.Get().(*request)
	if q == nil {
		q = new(request)
	}
	*q = request{id: r.ID, slot: si, added: now, isl: r.ISL, osl: r.OSL, blocks: t.cfg.TrackActiveBlocks && or(r.TrackBlocks, true)}
	if q.blocks {
		if or(r.AssumeReuse, t.cfg.AssumeKVReuse) {
			q.end = t.book(r.Blocks, si)
		} else {
			q.private = len(r.Blocks)
			s.private += q.private
		}
		if r.OSL > 0 {
			s.decayedReqs++
		}
	}
	if t.cfg.TrackPrefillTokens && or(r.TrackPrefill, true) {
		q.prefill = max(0, r.ISL-r.OverlapBlocks*t.cfg.BlockSize)
		s.prefill += q.prefill
	}
	t.requests[r.ID] = q
	s.requests[r.ID] = q
	s.active++
	t.stats.Added++
	return nil
}

// MarkPrefillCompleted stops counting id's prefill tokens, as its first
// token has come. It reports whether this call changed anything: false for
// an unknown id or a second call.
func (t *Tracker) MarkPrefillCompleted(id string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.expire(t.now())
	q := t.requests[id]
	if q == nil || q.done {
		return false
	}
	q.done = true
	t.slots[q.slot].prefill -= q.prefill
	q.prefill = 0
	return true
}

// AddOutputTokens records n more generated tokens of id. With output-block
// tracking on, it books one more block each time the prompt plus the
// generated tokens fill one. Those blocks are counted, never hashed: they
// are held by this request only, so no other request could match them, and
// a count shares nothing by construction where random hashes would only do
// so with high probability. With an OSL hint every output block of id
// weighs max(0, 1 − generated/OSL), as the request is expected to release
// them soon; prompt blocks never decay, since other requests may hold them.
// It reports whether id is active.
func (t *Tracker) AddOutputTokens(id string, n int) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.expire(t.now())
	q := t.requests[id]
	if q == nil {
		return false
	}
	if n <= 0 || !t.cfg.TrackOutputBlocks || !q.blocks {
		return true
	}
	s := &t.slots[q.slot]
	bs := t.cfg.BlockSize
	q.gen += n
	out := (q.isl+q.gen)/bs - q.isl/bs
	if q.osl == 0 {
		s.private += out - q.out
		q.out = out
		return true
	}
	q.out = out
	w := float64(out) * max(0, 1-float64(q.gen)/float64(q.osl))
	s.decayed += w - q.weight
	q.weight = w
	return true
}

// Free releases id: its block references, its remaining prefill tokens and
// its output blocks. It reports whether id was active, so a second call is
// a harmless false.
func (t *Tracker) Free(id string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.expire(t.now())
	q := t.requests[id]
	if q == nil {
		return false
	}
	t.release(q)
	t.stats.Freed++
	return true
}

// RemoveWorker forgets w and drops its requests (later Free calls for them
// return false). It returns how many requests were dropped.
func (t *Tracker) RemoveWorker(w kv.Worker) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.expire(t.now())
	si := t.lookup(w)
	if si < 0 {
		return 0
	}
	n := 0
	for _, q := range t.slots[si].requests {
		t.release(q)
		n++
	}
	t.stats.Dropped += uint64(n)
	ranks := t.slotOf[w.ID]
	for i, r := range ranks {
		if r.rank == w.DPRank {
			ranks[i] = ranks[len(ranks)-1]
			ranks = ranks[:len(ranks)-1]
			break
		}
	}
	if len(ranks) == 0 {
		delete(t.slotOf, w.ID)
	} else {
		t.slotOf[w.ID] = ranks
	}
	t.slotsGen++
	t.nWorkers--
	t.slots[si] = slot{}
	t.freeSlots = append(t.freeSlots, si)
	return n
}

// Load returns w's predicted load; zero for a worker never booked.
func (t *Tracker) Load(w kv.Worker) WorkerLoad {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.expire(t.now())
	si := t.lookup(w)
	if si < 0 {
		return WorkerLoad{}
	}
	return t.load(&t.slots[si])
}

// PotentialLoads scores q against each of workers: dst[i] holds workers[i]'s
// load now and with q added. overlaps[i] is the number of q's blocks cached
// on workers[i] (from the index); nil means none anywhere. dst is reused
// (pass the previous result back) so the hot path does not allocate.
//
// A block is new on a worker unless it is active there. Sequence hashes are
// chained, so a worker holding block i of q holds blocks 0..i-1 too: what
// it holds of q is its run of leading active blocks, which one walk down
// the trie counts for every worker.
func (t *Tracker) PotentialLoads(q Query, workers []kv.Worker, overlaps []int, dst []Potential) []Potential {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.expire(t.nowOr(q.Now))
	trackBlocks := t.cfg.TrackActiveBlocks && or(q.TrackBlocks, true)
	reuse := trackBlocks && or(q.AssumeReuse, t.cfg.AssumeKVReuse)
	trackPrefill := t.cfg.TrackPrefillTokens && or(q.TrackPrefill, true)

	if t.walkGen++; t.walkGen == 0 {
		// Generations wrapped: old marks could match again.
		clear(t.run)
		t.walkGen = 1
	}
	gen := uint64(t.walkGen) << 32
	dst = dst[:0]
	known := q.WorkersID != 0 && q.WorkersID == t.resolvedID
	if t.resolvedGen != t.slotsGen || !known && !slices.Equal(workers, t.resolvedFor) {
		t.resolvedFor = append(t.resolvedFor[:0], workers...)
		t.resolved = t.resolved[:0]
		for _, w := range workers {
			t.resolved = append(t.resolved, t.lookup(w))
		}
		t.resolvedGen = t.slotsGen
	}
	t.resolvedID = q.WorkersID
	if reuse && len(workers) > 0 {
		t.walk(q.Blocks, gen)
	}
	// Filled in place, in one pass: appending a Potential built in a local
	// copied it twice per worker, a tenth of a thousand-worker decision.
	dst = slices.Grow(dst, len(workers))[:len(workers)]
	for i, w := range workers {
		p := &dst[i]
		*p = Potential{}
		p.Worker = w
		si := t.resolved[i]
		if si >= 0 {
			p.WorkerLoad = t.load(&t.slots[si])
		}
		if trackBlocks {
			held := 0
			if si >= 0 && reuse {
				if r := t.run[si]; r&^(1<<32-1) == gen {
					held = int(uint32(r))
				}
			}
			p.PotentialDecodeBlocks = p.ActiveDecodeBlocks + float64(len(q.Blocks)-held)
		}
		if trackPrefill {
			ov := 0
			if overlaps != nil {
				ov = overlaps[i]
			}
			p.PotentialPrefillTokens = p.ActivePrefillTokens + max(0, q.ISL-ov*t.cfg.BlockSize)
		}
	}
	return dst
}

// walk counts, in run, each slot's leading blocks of blocks active. It
// follows blocks down the trie until they leave it; each worker's count is
// where it last held a node on the way, as a worker holding a node's first
// block holds the whole node. Holder sets only shrink down the trie, so the
// cost is O(matched blocks + holders of the nodes passed), and the nodes
// passed are few.
func (t *Tracker) walk(blocks []uint64, gen uint64) {
	run := t.run
	n := t.root
	for i := 0; i < len(blocks); {
		c := n.kids.get(blocks[i])
		if c == nil {
			return
		}
		m := 1 + matchLen(c.run[1:], blocks[i+1:])
		i += m
		for _, hd := range c.holders {
			run[hd.slot] = gen | uint64(i)
		}
		if m < len(c.run) {
			return
		}
		n = c
	}
}

// Stats returns the counters and current sizes.
func (t *Tracker) Stats() Stats {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.expire(t.now())
	st := t.stats
	st.Active = len(t.requests)
	st.Workers = t.nWorkers
	st.Blocks = t.blocks
	return st
}

func (t *Tracker) load(s *slot) WorkerLoad {
	l := WorkerLoad{ActivePrefillTokens: s.prefill, ActiveRequests: s.active}
	if t.cfg.TrackActiveBlocks {
		l.ActiveDecodeBlocks = s.decodeBlocks()
	}
	return l
}

// nowOr is given, or the clock's reading when given is zero.
func (t *Tracker) nowOr(given time.Time) time.Time {
	if given.IsZero() {
		return t.now()
	}
	return given
}

// expire frees requests older than the TTL, at most once per interval.
func (t *Tracker) expire(now time.Time) {
	if t.ttl < 0 || now.Sub(t.lastScan) < t.interval {
		return
	}
	t.lastScan = now
	for _, q := range t.requests {
		if now.Sub(q.added) > t.ttl {
			t.release(q)
			t.stats.Expired++
		}
	}
}

// lookup returns w's slot, or -1.
func (t *Tracker) lookup(w kv.Worker) int32 {
	for _, r := range t.slotOf[w.ID] {
		if r.rank == w.DPRank {
			return r.slot
		}
	}
	return -1
}

func (t *Tracker) slotFor(w kv.Worker) int32 {
	if si := t.lookup(w); si >= 0 {
		return si
	}
	var si int32
	if n := len(t.freeSlots); n > 0 {
		si = t.freeSlots[n-1]
		t.freeSlots = t.freeSlots[:n-1]
	} else {
		si = int32(len(t.slots))
		t.slots = append(t.slots, slot{})
		t.run = append(t.run, 0)
	}
	t.slots[si] = slot{requests: make(map[string]*request)}
	t.slotOf[w.ID] = append(t.slotOf[w.ID], rankSlot{rank: w.DPRank, slot: si})
	t.slotsGen++
	t.nWorkers++
	return si
}

// release undoes everything q booked and recycles it.
func (t *Tracker) release(q *request) {
	s := &t.slots[q.slot]
	if q.end != nil {
		t.unbook(q.end, q.slot)
	}
	s.private -= q.private
	s.prefill -= q.prefill
	if q.osl == 0 {
		s.private -= q.out
	} else if q.blocks {
		s.decayed -= q.weight
		if s.decayedReqs--; s.decayedReqs == 0 {
			s.decayed = 0
		}
	}
	delete(t.requests, q.id)
	delete(s.requests, q.id)
	s.active--
	*q = request{}
	t.pool.Put(q)
}

// book adds chain b for slot si to the trie and returns the node it ends
// at (the root for an empty chain). Nodes are split so that b ends at, and
// diverges from the trie at, node boundaries.
func (t *Tracker) book(b []uint64, si int32) *node {
	n := t.root
	for i := 0; i < len(b); {
		c := n.kids.get(b[i])
		if c == nil {
			c = t.newNode()
			if len(b)-i > cap(c.run) {
				t.dropRun(c.run)
				c.run = t.runFor(len(b) - i)
			}
			c.run = append(c.run, b[i:]...)
			c.parent = n
			n.kids.put(b[i], c)
			t.blocks += len(c.run)
			t.hold(c, si)
			return c
		}
		m := 1 + matchLen(c.run[1:], b[i+1:])
		if m < len(c.run) {
			c = t.split(c, m)
		}
		t.hold(c, si)
		i += m
		n = c
	}
	return n
}

// hold takes one reference of slot si on n.
func (t *Tracker) hold(n *node, si int32) {
	n.total++
	for j := range n.holders {
		if n.holders[j].slot == si {
			n.holders[j].refs++
			return
		}
	}
	n.holders = append(n.holders, holder{slot: si, refs: 1})
	t.slots[si].shared += len(n.run)
}

// unbook drops slot si's references on the chain ending at end, removes
// the nodes nobody holds any more and merges the one pair of nodes this
// can leave mergeable: below the lowest node that lost a child, or below
// end itself when nothing was removed. Elsewhere a parent's and its
// child's totals both dropped by one, so nothing else can become mergeable.
func (t *Tracker) unbook(end *node, si int32) {
	s := &t.slots[si]
	var lost *node
	for n := end; n != t.root; {
		p := n.parent
		n.total--
		for j := range n.holders {
			if hd := &n.holders[j]; hd.slot == si {
				if hd.refs--; hd.refs == 0 {
					last := len(n.holders) - 1
					n.holders[j] = n.holders[last]
					n.holders = n.holders[:last]
					s.shared -= len(n.run)
				}
				break
			}
		}
		if n.total == 0 {
			p.kids.del(n.run[0])
			t.blocks -= len(n.run)
			t.recycle(n)
			lost = p
		}
		n = p
	}
	if lost == nil {
		lost = end
	}
	if lost != t.root && lost.kids.len() == 1 {
		if c := lost.kids.only(); c.total == lost.total {
			t.merge(lost, c)
		}
	}
}

// split cuts n's run before index m and returns a new node holding the
// first part above n. n keeps the second part, so requests that end at n
// still do.
func (t *Tracker) split(n *node, m int) *node {
	u := t.newNode()
	if cap(n.run) <= maxRecycledRun {
		u.run = append(u.run, n.run[:m]...)
		poisonRun(n.run[:m:m])
		n.run = n.run[m:]
	} else {
		// A long buffer stays whole with u and n gets a copy of the rest:
		// n keeping a slice into its middle would pin all of it, whatever
		// its cap says, past recycle's bound.
		tail := u.run
		if rest := len(n.run) - m; rest > cap(tail) {
			t.dropRun(tail)
			tail = t.runFor(rest)
		}
		tail = append(tail, n.run[m:]...)
		poisonRun(n.run[m:])
		u.run, n.run = n.run[:m], tail
	}
	u.holders = append(u.holders, n.holders...)
	u.total = n.total
	u.parent = n.parent
	u.parent.kids.replace(u.run[0], u)
	n.parent = u
	u.kids.put(n.run[0], n)
	return u
}

// merge folds p into c, its only child with the same total. Equal totals
// mean equal holders (a child's refs never exceed its parent's) and that no
// request ends at p, so p can go; c stays, as requests may end at it.
func (t *Tracker) merge(p, c *node) {
	lp, lc := len(p.run), len(c.run)
	switch {
	case cap(p.run) >= lp+lc:
		p.run = append(p.run, c.run...)
		p.run, c.run = c.run, p.run
	case cap(c.run) >= lp+lc:
		// c's buffer has the room (a kept long one): c's blocks move up
		// in it rather than both runs into a new one.
		c.run = c.run[:lp+lc]
		copy(c.run[lp:], c.run[:lc])
		copy(c.run, p.run)
	default:
		r := append(append(t.runFor(lp+lc), p.run...), c.run...)
		t.dropRun(c.run)
		c.run = r
	}
	c.parent = p.parent
	c.parent.kids.replace(c.run[0], c)
	t.recycle(p)
}

func (t *Tracker) newNode() *node {
	if n := len(t.freeNodes); n > 0 {
		nd := t.freeNodes[n-1]
		t.freeNodes = t.freeNodes[:n-1]
		return nd
	}
	return new(node)
}

// maxRecycledRun is the longest run buffer a recycled node keeps, in
// blocks: enough for a 16 K-token prompt. A longer one is a rare prompt's,
// and keeping it would hold that prompt's memory for good.
const maxRecycledRun = 1024

// maxLongRun and maxLongRuns bound the long run buffers kept (1 MiB).
const (
	maxLongRun  = 8192
	maxLongRuns = 16
)

// runFor is an empty buffer of room for n blocks, for a run longer than
// the buffer of its node: for a long run the shortest kept long one that
// has the room, else a new one. A first fit gave a long prompt's buffer
// to a shorter one, and the next long prompt a fresh one.
func (t *Tracker) runFor(n int) []uint64 {
	if n <= maxRecycledRun {
		return make([]uint64, 0, n)
	}
	if r := t.longRuns.Take(n); r != nil {
		return r
	}
	// With the room the heap gives the buffer anyway (its size class, or
	// whole pages), which serves a slightly longer prompt later.
	return slices.Grow([]uint64(nil), n)
}

// dropRun lets go of r, a buffer no node uses any more: a long one is
// kept for reuse, a short one is left to the collector, as the node it
// came with has one.
func (t *Tracker) dropRun(r []uint64) {
	poisonRun(r)
	if cap(r) > maxRecycledRun {
		t.keepLongRun(r)
	}
}

// keepLongRun keeps r, a freed node's run buffer longer than
// maxRecycledRun, if it is within maxLongRun: in place of the shortest
// kept one when maxLongRuns are kept already, so that what is kept
// serves the longest prompts.
func (t *Tracker) keepLongRun(r []uint64) {
	if cap(r) > maxLongRun {
		return
	}
	t.longRuns.Keep(r, maxLongRuns)
}

func (t *Tracker) recycle(n *node) {
	poisonRun(n.run)
	n.run = n.run[:0]
	if cap(n.run) > maxRecycledRun {
		t.keepLongRun(n.run)
		n.run = nil
	}
	n.holders = n.holders[:0]
	n.kids.reset()
	n.parent = nil
	n.total = 0
	t.freeNodes = append(t.freeNodes, n)
}
