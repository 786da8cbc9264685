package index

import (
	"errors"
	"math/bits"
	"unsafe"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/hugepage"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/prefetch"
)

// Single is the exact, event-fed index for a caller that applies events and
// looks up from one goroutine, over at most 64 worker ranks and the device
// tier only: the simulator, where one loop plays engines and router. It
// answers as Index does (TestSingleAgreesWithIndex), for less work per
// block: Index's tree of nodes with parents, children and holder sets,
// behind shard locks, exists for concurrent writers, eviction under a cap
// and re-anchoring; here a block is one slot of a table keyed by its
// sequence hash whose value is the bit set of the ranks holding it, and a
// rank's engine ids map straight to sequence hashes. A stored or removed
// block then touches two table slots (Index touches a node, its slot in
// the sequence-hash table and the rank's id table, and a removal the lines
// after two slots), and a lookup walks the request's hashes, ANDing bit
// sets.
//
// A rank whose engine names every block by its sequence hash (the
// simulator's engines, as Dynamo's mocker does) needs no id table: its
// blocks are its bits in bySeq, a Stored event's parent and a Removed
// block are looked up there, and a block touches one slot. Every rank
// starts so and keeps it while every block it stores is named by its
// sequence hash; the first that is not turns the rank to an id table,
// rebuilt from its bits. What the rank holds is the same either way, so
// the answers and the counters are too.
//
// What it leaves out: storage tiers below the device (such events are
// refused with ErrUnknownTier), a memory cap, re-anchoring of unknown
// parents (Config.Locate: they are refused) and dumps.
type Single struct {
	// sets maps a sequence hash to the bit set of the ranks holding it
	// while no rank's bit is setMapRanks or more; then bySeq does (wide).
	sets     setMap
	bySeq    pairMap
	wide     bool
	ranks    [64]singleRank
	bitOf    map[kv.Worker]int
	used     uint64 // bits of ranks in use
	reserved map[kv.Worker]int
	refused  map[kv.Worker]uint64
	pairs    uint64
	stats    Stats
	// scratch of the warm passes
	seqs []uint64
	// scratch of clear
	unheld []uint64
}

type singleRank struct {
	id kv.Worker
	// ids maps the engine's block ids to the blocks' sequence hashes,
	// once the rank has named a block otherwise (see Single).
	ids pairMap
	// named: the rank's ids are in ids. Until then they are the sequence
	// hashes of its blocks, of which it holds held.
	named bool
	held  int
	bound int
	// extra counts, per sequence hash, engine ids beyond the first that
	// name the block (see workerState.extraRefs).
	extra map[uint64]uint32
}

// MaxSingleRanks is the most worker ranks a Single indexes.
const MaxSingleRanks = 64

// ErrTooManyRanks is returned by Single.Apply for an event of a rank beyond
// the first MaxSingleRanks; the event is skipped.
var ErrTooManyRanks = errors.New("index: more worker ranks than a single-goroutine index holds")

// NewSingle returns an empty Single.
func NewSingle() *Single {
	return &Single{bitOf: map[kv.Worker]int{}, reserved: map[kv.Worker]int{}, refused: map[kv.Worker]uint64{}}
}

// rank returns w's bit, making one when create is set.
func (x *Single) rank(w kv.Worker, create bool) (int, bool) {
	if b, ok := x.bitOf[w]; ok {
		return b, true
	}
	if !create || x.used == ^uint64(0) {
		return 0, false
	}
	b := bits.TrailingZeros64(^x.used)
	if b >= setMapRanks && !x.wide {
		x.widen()
	}
	x.used |= 1 << b
	x.bitOf[w] = b
	r := &x.ranks[b]
	*r = singleRank{id: w, bound: RankBound(x.reserved[w])}
	return b, true
}

// widen moves the sets to bySeq, whose sets hold every rank.
func (x *Single) widen() {
	x.wide = true
	x.bySeq.reserve(max(x.reservedBlocks(), x.sets.n))
	x.sets.each(func(s, set uint64) { x.bySeq.put(s, set) })
	x.sets = setMap{}
}

// setOf is the set of ranks holding the block of sequence hash s.
func (x *Single) setOf(s uint64) uint64 {
	if x.wide {
		set, _ := x.bySeq.get(s)
		return set
	}
	return x.sets.get(s)
}

// addRank puts rank b into the set of s and reports whether it was there.
// The callers that apply each block test wide themselves, a call fewer
// on the hot path.
func (x *Single) addRank(b int, s uint64) bool {
	if !x.wide {
		return x.sets.add(s, 1<<b)
	}
	return x.bySeq.addBit(s, 1<<b)
}

// dropRank takes rank b out of the set of s, and s out of the table with
// the last, and reports whether it was there.
func (x *Single) dropRank(b int, s uint64) bool {
	if !x.wide {
		return x.sets.remove(s, 1<<b)
	}
	return x.bySeq.removeBit(s, 1<<b)
}

func (x *Single) eachSet(f func(s, set uint64)) {
	if x.wide {
		x.bySeq.each(f)
	} else {
		x.sets.each(f)
	}
}

// prefetchSet asks for the line of the set of s; prefetchRun for the
// lines an insertion or a deletion reads.
func (x *Single) prefetchSet(s uint64, run bool) {
	switch {
	case !x.wide && run:
		x.sets.prefetchRun(s)
	case !x.wide:
		x.sets.prefetch(s)
	case run:
		x.bySeq.prefetchRun(s)
	default:
		x.bySeq.prefetch(s)
	}
}

// blocks is how many blocks rank r holds.
func (r *singleRank) blocks() int {
	if r.named {
		return r.ids.n
	}
	return r.held
}

// name turns rank b to an id table, each block it holds named by its
// sequence hash.
func (x *Single) name(b int) {
	r := &x.ranks[b]
	r.named = true
	r.ids.reserve(max(x.reserved[r.id], r.held))
	x.eachSet(func(s, set uint64) {
		if set&(1<<b) != 0 {
			r.ids.put(s, s)
		}
	})
	r.held = 0
}

// has reports whether rank b holds the block of sequence hash s.
func (x *Single) has(b int, s uint64) bool {
	return x.setOf(s)&(1<<b) != 0
}

// Apply applies one event, with Index.Apply's outcomes and counters.
func (x *Single) Apply(ev *kv.Event) error {
	st := &x.stats
	st.Events++
	if ev.Tier != kv.TierDevice {
		st.UnknownTier++
		return ErrUnknownTier
	}
	switch ev.Kind {
	case kv.KindStored:
		st.StoredEvents++
		return x.store(ev.Worker, &ev.Stored)
	case kv.KindRemoved:
		st.RemovedEvents++
		b, ok := x.rank(ev.Worker, false)
		if !ok {
			st.UnknownBlocks += uint64(len(ev.Removed.EngineHashes))
			return nil
		}
		x.remove(b, ev.Removed.EngineHashes)
	case kv.KindCleared:
		st.ClearedEvents++
		if b, ok := x.rank(ev.Worker, false); ok {
			x.clear(b)
		}
	default:
		st.UnknownKind++
		return ErrUnknownKind
	}
	return nil
}

func (x *Single) store(w kv.Worker, sd *kv.Stored) error {
	if len(sd.Blocks) == 0 {
		x.stats.EmptyStored++
		return ErrEmptyStored
	}
	b, ok := x.rank(w, true)
	if !ok {
		return ErrTooManyRanks
	}
	r := &x.ranks[b]
	var seq uint64
	root := sd.Parent == nil
	if !root {
		if r.named {
			seq, ok = r.ids.get(*sd.Parent)
		} else {
			seq, ok = *sd.Parent, x.has(b, *sd.Parent)
		}
		if !ok {
			x.stats.UnknownParent++
			return ErrUnknownParent
		}
	}
	blocks := sd.Blocks
	// In chunks, as Index applies them, so that a rank's bound refuses
	// the same tail.
	for len(blocks) > 0 {
		n := min(len(blocks), applyChunk)
		if r.bound > 0 {
			if room := r.bound - r.blocks(); room < n {
				room = max(room, 0)
				x.refused[w] += uint64(len(blocks) - room)
				x.stats.BlocksOverBound += uint64(len(blocks) - room)
				blocks, n = blocks[:room], room
			}
		}
		if n == 0 {
			break
		}
		seqs := x.warmStore(r, seq, root, blocks[:n])
		for i, blk := range blocks[:n] {
			s := seqs[i]
			if !r.named {
				if blk.EngineHash == s {
					x.holdSeq(b, s)
					continue
				}
				x.name(b)
			}
			old, had := r.ids.put(blk.EngineHash, s)
			switch {
			case !had:
			case old == s:
				x.stats.DuplicateBlocks++
				continue
			default:
				x.stats.DuplicateBlocks++
				x.unref(b, old)
			}
			x.hold(b, s)
			x.stats.BlocksStored++
		}
		seq, root = seqs[n-1], false
		blocks = blocks[n:]
	}
	return nil
}

// warmStore returns the sequence hashes of blocks below parent (the root
// when root is set) and asks for the slots storing them will touch.
func (x *Single) warmStore(r *singleRank, parent uint64, root bool, blocks []kv.Block) []uint64 {
	seqs := x.seqs[:0]
	for i, blk := range blocks {
		if i == 0 && root {
			parent = blk.LocalHash
		} else {
			parent = blockhash.Chain(parent, blk.LocalHash)
		}
		seqs = append(seqs, parent)
		if x.wide {
			x.bySeq.prefetchRun(parent)
		} else {
			x.sets.prefetchRun(parent)
		}
		if r.named {
			r.ids.prefetchRun(blk.EngineHash)
		}
	}
	x.seqs = seqs
	return seqs
}

// hold records that rank b holds the block of sequence hash s under one
// more engine id.
func (x *Single) hold(b int, s uint64) {
	if x.addRank(b, s) {
		r := &x.ranks[b]
		if r.extra == nil {
			r.extra = map[uint64]uint32{}
		}
		r.extra[s]++
		return
	}
	x.pairs++
}

// holdSeq is store's step for one block of a rank without an id table,
// named by its sequence hash s.
func (x *Single) holdSeq(b int, s uint64) {
	var had bool
	if x.wide {
		had = x.bySeq.addBit(s, 1<<b)
	} else {
		had = x.sets.add(s, 1<<b)
	}
	if had {
		x.stats.DuplicateBlocks++
		return
	}
	x.pairs++
	x.ranks[b].held++
	x.stats.BlocksStored++
}

// unref drops one engine id of rank b naming the block of sequence hash s.
func (x *Single) unref(b int, s uint64) {
	if dropExtraRef(x.ranks[b].extra, s) {
		return
	}
	if x.dropRank(b, s) {
		x.pairs--
	}
}

func (x *Single) remove(b int, hashes []uint64) {
	r := &x.ranks[b]
	if !r.named {
		x.removeSeqs(b, hashes)
		return
	}
	for len(hashes) > 0 {
		n := min(len(hashes), applyChunk)
		chunk := hashes[:n]
		hashes = hashes[n:]
		for _, h := range chunk {
			r.ids.prefetchRun(h)
		}
		for _, h := range chunk {
			if s, ok := r.ids.get(h); ok {
				x.prefetchSet(s, true)
			}
		}
		for _, h := range chunk {
			s, ok := r.ids.take(h)
			if !ok {
				x.stats.UnknownBlocks++
				continue
			}
			x.unref(b, s)
			x.stats.BlocksRemoved++
		}
	}
}

// removeSeqs is remove for a rank without an id table.
func (x *Single) removeSeqs(b int, hashes []uint64) {
	r := &x.ranks[b]
	for len(hashes) > 0 {
		n := min(len(hashes), applyChunk)
		chunk := hashes[:n]
		hashes = hashes[n:]
		for _, h := range chunk {
			if x.wide {
				x.bySeq.prefetchRun(h)
			} else {
				x.sets.prefetchRun(h)
			}
		}
		for _, h := range chunk {
			var had bool
			if x.wide {
				had = x.bySeq.removeBit(h, 1<<b)
			} else {
				had = x.sets.remove(h, 1<<b)
			}
			if !had {
				x.stats.UnknownBlocks++
				continue
			}
			r.held--
			x.pairs--
			x.stats.BlocksRemoved++
		}
	}
}

// clear drops every block of rank b; the rank keeps its bit.
func (x *Single) clear(b int) {
	r := &x.ranks[b]
	if !r.named {
		x.eachSet(func(s, set uint64) {
			if set&(1<<b) != 0 {
				x.unheld = append(x.unheld, s)
			}
		})
		for _, s := range x.unheld {
			if x.dropRank(b, s) {
				x.pairs--
			}
		}
		x.unheld = x.unheld[:0]
		r.held = 0
		return
	}
	r.ids.each(func(_, s uint64) {
		if x.dropRank(b, s) {
			x.pairs--
		}
	})
	r.ids.reset()
	r.extra = nil
}

// drop forgets rank b and frees its bit.
func (x *Single) drop(b int) {
	x.clear(b)
	delete(x.bitOf, x.ranks[b].id)
	x.ranks[b] = singleRank{}
	x.used &^= 1 << b
}

// FindMatches is Index.FindMatches: every rank holding seq[0], with how
// many leading blocks of seq it holds, in no particular order.
func (x *Single) FindMatches(m *Matcher, seq []uint64) []Overlap {
	m.out = m.out[:0]
	m.tiers.out = m.tiers.out[:0]
	m.tiers.sharedRoot = 0
	if len(seq) == 0 {
		return m.out
	}
	// The probes do not depend on each other: ask for those ahead.
	const ahead = 8
	for i := 1; i < min(len(seq), ahead); i++ {
		x.prefetchSet(seq[i], false)
	}
	active := x.setOf(seq[0])
	d := 1
	for ; d < len(seq) && active != 0; d++ {
		if d+ahead-1 < len(seq) {
			x.prefetchSet(seq[d+ahead-1], false)
		}
		h := x.setOf(seq[d])
		m.out = x.emit(m.out, active&^h, d)
		active &= h
	}
	return x.emit(m.out, active, d)
}

func (x *Single) emit(out []Overlap, set uint64, depth int) []Overlap {
	for ; set != 0; set &= set - 1 {
		out = append(out, Overlap{Worker: x.ranks[bits.TrailingZeros64(set)].id, Blocks: uint32(depth)})
	}
	return out
}

// Reserve is Index.Reserve.
func (x *Single) Reserve(w kv.Worker, blocks int) {
	if blocks <= 0 {
		delete(x.reserved, w)
	} else {
		x.reserved[w] = blocks
	}
	if b, ok := x.rank(w, false); ok {
		if x.ranks[b].named {
			x.ranks[b].ids.reserve(blocks)
		}
		x.ranks[b].bound = RankBound(blocks)
	}
	if x.wide {
		x.bySeq.reserve(x.reservedBlocks())
	} else {
		x.sets.reserve(x.reservedBlocks())
	}
}

func (x *Single) reservedBlocks() int {
	total := 0
	for _, n := range x.reserved {
		total += n
	}
	return total
}

// OverBound is Index.OverBound.
func (x *Single) OverBound() []OverBound {
	var out []OverBound
	for w, n := range x.refused {
		ob := OverBound{Worker: w, Bound: RankBound(x.reserved[w]), Refused: n}
		if b, ok := x.rank(w, false); ok {
			ob.Blocks = x.ranks[b].blocks()
		}
		out = append(out, ob)
	}
	return out
}

// RemoveWorker is Index.RemoveWorker.
func (x *Single) RemoveWorker(id uint64) {
	for w := range x.reserved {
		if w.ID == id {
			delete(x.reserved, w)
		}
	}
	for w := range x.refused {
		if w.ID == id {
			delete(x.refused, w)
		}
	}
	for w, b := range x.bitOf {
		if w.ID == id {
			x.drop(b)
		}
	}
}

// RemoveRank is Index.RemoveRank.
func (x *Single) RemoveRank(w kv.Worker) {
	if b, ok := x.rank(w, false); ok {
		x.drop(b)
	}
}

// Blocks is Index.Blocks.
func (x *Single) Blocks(w kv.Worker) int {
	if b, ok := x.rank(w, false); ok {
		return x.ranks[b].blocks()
	}
	return 0
}

// Held is Index.Held.
func (x *Single) Held(w kv.Worker) []uint64 {
	out, _ := x.HeldOn(w, kv.TierDevice)
	return out
}

// HeldOn is Index.HeldOn; a Single holds nothing below the device.
func (x *Single) HeldOn(w kv.Worker, tier kv.StorageTier) ([]uint64, bool) {
	if _, ok := lowerOf(tier); !ok {
		return nil, false
	}
	b, ok := x.rank(w, false)
	if tier != kv.TierDevice || !ok {
		return nil, true
	}
	r := &x.ranks[b]
	out := make([]uint64, 0, r.blocks())
	if !r.named {
		x.eachSet(func(s, set uint64) {
			if set&(1<<b) != 0 {
				out = append(out, s)
			}
		})
		return out, true
	}
	seen := make(map[uint64]bool, r.ids.n)
	r.ids.each(func(_, s uint64) {
		if !seen[s] {
			seen[s] = true
			out = append(out, s)
		}
	})
	return out, true
}

// Inferred is Index.Inferred: a Single infers no block.
func (x *Single) Inferred(kv.Worker) int { return 0 }

// Pairs is Index.Pairs.
func (x *Single) Pairs() uint64 { return x.pairs }

// Stats is Index.Stats.
func (x *Single) Stats() Stats { return x.stats }

// pairMap is an open-addressing table from a uint64 key to a uint64 value: linear probing, deletion by shifting the run back, key 0
// kept aside (an empty slot's key is 0). 16 bytes a slot, four to a cache
// line.
type pairMap struct {
	slots    []pairSlot
	shift    uint8
	n        int
	zero     pairSlot
	hasZero  bool
	minSlots int
}

type pairSlot struct{ k, v uint64 }

// home is the first slot of k's home line: a key's run starts at the
// start of a 64-byte line (tables of 2^n slots of 16 bytes are aligned to
// their size or to a huge page), so that two lines
// hold it but for the longest runs, and lookups, whose runs most often end
// in the home line, rarely read the next.
func (p *pairMap) home(k uint64) int { return int((k*mixer)>>p.shift) &^ 3 }

// reserve sizes p for n keys without growing.
func (p *pairMap) reserve(n int) {
	want := slotsFor(n, 16)
	p.minSlots = want
	if want > len(p.slots) {
		p.rehash(want)
	}
}

func (p *pairMap) rehash(size int) {
	old := p.slots
	p.slots = hugepage.Make[pairSlot](size)
	p.shift = uint8(64 - bits.TrailingZeros(uint(size)))
	for _, s := range old {
		if s.k != 0 {
			i := p.home(s.k)
			for p.slots[i].k != 0 {
				i = (i + 1) & (len(p.slots) - 1)
			}
			p.slots[i] = s
		}
	}
}

func (p *pairMap) prefetch(k uint64) {
	if len(p.slots) > 0 {
		prefetch.Line(unsafe.Pointer(&p.slots[p.home(k)]))
	}
}

// prefetchRun is prefetch for an insertion or a deletion, which read on
// past k's slot (to the run's end, and a deletion shifts the run back):
// it also asks for the line after k's home line, where a run that fills
// its home line goes on.
func (p *pairMap) prefetchRun(k uint64) {
	if len(p.slots) > 0 {
		h := p.home(k)
		prefetch.Line(unsafe.Pointer(&p.slots[h]))
		prefetch.Line(unsafe.Pointer(&p.slots[(h+4)&(len(p.slots)-1)]))
	}
}

// find returns k's slot.
func (p *pairMap) find(k uint64) (*pairSlot, bool) {
	if k == 0 {
		return &p.zero, p.hasZero
	}
	if len(p.slots) == 0 {
		return nil, false
	}
	if s, ok := p.probe(k); ok {
		return s, true
	}
	return nil, false
}

// probe returns k's slot if present, else the empty slot where it would
// go; the table must have one.
func (p *pairMap) probe(k uint64) (*pairSlot, bool) {
	mask := len(p.slots) - 1
	for i := p.home(k); ; i = (i + 1) & mask {
		s := &p.slots[i]
		if s.k == k {
			return s, true
		}
		if s.k == 0 {
			return s, false
		}
	}
}

func (p *pairMap) get(k uint64) (uint64, bool) {
	if s, ok := p.find(k); ok {
		return s.v, true
	}
	return 0, false
}

// slot returns k's slot, adding it with value 0 when missing.
func (p *pairMap) slot(k uint64) (*pairSlot, bool) {
	if k == 0 {
		if !p.hasZero {
			p.hasZero, p.zero.v = true, 0
			p.n++
			return &p.zero, false
		}
		return &p.zero, true
	}
	if (p.n+1)*4 > len(p.slots)*3 {
		p.rehash(max(2*len(p.slots), 16))
	}
	s, ok := p.probe(k)
	if !ok {
		s.k, s.v = k, 0
		p.n++
	}
	return s, ok
}

// addBit sets bit in k's value, adding k, and reports whether it was set.
func (p *pairMap) addBit(k, bit uint64) bool {
	s, had := p.slot(k)
	if had && s.v&bit != 0 {
		return true
	}
	s.v |= bit
	return false
}

// removeBit clears bit in k's value, removing k with its last bit, and
// reports whether it was set.
func (p *pairMap) removeBit(k, bit uint64) bool {
	s, ok := p.find(k)
	if !ok || s.v&bit == 0 {
		return false
	}
	if s.v &^= bit; s.v == 0 {
		p.drop(s)
	}
	return true
}

// put maps k to v and returns the value it replaced.
func (p *pairMap) put(k, v uint64) (old uint64, had bool) {
	s, had := p.slot(k)
	old, s.v = s.v, v
	return old, had
}

// take removes k and returns its value.
func (p *pairMap) take(k uint64) (uint64, bool) {
	if k == 0 {
		if !p.hasZero {
			return 0, false
		}
		p.hasZero = false
		p.n--
		return p.zero.v, true
	}
	if len(p.slots) == 0 {
		return 0, false
	}
	s, ok := p.probe(k)
	if !ok {
		return 0, false
	}
	v := s.v
	p.drop(s)
	return v, true
}

// drop removes the entry in slot s, as find or slot returned it: the
// caller that has just found a key deletes it without probing again.
func (p *pairMap) drop(s *pairSlot) {
	if s == &p.zero {
		p.hasZero = false
		p.n--
		return
	}
	mask := len(p.slots) - 1
	i := int((uintptr(unsafe.Pointer(s)) - uintptr(unsafe.Pointer(&p.slots[0]))) / unsafe.Sizeof(pairSlot{}))
	// Shift back the entries after i whose home does not lie in (i, j].
	for j := (i + 1) & mask; p.slots[j].k != 0; j = (j + 1) & mask {
		if h := p.home(p.slots[j].k); (j-h)&mask >= (j-i)&mask {
			p.slots[i] = p.slots[j]
			i = j
		}
	}
	p.slots[i] = pairSlot{}
	p.n--
}

func (p *pairMap) each(f func(k, v uint64)) {
	if p.hasZero {
		f(0, p.zero.v)
	}
	for _, s := range p.slots {
		if s.k != 0 {
			f(s.k, s.v)
		}
	}
}

// reset empties p, keeping its reserved size.
func (p *pairMap) reset() {
	if len(p.slots) > p.minSlots {
		*p = pairMap{minSlots: p.minSlots}
		if p.minSlots > 0 {
			p.rehash(p.minSlots)
		}
		return
	}
	clear(p.slots)
	p.n, p.hasZero = 0, false
}
