package engine

import (
	"container/list"
	"fmt"
	"strconv"
	"strings"
)

// KV-cache groups of a hybrid model.
//
// vLLM gives a hybrid model (sliding-window and full-attention layers,
// Mamba and attention layers) one KV-cache group per kind of layer, each
// with its own blocks and block size, and publishes every group's events
// with its group_idx and kind. The engine models that with
// Config.KVCacheGroups: the first main-attention group is the engine's own
// (its scheduling, prefix hits and KV usage are the blocks described in the
// package doc); every other group caches the same tokens in blocks of its
// own size alongside it:
//
//   - a block of the group is Stored when the request's computed tokens
//     fill it, with an id computed as the engine's own ids are (the same
//     content at the same block size has the same id in every group, as in
//     vLLM, whose block hash does not mix in the group);
//   - a block shared by several requests is stored once (refcount), and a
//     released one stays cached until the group holds more than
//     NumGPUBlocks blocks, when the least recently used is Removed;
//   - a sliding-window group (SlidingWindow > 0) drops a request's blocks
//     once they lie wholly before its window, Removed at once when no other
//     request holds them: they are no longer attended to, hence not a
//     prefix anyone can reuse.
//
// Those groups cost no slots, time or KV usage: they are there for their
// events.

// KVCacheGroup is one KV-cache group, as vLLM's KV events describe it.
type KVCacheGroup struct {
	// Kind is vLLM's kv_cache_spec_kind: full_attention, mla_attention,
	// sink_full_attention, sliding_window, sliding_window_mla,
	// chunked_local_attention or mamba.
	Kind string
	// BlockSize is the group's tokens per block; 0 for the engine's own
	// group means Config.BlockSize.
	BlockSize int
	// SlidingWindow is the window in tokens of a windowed kind, else 0.
	SlidingWindow int
}

func (g KVCacheGroup) String() string {
	s := g.Kind
	if g.BlockSize > 0 {
		s += ":" + strconv.Itoa(g.BlockSize)
	}
	if g.SlidingWindow > 0 {
		s += ":" + strconv.Itoa(g.SlidingWindow)
	}
	return s
}

// mainKinds are the kinds whose blocks form a reusable prefix of any length.
var mainKinds = map[string]bool{"full_attention": true, "mla_attention": true, "sink_full_attention": true}

// windowKinds attend to a window of recent tokens only.
var windowKinds = map[string]bool{"sliding_window": true, "sliding_window_mla": true, "chunked_local_attention": true}

// kindAliases are the short names the flag accepts.
var kindAliases = map[string]string{"full": "full_attention", "mla": "mla_attention", "sliding": "sliding_window"}

// ParseKVCacheGroups reads --kv-cache-groups: comma-separated
// kind[:block_size[:window]] in group_idx order, e.g.
// "sliding_window:32:4096,full_attention:16". A windowed kind needs its
// window; the engine's own group (the first main-attention one) may leave
// its block size to --block-size. "" means no groups (a plain model).
func ParseKVCacheGroups(s string) ([]KVCacheGroup, error) {
	if strings.TrimSpace(s) == "" {
		return nil, nil
	}
	var out []KVCacheGroup
	for i, part := range strings.Split(s, ",") {
		f := strings.Split(strings.TrimSpace(part), ":")
		g := KVCacheGroup{Kind: f[0]}
		if k, ok := kindAliases[g.Kind]; ok {
			g.Kind = k
		}
		if len(f) > 3 {
			return nil, fmt.Errorf("kv-cache group %d %q: want kind[:block_size[:window]]", i, part)
		}
		for j, dst := range []*int{&g.BlockSize, &g.SlidingWindow} {
			if len(f) <= j+1 {
				break
			}
			n, err := strconv.Atoi(f[j+1])
			if err != nil || n <= 0 {
				return nil, fmt.Errorf("kv-cache group %d %q: %q is not a positive number of tokens", i, part, f[j+1])
			}
			*dst = n
		}
		out = append(out, g)
	}
	if _, err := mainGroup(out); err != nil {
		return nil, err
	}
	for i, g := range out {
		if err := g.validate(i); err != nil {
			return nil, err
		}
	}
	return out, nil
}

func (g KVCacheGroup) validate(i int) error {
	switch {
	case !mainKinds[g.Kind] && !windowKinds[g.Kind] && g.Kind != "mamba":
		return fmt.Errorf("kv-cache group %d: unknown kind %q (full_attention, mla_attention, sink_full_attention, sliding_window, sliding_window_mla, chunked_local_attention, mamba)", i, g.Kind)
	case windowKinds[g.Kind] && g.SlidingWindow <= 0:
		return fmt.Errorf("kv-cache group %d: %s needs its window: %s:BLOCK_SIZE:WINDOW", i, g.Kind, g.Kind)
	case !windowKinds[g.Kind] && g.SlidingWindow != 0:
		return fmt.Errorf("kv-cache group %d: %s has no window", i, g.Kind)
	case g.BlockSize < 0 || g.SlidingWindow < 0:
		return fmt.Errorf("kv-cache group %d: negative size", i)
	}
	return nil
}

// mainGroup is the index of the engine's own group: the first
// main-attention one.
func mainGroup(groups []KVCacheGroup) (int, error) {
	for i, g := range groups {
		if mainKinds[g.Kind] {
			return i, nil
		}
	}
	return 0, fmt.Errorf("kv-cache groups %v: need a full-attention group (full_attention, mla_attention or sink_full_attention), whose blocks the engine schedules with", groups)
}

// Group describes the group of a BlockEvent's Group: its kind, block size
// and window. Without Config.KVCacheGroups, group 0 of kind "" (a plain
// model, whose events say nothing of groups) and Config.BlockSize.
func (c Config) Group(idx int) KVCacheGroup {
	if idx < 0 || idx >= len(c.KVCacheGroups) {
		return KVCacheGroup{BlockSize: c.BlockSize}
	}
	g := c.KVCacheGroups[idx]
	if g.BlockSize == 0 {
		g.BlockSize = c.BlockSize
	}
	return g
}

// OwnGroup is the group_idx of the engine's own blocks (those of
// CachedBlocks): the first main-attention group, 0 for a plain model.
func (c Config) OwnGroup() int {
	i, _ := mainGroup(c.KVCacheGroups)
	return i
}

// setupGroups checks cfg.KVCacheGroups and gives m the groups beside its own.
func (m *blockManager) setupGroups(cfg Config) error {
	if len(cfg.KVCacheGroups) == 0 {
		return nil
	}
	own, err := mainGroup(cfg.KVCacheGroups)
	if err != nil {
		return fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	for i, g := range cfg.KVCacheGroups {
		if err := g.validate(i); err != nil {
			return fmt.Errorf("%w: %v", ErrInvalid, err)
		}
		if i == own {
			if g.BlockSize != 0 && g.BlockSize != cfg.BlockSize {
				return fmt.Errorf("%w: kv-cache group %d (%s) has %d-token blocks, the engine's block size is %d", ErrInvalid, i, g.Kind, g.BlockSize, cfg.BlockSize)
			}
			continue
		}
		if g.BlockSize == 0 {
			return fmt.Errorf("%w: kv-cache group %d (%s) needs its block size", ErrInvalid, i, g.Kind)
		}
		m.groups = append(m.groups, &sideGroup{idx: i, KVCacheGroup: g, capacity: cfg.NumGPUBlocks, seed: cfg.Seed, blocks: map[uint64]*sideBlock{}, lru: list.New()})
	}
	m.group = own
	return nil
}

// sideGroup is a KV-cache group other than the engine's own.
type sideGroup struct {
	KVCacheGroup
	idx      int // group_idx
	capacity int // cached blocks kept
	seed     uint64
	blocks   map[uint64]*sideBlock
	lru      *list.List // ids of the blocks no request holds, least recent first
	evicted  []uint64   // scratch
}

type sideBlock struct {
	ref  int
	elem *list.Element // in lru while ref == 0
}

// sideSeq is what one request holds in a side group.
type sideSeq struct {
	hashes []uint64 // ids of its full blocks so far
	first  int      // blocks before it were dropped (out of the window)
}

// allocate is allocateOwn followed by the side groups' blocks for the same
// tokens.
func (m *blockManager) allocate(s *seqBlocks, upTo int) bool {
	if !m.allocateOwn(s, upTo) {
		return false
	}
	if len(m.groups) > 0 && m.caching {
		if s.groups == nil {
			s.groups = make([]sideSeq, len(m.groups))
		}
		for i, g := range m.groups {
			m.events = g.allocate(&s.groups[i], s.tokens, s.keys, upTo, m.events)
		}
	}
	return true
}

// allocate stores the blocks s's first upTo tokens fill and drops those
// that left the window, appending the events to evs. keys are the
// request's extra keys: a group keys its blocks by them as the engine's
// own group does.
func (g *sideGroup) allocate(s *sideSeq, tokens []uint32, keys *requestKeys, upTo int, evs []BlockEvent) []BlockEvent {
	bs := g.BlockSize
	from, full := len(s.hashes), upTo/bs
	start := -1 // first new block of the current run
	flush := func(end int) {
		if start < 0 {
			return
		}
		ev := BlockEvent{Kind: Stored, Group: g.idx, BlockHashes: s.hashes[start:end:end], TokenIDs: tokens[start*bs : end*bs : end*bs]}
		if start > 0 {
			p := s.hashes[start-1]
			ev.Parent = &p
		}
		if keys != nil {
			ev.LoRAName = keys.lora
			ev.ExtraKeys = blockKeys(keys, start, end, bs)
		}
		evs = append(evs, ev)
		start = -1
	}
	for i := from; i < full; i++ {
		var parent uint64
		if i > 0 {
			parent = s.hashes[i-1]
		}
		if keys != nil {
			parent ^= foldKeys(keys.block(i, bs))
		}
		h := hashBlock(g.seed, parent, tokens[i*bs:(i+1)*bs])
		s.hashes = append(s.hashes, h)
		if b, ok := g.blocks[h]; ok {
			g.hold(b)
			flush(i)
			continue
		}
		g.blocks[h] = &sideBlock{ref: 1}
		if start < 0 {
			start = i
		}
	}
	flush(full)
	if g.SlidingWindow > 0 {
		// The next token attends to the last SlidingWindow positions.
		drop := min(max(upTo-g.SlidingWindow, 0)/bs, len(s.hashes))
		for ; s.first < drop; s.first++ {
			h := s.hashes[s.first]
			if b := g.blocks[h]; b.ref == 1 {
				delete(g.blocks, h)
				g.evicted = append(g.evicted, h)
			} else {
				b.ref--
			}
		}
	}
	for len(g.blocks) > g.capacity && g.lru.Len() > 0 {
		h := g.lru.Remove(g.lru.Front()).(uint64)
		delete(g.blocks, h)
		g.evicted = append(g.evicted, h)
	}
	if len(g.evicted) > 0 {
		evs = append(evs, BlockEvent{Kind: Removed, Group: g.idx, BlockHashes: g.evicted})
		g.evicted = nil
	}
	return evs
}

func (g *sideGroup) hold(b *sideBlock) {
	if b.ref == 0 {
		g.lru.Remove(b.elem)
		b.elem = nil
	}
	b.ref++
}

// releaseGroups returns what s holds in the side groups, tail first; they
// stay cached until evicted.
func (m *blockManager) releaseGroups(s *seqBlocks) {
	for i, g := range m.groups {
		if i >= len(s.groups) {
			break
		}
		ss := &s.groups[i]
		for j := len(ss.hashes) - 1; j >= ss.first; j-- {
			h := ss.hashes[j]
			b := g.blocks[h]
			if b.ref--; b.ref == 0 {
				b.elem = g.lru.PushBack(h)
			}
		}
		*ss = sideSeq{}
	}
}

// resetGroups drops every side group's blocks (AllBlocksCleared covers
// every group).
func (m *blockManager) resetGroups() {
	for _, g := range m.groups {
		clear(g.blocks)
		g.lru.Init()
	}
}
