package index

import (
	"slices"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/core/kv"
)

// predictedStride is the spacing of the blocks a prediction holds: every
// predictedStride-th block of the prompt, and its last. Holding every block
// made booking an 8,192-token prompt cost 512 hash-table updates, as much as
// the rest of the routing decision; the price is that an overlap which
// ends between two held blocks, short of a prediction's own end, is seen
// up to predictedStride-1 blocks short (at most 112 tokens at 16 a block).
const predictedStride = 8

// predictedJump is how many held strides a lookup skips at once while the
// set of workers holding the prefix stays the same.
const predictedJump = 4

// predictedAhead is how many probes ahead a lookup asks for head slots.
const predictedAhead = 3

// Predicted is the index of predict-on-route: each booked request predicts
// that its worker caches the prompt, from the routing decision until the
// request settles (its prefill completes or it ends) plus a window, or
// until the TTL. Unlike Approx, which refreshes a TTL per block, a
// prediction lives and dies whole, so booking, settling and expiring cost
// one deadline each rather than one per block.
//
// A prediction holds its prompt's blocks at positions predictedStride-1,
// 2·predictedStride-1, … (the strides) and its last block. Since sequence
// hashes chain, a worker holding a prompt's stride k holds all its strides
// before k: the workers holding stride k+1 are a subset of those holding
// stride k, and where two strides have as many holders the holders are
// the same. A lookup probes every predictedJump-th stride and bisects only
// where the set shrinks; then, where a worker's strides end, it looks for a
// prediction's last block among the blocks up to the next stride.
//
// Safe for concurrent use.
type Predicted struct {
	cfg ApproxConfig

	// mu guards everything below. Lookups take it exclusively: they apply
	// expirations first, and they are short.
	mu    sync.Mutex
	heads u64map // sequence hash → 1 + index in holders of its first holder
	// byPair maps predictedPairKey(block, worker) to 1 + index of that
	// holder, for the blocks of more than shortList holders only: the
	// others' lists are walked, and most blocks (a prompt's own, past
	// what it shares) have one holder, whose pair key cost a table
	// insertion and a deletion per hold for nothing.
	byPair  u64map
	holders []holder // a free list threads through the unused ones
	free    []uint32
	open    map[string]*prediction // by request id, until settled
	queue   deadlineQueue
	booked  uint64 // predictions booked so far: the queue's tie-break
	pairs   uint64
	expired uint64
	evicted uint64
	// spare are dropped predictions, with their held lists, for the next
	// bookings: a booking allocated a prediction and its list, and memory
	// the heap had to grow for cost a page fault a page on top.
	spare []*prediction
}

const (
	maxSpare        = 1024
	maxSpareHeldCap = 4096/predictedStride + 1 // a 64 K-token prompt's
)

// newPrediction is a prediction with an empty held list of room for n.
func (p *Predicted) newPrediction(n int) *prediction {
	if k := len(p.spare); k > 0 {
		pr := p.spare[k-1]
		p.spare = p.spare[:k-1]
		if cap(pr.held) < n {
			pr.held = make([]uint32, 0, n)
		}
		return pr
	}
	return &prediction{held: make([]uint32, 0, n)}
}

// recycle keeps a dropped prediction for the next booking, up to as many
// as are live (at least maxSpare): bookings that outpace expiries for a
// while, a burst or a stall of the clock's reader, then find theirs
// without allocating, and the spares never outnumber the live. One with a
// longer list than a 64 K-token prompt's is let go: it would hold a rare
// prompt's memory for good.
func (p *Predicted) recycle(pr *prediction) {
	pr.id, pr.held = "", pr.held[:0]
	if len(p.spare) < max(maxSpare, len(p.queue.items)) && cap(pr.held) <= maxSpareHeldCap {
		p.spare = append(p.spare, pr)
	}
}

// holder is one worker's hold on one block: n live predictions pass
// through it. A block's holders form a list from its head.
type holder struct {
	w     kv.Worker
	h     uint64 // the block
	n     uint32
	count uint32 // on a block's head only: how many holders the block has
	next  uint32 // 1 + index of the block's next holder; 0 ends the list
	prev  uint32 // 1 + index of the block's previous holder; 0 at the head
}

// predictedPairKey mixes a block and a worker into one key of the pairs map. Two
// pairs with one key are as unlikely as two blocks with one sequence hash,
// which the whole index already rules out; find still checks the holder.
func predictedPairKey(h uint64, w kv.Worker) uint64 {
	return (h ^ (w.ID*0x9e3779b97f4a7c15 + uint64(w.DPRank)*0xc2b2ae3d27d4eb4f + 1)) * 0xbf58476d1ce4e5b9
}

// find is w's holder of block h, 1-based; 0 when w does not hold it.
func (p *Predicted) find(h uint64, w kv.Worker) uint32 {
	if i, ok := p.byPair.Get(predictedPairKey(h, w)); ok && p.holders[i-1].h == h && p.holders[i-1].w == w {
		return i
	}
	return 0
}

type prediction struct {
	id string
	w  kv.Worker
	// held are its holders, 1-based: a holder stays put while any
	// prediction passes through it, so releasing one needs no lookup.
	held []uint32
	at   int64  // deadline, unix ns
	seq  uint64 // booking order: of two equal deadlines the earlier goes first
	pos  int    // index in the deadline queue
}

// NewPredicted returns an empty Predicted index. cfg.TTL bounds a
// prediction that is never settled (--router-predicted-ttl-secs); the size
// bound evicts the predictions nearest their deadline first.
func NewPredicted(cfg ApproxConfig) *Predicted {
	p := &Predicted{cfg: cfg.withDefaults(), open: map[string]*prediction{}}
	// Predictions come and go with the traffic: the tables keep the room
	// of the busiest moment, which the size bound caps, rather than
	// shrinking in every lull and growing back in the next burst.
	p.heads.keep, p.byPair.keep = true, true
	return p
}

// Add predicts that w caches the blocks seq (a prompt's sequence hashes
// from block 0) for request id, from now until Settle or the TTL. An id
// still open is replaced.
func (p *Predicted) Add(id string, w kv.Worker, seq []uint64, at time.Time) {
	if len(seq) == 0 {
		return
	}
	now := at.UnixNano()
	p.mu.Lock()
	defer p.mu.Unlock()
	p.expireLocked(now)
	if old := p.open[id]; old != nil {
		p.queue.remove(old)
		p.dropLocked(old)
	}
	// Each hold waits on its block's head slot before it can look further;
	// asked for all at once, the slots arrive together.
	for i := predictedStride - 1; i < len(seq); i += predictedStride {
		p.heads.prefetchHome(seq[i])
	}
	p.heads.prefetchHome(seq[len(seq)-1])
	pr := p.newPrediction(len(seq)/predictedStride + 1)
	p.booked++
	pr.id, pr.w, pr.at, pr.seq = id, w, now+int64(p.cfg.TTL), p.booked
	for i := predictedStride - 1; i < len(seq); i += predictedStride {
		pr.held = append(pr.held, p.hold(seq[i], w))
	}
	if len(seq)%predictedStride != 0 {
		pr.held = append(pr.held, p.hold(seq[len(seq)-1], w))
	}
	p.open[id] = pr
	p.queue.push(pr)
	if p.pairs > uint64(p.cfg.MaxBlocks) {
		target := uint64(float64(p.cfg.MaxBlocks) * p.cfg.PruneRatio)
		for p.pairs > target && len(p.queue.items) > 0 {
			pr := p.queue.pop()
			p.evicted += uint64(len(pr.held))
			p.dropLocked(pr)
		}
	}
}

// Settle ends request id's prediction within window: its outcome is about
// to be known from elsewhere. A prediction already nearer its end keeps it.
func (p *Predicted) Settle(id string, window time.Duration) {
	at := p.cfg.Now().UnixNano() + int64(window)
	p.mu.Lock()
	defer p.mu.Unlock()
	pr := p.open[id]
	if pr == nil {
		return
	}
	delete(p.open, id)
	if at < pr.at {
		pr.at = at
		p.queue.up(pr.pos)
	}
}

// FindMatches returns the workers predicted, at time at, to hold a prefix
// of seq and how many blocks of it each is predicted to hold (short by
// less than predictedStride where the prefix ends between two held
// blocks).
func (p *Predicted) FindMatches(m *Matcher, seq []uint64, at time.Time) []Overlap {
	return p.FindMatchesBeyond(m, seq, at, 0)
}

// FindMatchesBeyond is FindMatches for a caller to whom an overlap of
// from blocks or fewer makes no difference: every worker FindMatches
// finds predicted deeper than from is returned with the same overlap;
// those predicted no deeper may be left out, and their holdings are not
// read. A router whose every rank holds the request's first from blocks
// by their events (a shared system prompt) skips, with from, the part of
// the lookup that visits every rank predicted to hold that prefix.
//
// A worker predicted deeper than from holds, through one prediction,
// either the first stride at or past from (every block of a prediction
// chains from the ones before, so it holds every stride up to its end),
// or that prediction's last block between from and that stride. The
// lookup starts at that stride with its holders alive, as FindMatches
// starts at the first, and looks for last blocks among the blocks from
// from up to it, as FindMatches does below the first stride.
func (p *Predicted) FindMatchesBeyond(m *Matcher, seq []uint64, at time.Time, from int) []Overlap {
	m.out = m.out[:0]
	if from < 0 {
		from = 0
	}
	if len(seq) <= from {
		// Nothing can be deeper; expirations wait for the next call.
		return m.out
	}
	now := at.UnixNano()
	p.mu.Lock()
	defer p.mu.Unlock()
	p.expireLocked(now)
	stride := func(k int) uint64 { return seq[k*predictedStride-1] }
	strides := len(seq) / predictedStride
	first := from/predictedStride + 1 // the first stride at or past from
	// The blocks before the first stride that a prediction's last block
	// may be among.
	short := seq[from:min(len(seq), first*predictedStride-1)]
	// Every probe waits on its head slot; most probes find the set of
	// workers unchanged and jump on, so the slots of the next probes, and
	// of the short run extendShort reads last, are asked for ahead.
	for _, h := range short {
		p.heads.prefetchHome(h)
	}
	for a := range predictedAhead {
		if k := first + a*predictedJump; k <= strides {
			p.heads.prefetchHome(stride(k))
		}
	}
	if first <= strides {
		if alive := p.count(stride(first)); alive > 0 {
			// Blocks 0 marks a worker holding every stride probed so far.
			for i := p.head(stride(first)); i != 0; i = p.holders[i-1].next {
				m.out = append(m.out, Overlap{Worker: p.holders[i-1].w})
			}
			k := first // every live worker holds strides up to k
			for k < strides && alive > 0 {
				probe := min(k+predictedJump, strides)
				if ahead := probe + (predictedAhead-1)*predictedJump; ahead <= strides {
					p.heads.prefetchHome(stride(ahead))
				}
				if p.count(stride(probe)) == alive {
					k = probe
					continue
				}
				lo, hi := k+1, probe // the set shrinks at the first stride in [lo, hi]
				for lo < hi {
					if mid := (lo + hi) / 2; p.count(stride(mid)) < alive {
						hi = mid
					} else {
						lo = mid + 1
					}
				}
				alive = p.dropAt(m, seq, lo)
				k = lo
			}
			if alive > 0 {
				p.extend(m, seq, strides*predictedStride, len(seq))
			}
		}
	}
	p.extendShort(m, short, from)
	return m.out
}

// dropAt ends, at the stride before it, every live worker that does not
// hold stride k, extends each by the last blocks of its predictions up to
// stride k, and returns how many remain live.
func (p *Predicted) dropAt(m *Matcher, seq []uint64, k int) uint32 {
	h := seq[k*predictedStride-1]
	first := p.head(h)
	base := uint32((k - 1) * predictedStride)
	m.dropped = m.dropped[:0]
	var alive uint32
	for i := range m.out {
		if m.out[i].Blocks != 0 {
			continue
		}
		if p.holderOf(first, h, m.out[i].Worker) != 0 {
			alive++
		} else {
			m.out[i].Blocks = base
			m.dropped = append(m.dropped, int32(i))
		}
	}
	p.extendAmong(m, seq, int(base), k*predictedStride-1, m.dropped)
	return alive
}

// extend gives every live worker its depth: the strides it holds, then the
// last block of one of its predictions among seq[from:to].
func (p *Predicted) extend(m *Matcher, seq []uint64, from, to int) {
	m.dropped = m.dropped[:0]
	for i := range m.out {
		if m.out[i].Blocks == 0 {
			m.out[i].Blocks = uint32(from)
			m.dropped = append(m.dropped, int32(i))
		}
	}
	p.extendAmong(m, seq, from, to, m.dropped)
}

// extendAmong raises the depth of the workers of out at indexes among to
// the deepest block of seq[from:to] they hold: only a prediction's last
// block can be held there, and it stands for all the blocks before it.
func (p *Predicted) extendAmong(m *Matcher, seq []uint64, from, to int, among []int32) {
	for e := from; e < to; e++ {
		for i := p.head(seq[e]); i != 0; i = p.holders[i-1].next {
			w := p.holders[i-1].w
			for _, j := range among {
				if m.out[j].Worker == w {
					m.out[j].Blocks = uint32(e + 1)
				}
			}
		}
	}
}

// extendShort adds the workers whose predictions end before the first
// stride probed, found by the last block those hold among short's
// blocks, which start at position from of the request.
func (p *Predicted) extendShort(m *Matcher, short []uint64, from int) {
	strided := len(m.out)
	for e, h := range short {
		for i := p.head(h); i != 0; i = p.holders[i-1].next {
			w := p.holders[i-1].w
			if slices.ContainsFunc(m.out[:strided], func(o Overlap) bool { return o.Worker == w }) {
				continue // holds a stride: deeper than any of these
			}
			if j := slices.IndexFunc(m.out[strided:], func(o Overlap) bool { return o.Worker == w }); j >= 0 {
				m.out[strided+j].Blocks = uint32(from + e + 1)
			} else {
				m.out = append(m.out, Overlap{Worker: w, Blocks: uint32(from + e + 1)})
			}
		}
	}
}

// RemoveWorker forgets every prediction for every rank of engine id.
func (p *Predicted) RemoveWorker(id uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var gone []*prediction
	for _, pr := range p.queue.items {
		if pr.w.ID == id {
			gone = append(gone, pr)
		}
	}
	for _, pr := range gone {
		p.queue.remove(pr)
		p.dropLocked(pr)
	}
}

// Stats reports the size and the churn of the index.
func (p *Predicted) Stats() ApproxStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	return ApproxStats{Pairs: p.pairs, Expired: p.expired, Evicted: p.evicted}
}

func (p *Predicted) expireLocked(now int64) {
	for len(p.queue.items) > 0 && p.queue.items[0].at <= now {
		pr := p.queue.pop()
		p.expired += uint64(len(pr.held))
		p.dropLocked(pr)
	}
}

// dropLocked releases the blocks of a prediction taken out of the queue
// and recycles it.
func (p *Predicted) dropLocked(pr *prediction) {
	for _, i := range pr.held {
		p.release(i)
	}
	if p.open[pr.id] == pr {
		delete(p.open, pr.id)
	}
	p.recycle(pr)
}

func (p *Predicted) head(h uint64) uint32 {
	v, _ := p.heads.Get(h)
	return v
}

func (p *Predicted) count(h uint64) uint32 {
	if i := p.head(h); i != 0 {
		return p.holders[i-1].count
	}
	return 0
}

// shortList is the longest holder list walked rather than looked up: its
// entries are likely in cache already, the pairs map's slot is not.
const shortList = 4

// holderOf is w's holder of block h, whose list starts at first; 0 when w
// does not hold it. byPair holds a block's holders from the moment it has
// more than shortList of them until it is back to shortList.
func (p *Predicted) holderOf(first uint32, h uint64, w kv.Worker) uint32 {
	if first == 0 {
		return 0
	}
	if p.holders[first-1].count > shortList {
		return p.find(h, w)
	}
	for i := first; i != 0; i = p.holders[i-1].next {
		if p.holders[i-1].w == w {
			return i
		}
	}
	return 0
}

// hold adds a prediction's hold on block h by w and returns its holder.
func (p *Predicted) hold(h uint64, w kv.Worker) uint32 {
	first := p.head(h)
	if i := p.holderOf(first, h, w); i != 0 {
		p.holders[i-1].n++
		return i
	}
	n := p.alloc()
	count := uint32(1)
	if first != 0 {
		count += p.holders[first-1].count
		p.holders[first-1].prev = n
	}
	p.holders[n-1] = holder{w: w, h: h, n: 1, count: count, next: first}
	p.heads.Put(h, n)
	switch {
	case count == shortList+1:
		for i := n; i != 0; i = p.holders[i-1].next {
			p.byPair.Put(predictedPairKey(h, p.holders[i-1].w), i)
		}
	case count > shortList:
		p.byPair.Put(predictedPairKey(h, w), n)
	}
	p.pairs++
	return n
}

// release ends one hold on holder i.
func (p *Predicted) release(i uint32) {
	hd := &p.holders[i-1]
	if hd.n--; hd.n > 0 {
		return
	}
	h, w := hd.h, hd.w
	first := p.head(h)
	next, prev, count := hd.next, hd.prev, p.holders[first-1].count-1
	if next != 0 {
		p.holders[next-1].prev = prev
	}
	switch {
	case prev != 0:
		p.holders[prev-1].next = next
		p.holders[first-1].count = count
	case next != 0:
		p.holders[next-1].count = count
		p.heads.Put(h, next)
		first = next
	default:
		p.heads.Delete(h)
	}
	if count >= shortList {
		p.byPair.Delete(predictedPairKey(h, w))
		if count == shortList {
			for j := first; j != 0; j = p.holders[j-1].next {
				p.byPair.Delete(predictedPairKey(h, p.holders[j-1].w))
			}
		}
	}
	p.holders[i-1] = holder{}
	p.free = append(p.free, i)
	p.pairs--
}

func (p *Predicted) alloc() uint32 {
	if n := len(p.free); n > 0 {
		i := p.free[n-1]
		p.free = p.free[:n-1]
		return i
	}
	p.holders = append(p.holders, holder{})
	return uint32(len(p.holders))
}

// deadlineQueue pops the earliest deadline first, of equal ones the
// earlier booked. It holds each live prediction once, at the index the
// prediction keeps, so a settle brings its deadline forward in place and a
// dropped prediction leaves at once. A queue of entries that were skipped
// once stale kept every booking's entry for the whole TTL: 30 s of
// bookings, each pinning its prediction, a heap that grew with the traffic
// and bookings that paid for the fresh memory.
type deadlineQueue struct{ items []*prediction }

func (q *deadlineQueue) less(i, j int) bool {
	a, b := q.items[i], q.items[j]
	return a.at < b.at || (a.at == b.at && a.seq < b.seq)
}

func (q *deadlineQueue) swap(i, j int) {
	q.items[i], q.items[j] = q.items[j], q.items[i]
	q.items[i].pos, q.items[j].pos = i, j
}

func (q *deadlineQueue) push(pr *prediction) {
	pr.pos = len(q.items)
	q.items = append(q.items, pr)
	q.up(pr.pos)
}

// up restores the order above entry j, whose deadline came forward.
func (q *deadlineQueue) up(j int) {
	for j > 0 {
		i := (j - 1) / 2
		if !q.less(j, i) {
			break
		}
		q.swap(i, j)
		j = i
	}
}

func (q *deadlineQueue) down(i int) {
	n := len(q.items)
	for {
		j := 2*i + 1
		if j >= n {
			return
		}
		if j2 := j + 1; j2 < n && q.less(j2, j) {
			j = j2
		}
		if !q.less(j, i) {
			return
		}
		q.swap(i, j)
		i = j
	}
}

func (q *deadlineQueue) pop() *prediction {
	pr := q.items[0]
	q.remove(pr)
	return pr
}

// remove takes pr out of the queue.
func (q *deadlineQueue) remove(pr *prediction) {
	i, n := pr.pos, len(q.items)-1
	if i != n {
		q.swap(i, n)
	}
	q.items[n] = nil
	q.items = q.items[:n]
	if i != n {
		q.down(i)
		q.up(i)
	}
}
