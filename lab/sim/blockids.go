package sim

import (
	"math/bits"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/lab/trace"
	"github.com/kvrouter/kvrouter/lab/workload"
	"github.com/kvrouter/kvrouter/mocker/engine"
)

// The engines of a run name their blocks by the router's sequence hashes
// (engine.Config.SequenceHashIDs), as Dynamo's mocker does: a real
// engine's ids are opaque to the router, which maps them to sequence
// hashes per engine, so any naming of blocks that gives equal blocks equal
// ids and unequal blocks unequal ones routes alike, and this one lets
// the loop hash each prompt once for the router and the engine both
// (the router's hashes of it, the engine's ids, and the local hashes of
// its Stored events were three hashings of every block), and lets the
// router's index skip its id table (index.Single).
//
// blockHashes are the local and sequence hashes of the requests' prompt
// blocks, at the engines' block size, computed when a request is first
// routed or started. A conversation's every turn sends its earlier turns'
// blocks again: on a trace, a request takes the hashes of the prefix it
// shares with the earlier request holding one of its hash ids at the same
// place (its previous turn), whose tokens are equal since a hash id's
// tokens are a function of the id, and hashes only the rest; on a
// generated workload, its session's previous turn, whose prompt is the
// start of its own (extensions).
type blockHashes struct {
	on bool
	bs int
	// router: the router hashes at the engines' block size, so it takes
	// the requests' local hashes.
	router bool
	// local[i] and seq[i] are request i's, under its own salt, once
	// hashed; dropped when it has started and no later turn needs them.
	local, seq [][]uint64
	// salted[i]: request i's were hashed under a cache salt, which a
	// later turn must not take.
	salted []bool
	// prev[i] is the earlier request whose prompt request i's extends:
	// on a trace the one that holds one of its hash ids at the same
	// place, the latest for the last such id; the turn before it, in a
	// conversation. -1 for none, and nil on a workload that cannot tell.
	prev []int32
	// share[i] is how many leading tokens request i's prompt shares with
	// request prev[i]'s.
	share []int32
	// needed[i] counts the later requests whose prev is i and which have
	// not been hashed yet.
	needed  []int32
	started []bool
	// recycles: the loop tells when an engine is done with a request's
	// hashes (engineDone), which then go to free for later requests'
	// once no later turn needs them either: fresh memory for every
	// prompt's hashes cost more than hashing them. done[i]: request i's
	// engine is done with them.
	recycles bool
	done     []bool
	// poison overwrites the room of the lists taken over (move) with
	// hashes of no block, in a run that poisons its skipped blocks.
	poison bool
	free   [bits.UintSize][][]uint64
	reused int // lists taken from free
	// moves lets a later turn take its previous turn's lists over
	// (movable); moved counts those it took.
	moves bool
	moved int
	// hits and misses count the blocks whose hashes were taken and
	// computed.
	hits, misses int
}

// sequenceHashIDs reports whether the engines name their blocks by
// sequence hashes: not with KV-cache groups (a hybrid model's groups have
// ids of their own), nor for tests that keep the engines' own ids.
func (c *Config) sequenceHashIDs() bool {
	return !c.ownBlockIDs && len(c.Engine.KVCacheGroups) == 0
}

// initBlockHashes has the run hand over its prompts' hashes when its
// engines name blocks by sequence hashes, all at one block size; prev and
// share are the workload's extensions.
func (s *sim) initBlockHashes(prev, share []int32) {
	if s.cfg.noBlockIDs || !s.cfg.sequenceHashIDs() || !s.cfg.Engine.EnablePrefixCaching {
		return
	}
	m := &s.ids
	m.bs = s.engines[0].eng.Config().BlockSize
	for i := range s.engines {
		if c := s.engines[i].eng.Config(); c.BlockSize != m.bs || !c.SequenceHashIDs {
			return
		}
	}
	n := s.w.Len()
	m.on, m.router = true, s.r.BlockSize() == m.bs
	m.local, m.seq = make([][]uint64, n), make([][]uint64, n)
	m.salted, m.started = make([]bool, n), make([]bool, n)
	m.moves = !s.cfg.copyHashes
	if m.recycles = s.prompts.given != nil; m.recycles {
		m.done = make([]bool, n)
	}
	if m.prev, m.share = prev, share; m.prev != nil {
		m.needed = successors(m.prev)
	}
}

// extensions finds the earlier request each request of w extends, and
// how many leading tokens of its prompt it shares with it: prev[i] is -1
// for none, and prev is nil on a workload that cannot tell. A trace's are
// shared by all its runs: read only.
func extensions(w Workload) (prev, share []int32) {
	switch w := w.(type) {
	case *Trace:
		w.ext.once.Do(func() { w.ext.prev, w.ext.share = traceExtensions(w) })
		return w.ext.prev, w.ext.share
	case Requests:
		return extendedTurns(w)
	}
	return nil, nil
}

// successors counts, for each request, the later ones that extend it.
func successors(prev []int32) []int32 {
	n := make([]int32, len(prev))
	for _, p := range prev {
		if p >= 0 {
			n[p]++
		}
	}
	return n
}

// extendedTurns finds the earlier turn each prompt of a materialised
// workload extends: a prompt is a longer view of the memory of its
// session's previous turn (workload.Synthetic and Agentic build a
// session's turns in one array), so its tokens are that turn's and more,
// as far as the shorter prompt reaches. A request is extended by at most
// one later request: the next view of its array.
func extendedTurns(reqs Requests) (prev, share []int32) {
	n := len(reqs)
	prev, share = make([]int32, n), make([]int32, n)
	last := map[*uint32]int32{}
	for i := range reqs {
		prev[i] = -1
		toks := reqs[i].Tokens
		if len(toks) == 0 {
			continue
		}
		if p, ok := last[&toks[0]]; ok && len(reqs[p].Tokens) <= len(toks) {
			prev[i], share[i] = p, int32(len(reqs[p].Tokens))
		}
		last[&toks[0]] = int32(i)
	}
	return prev, share
}

// traceExtensions finds the earlier request each trace request shares a
// prefix with, by their hash ids: the one that holds one of its ids at
// the same place, the latest for the last such id. A hash id's tokens
// are a function of the id, so the shared ids' tokens are equal (as far
// as both prompts reach). Several later requests may extend one.
func traceExtensions(t *Trace) (prev, share []int32) {
	n := t.Len()
	prev, share = make([]int32, n), make([]int32, n)
	type at struct{ req, pos int32 }
	last := make([]at, t.numIDs)
	for k := range last {
		last[k].req = -1
	}
	for i, dense := range t.dense {
		prev[i] = -1
		for j := len(dense) - 1; j >= 0; j-- {
			if l := last[dense[j]]; l.req >= 0 && int(l.pos) == j {
				prev[i] = l.req
				share[i] = int32(t.shared(i, int(l.req), len(dense)) * trace.BlockTokens)
				break
			}
		}
		for j, d := range dense {
			last[d] = at{int32(i), int32(j)}
		}
	}
	return prev, share
}

// hashes are request i's local and sequence hashes, of the full blocks of
// its prompt under its cache salt: nil when the run hands over none.
func (s *sim) hashes(i int, req *workload.Request) (local, seq []uint64) {
	m := &s.ids
	if !m.on {
		return nil, nil
	}
	if m.seq[i] != nil {
		return m.local[i], m.seq[i]
	}
	toks := req.Tokens
	full := len(toks) / m.bs
	// Room for the blocks the engine fills with generated tokens: it
	// appends their hashes in place (engine.Request.Owned).
	room := (len(toks) + req.OSL) / m.bs
	if p := m.extended(i); p >= 0 {
		n := m.taken(i, req.CacheSalt, full)
		if m.movable(p, n, room) {
			local, seq = m.move(p, n)
		} else {
			local, seq = append(m.take(room), m.local[p][:n]...), append(m.take(room), m.seq[p][:n]...)
		}
		m.needed[p]--
		m.drop(p)
	} else {
		local, seq = m.take(room), m.take(room)
	}
	m.hits += len(seq)
	m.misses += full - len(seq)
	h := blockhash.NewKeyed(m.bs, "", req.CacheSalt)
	rest := toks[len(seq)*m.bs : full*m.bs]
	if len(seq) == 0 {
		local, seq = h.AppendHashes(local, seq, rest)
	} else {
		local, seq = h.AppendChainedHashes(local, seq, seq[len(seq)-1], rest)
	}
	m.local[i], m.seq[i], m.salted[i] = local, seq, req.CacheSalt != ""
	return local, seq
}

// extended is the earlier request whose prompt request i's extends, -1
// for none or when the workload cannot tell.
func (m *blockHashes) extended(i int) int {
	if m.prev == nil {
		return -1
	}
	return int(m.prev[i])
}

// movable reports whether the request that takes the first n of request
// p's hashes, and needs lists of room for more than room, may take p's
// lists themselves: p's engine is done with them, so nothing reads them
// again but the taker, and no other later turn would take them (it
// would hash its blocks afresh, not copy them). Copying them, for every
// turn of a conversation, was nearly as much work as hashing the turn's
// new blocks.
func (m *blockHashes) movable(p, n, room int) bool {
	return n > 0 && m.moves && m.recycles && m.done[p] && m.needed[p] == 1 && cap(m.local[p]) > room && cap(m.seq[p]) > room
}

// move takes request p's lists over, holding its first n hashes.
func (m *blockHashes) move(p, n int) (local, seq []uint64) {
	local, seq = m.local[p][:n], m.seq[p][:n]
	m.local[p], m.seq[p] = nil, nil
	m.moved++
	if m.poison {
		// The taker appends its own: had it read past them, it would
		// see hashes of no block.
		poisonHashes(local[n:cap(local)])
		poisonHashes(seq[n:cap(seq)])
	}
	return local, seq
}

// taken is how many leading blocks of request i's prompt, of full blocks
// under salt, hashes takes from its previous turn's if it hashes the
// prompt now: the tokens of those blocks are read by nothing else when
// the router takes the hashes too (see promptPool.lazy).
func (m *blockHashes) taken(i int, salt string, full int) int {
	if m.prev == nil {
		return 0
	}
	p := m.prev[i]
	if p < 0 || salt != "" || m.seq[p] == nil || m.salted[p] {
		return 0
	}
	return min(int(m.share[i])/m.bs, full, len(m.seq[p]))
}

// drop forgets request i's hashes once it has started and every later
// turn that takes them has been hashed, and frees them once its engine
// is done with them too.
func (m *blockHashes) drop(i int) {
	if !m.started[i] || m.needed != nil && m.needed[i] > 0 || m.recycles && !m.done[i] {
		return
	}
	if m.recycles {
		m.put(m.local[i])
		m.put(m.seq[i])
	}
	m.local[i], m.seq[i] = nil, nil
}

// engineDone hears that request i's engine is done with its hashes.
func (m *blockHashes) engineDone(i int, how promptDisposal) {
	if !m.recycles || m.seq[i] == nil {
		return
	}
	m.done[i] = true
	if how == poisonPrompts {
		// Overwritten and never handed out again: a run that still
		// read them would see other blocks.
		for _, l := range [][]uint64{m.local[i], m.seq[i]} {
			l = l[:cap(l)]
			for k := range l {
				l[k] = ^uint64(0)
			}
		}
		m.local[i], m.seq[i] = nil, nil
		return
	}
	m.drop(i)
}

// take is an empty list of room for n hashes, a freed one when there is
// one of its size class (powers of two).
func (m *blockHashes) take(n int) []uint64 {
	c := bits.Len(uint(n))
	if free := m.free[c]; len(free) > 0 {
		l := free[len(free)-1]
		m.free[c] = free[:len(free)-1]
		m.reused++
		return l
	}
	if !m.recycles {
		return make([]uint64, 0, n)
	}
	return make([]uint64, 0, 1<<c)
}

// poisonHashes overwrites l with hashes of no block.
func poisonHashes(l []uint64) {
	for k := range l {
		l[k] = ^uint64(0)
	}
}

func (m *blockHashes) put(l []uint64) {
	if c := bits.Len(uint(cap(l))) - 1; c >= 0 && cap(l) == 1<<c {
		m.free[c] = append(m.free[c], l[:0])
	}
}

// routerHashes are the router's local and sequence hashes of request i's
// prompt blocks under salt, the salt the router keys it by; nil when the
// run hands the router none.
func (s *sim) routerHashes(i int, req *workload.Request, salt string) (local, seq []uint64) {
	if !s.ids.router || salt != req.CacheSalt {
		return nil, nil
	}
	return s.hashes(i, req)
}

// startHashes are request i's hashes for its engine (engine.Request's
// BlockIDs and LocalHashes), which the engine takes over.
func (s *sim) startHashes(i int, req *workload.Request) (seq, local []uint64) {
	local, seq = s.hashes(i, req)
	if s.ids.on {
		s.ids.started[i] = true
		s.ids.drop(i)
	}
	return seq, local
}

// storedLocal are the local hashes of a Stored event's blocks for the
// router: the engine's, when the router keys the blocks as the engine
// did.
func (s *sim) storedLocal(ev *engine.BlockEvent) []uint64 {
	if s.cfg.IgnoreCacheSalt || ev.LoRAName != "" {
		return nil
	}
	return ev.LocalHashes
}

// shared is how many leading hash ids requests i and p have in common,
// at most n: their prompts' first blocks of 512 tokens that are equal.
func (t *Trace) shared(i, p, n int) int {
	k := 0
	for k < n && k < len(t.dense[p]) && t.dense[i][k] == t.dense[p][k] {
		k++
	}
	return k
}
