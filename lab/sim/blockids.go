package sim

import (
	"slices"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/lab/trace"
	"github.com/kvrouter/kvrouter/mocker/engine"
)

// blockIDMemo hands the engines the ids of the trace's prompt blocks
// (engine.Request.BlockIDs) at the trace's own block size, where each
// engine block is one hash id's 512 tokens. An engine id is a hash of the
// engine's seed, the parent block's id and the block's tokens, a chain of
// 128 multiplications per block that no reordering shortens; and a
// conversation's every turn sends its earlier turns' blocks again, mostly
// to the engine that ran the turn before. A hash id's tokens are a
// function of the id, so two prompts whose first n hash ids are equal
// have equal first n blocks, with equal ids on one engine: a request
// whose earlier turn went to the same engine takes the ids of the prefix
// they share, and only the rest are hashed.
type blockIDMemo struct {
	// prev[i] is an earlier request that holds one of request i's hash
	// ids at the same place, the latest for the last such id: the turn
	// before it, in a conversation. -1 for none.
	prev []int32
	// sent[i] are the ids request i was sent with, on the engine
	// engine[i]-1 (0: not sent yet).
	sent   [][]uint64
	engine []int32
	arena  []uint64
	// hits and misses count the blocks whose ids were taken and hashed.
	hits, misses int

	// local[i] are the router's local hashes of request i's full prompt
	// blocks, which the loop hands the router when it routes the request
	// (router.Request.LocalHashes) and again with the blocks' Stored
	// events (router.EngineStored.LocalHashes), taking those of the
	// prefix it shares with its previous turn: the router hashed every
	// prompt block once at routing and every stored one again. nil
	// without a router of the trace's block size.
	local  [][]uint64
	hasher blockhash.Hasher
}

// initBlockIDs makes the run's prompts carry block ids when it runs a
// trace at one engine block per hash id.
func (s *sim) initBlockIDs() {
	t, ok := s.w.(*Trace)
	if !ok || s.cfg.noBlockIDs || !s.cfg.Engine.EnablePrefixCaching {
		return
	}
	for i := range s.engines {
		if s.engines[i].eng.Config().BlockSize != trace.BlockTokens {
			return
		}
	}
	m := &s.ids
	if s.r.BlockSize() == trace.BlockTokens {
		m.local = make([][]uint64, t.Len())
		m.hasher = blockhash.NewKeyed(trace.BlockTokens, "", "")
	}
	m.prev = make([]int32, t.Len())
	m.sent = make([][]uint64, t.Len())
	m.engine = make([]int32, t.Len())
	type at struct{ req, pos int32 }
	last := make([]at, t.numIDs)
	for k := range last {
		last[k].req = -1
	}
	for i, dense := range t.dense {
		m.prev[i] = -1
		for j := len(dense) - 1; j >= 0; j-- {
			if l := last[dense[j]]; l.req >= 0 && int(l.pos) == j {
				m.prev[i] = l.req
				break
			}
		}
		for j, d := range dense {
			last[d] = at{int32(i), int32(j)}
		}
	}
}

// blockIDs are the engine ids of the full blocks of request i's prompt
// tokens on engine e; nil when the run's prompts carry none.
func (s *sim) blockIDs(i, e int, tokens []uint32, salt string) []uint64 {
	m := &s.ids
	if m.prev == nil || salt != "" {
		return nil
	}
	const bs = trace.BlockTokens
	t := s.w.(*Trace)
	full := len(tokens) / bs
	ids := m.take(full)
	if p := m.prev[i]; p >= 0 && m.engine[p] == int32(e+1) {
		from := m.sent[p]
		ids = append(ids, from[:t.shared(i, int(p), min(full, len(from)))]...)
	}
	m.hits += len(ids)
	m.misses += full - len(ids)
	seed := s.engines[e].seed
	var parent uint64
	if len(ids) > 0 {
		parent = ids[len(ids)-1]
	}
	for j := len(ids); j < full; j++ {
		parent = engine.BlockID(seed, parent, tokens[j*bs:(j+1)*bs])
		ids = append(ids, parent)
	}
	m.sent[i], m.engine[i] = slices.Clip(ids), int32(e+1)
	return ids
}

// localHashes are the router's local hashes of the full blocks of
// request i's prompt tokens; nil when the run hands the router none.
func (s *sim) localHashes(i int, tokens []uint32, salt string) []uint64 {
	m := &s.ids
	if m.local == nil || salt != "" {
		return nil
	}
	const bs = trace.BlockTokens
	t := s.w.(*Trace)
	full := len(tokens) / bs
	local := m.take(full)
	if p := m.prev[i]; p >= 0 {
		from := m.local[p]
		local = append(local, from[:t.shared(i, int(p), min(full, len(from)))]...)
	}
	local = m.hasher.AppendLocalHashes(local, tokens[len(local)*bs:full*bs])
	m.local[i] = local
	return local
}

// storedLocal are the local hashes of a Stored event's blocks that the
// loop computed for their request's prompt: a prefix of the blocks, or
// none.
func (s *sim) storedLocal(ev *engine.BlockEvent, salt string) []uint64 {
	if s.ids.local == nil || ev.Tag <= 0 || salt != "" || ev.LoRAName != "" {
		return nil
	}
	local := s.ids.local[ev.Tag-1]
	first := int(ev.First)
	if first >= len(local) {
		return nil
	}
	return local[first:min(first+len(ev.BlockHashes), len(local))]
}

// take is an empty slice with room for n hashes, from the arena: the
// hashes a request was sent with are kept for the run, for its next turn.
func (m *blockIDMemo) take(n int) []uint64 {
	if len(m.arena) < n {
		m.arena = make([]uint64, max(n, 1<<16))
	}
	out := m.arena[:0:n]
	m.arena = m.arena[n:]
	return out
}

// shared is how many leading hash ids requests i and p have in common,
// at most n: their prompts' first blocks of 512 tokens that are equal.
func (t *Trace) shared(i, p, n int) int {
	k := 0
	for k < n && t.dense[i][k] == t.dense[p][k] {
		k++
	}
	return k
}
