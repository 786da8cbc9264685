package sched

// The peer policies: what other routers do, written from their public
// descriptions so that `kvrouter bench replay` compares kvrouter's kv mode
// with them on the same fleet and trace. They are modes like any other and
// can serve real traffic.

import (
	"sync"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/prefixtree"
)

// Peer modes.
const (
	// ModeSGLangCacheAware is SGLang's router (sgl-model-gateway) in its
	// cache_aware policy: a prefix tree per worker learnt from its own
	// routing decisions, switching to the least loaded worker when loads
	// are imbalanced or the best match is short.
	ModeSGLangCacheAware Mode = "sglang-cache-aware"
	// ModeLLMDPrecise is llm-d's inference scheduler with the precise
	// (KV-event-fed) prefix-cache scorer, plus queue-depth and
	// KV-utilisation scorers read from the engines, equally weighted.
	ModeLLMDPrecise Mode = "llm-d-precise"
	// ModeGIEApproxPrefix is the Gateway API Inference Extension's endpoint
	// picker with its approximate prefix-cache scorer (hashed chunks
	// remembered per server from its own decisions) plus queue-depth and
	// KV-utilisation scorers, equally weighted.
	ModeGIEApproxPrefix Mode = "gie-approx-prefix"
)

// ReadsPrompt tells whether the mode's policy reads the prompt's tokens
// (Request.Tokens), keeping its own view of the workers' caches, rather
// than the router's block hashes.
func (m Mode) ReadsPrompt() bool {
	return m == ModeSGLangCacheAware || m == ModeGIEApproxPrefix
}

// UsesEngineLoad tells whether the mode's policy reads Candidate.Engine, so
// the engines' /metrics must be polled for it.
func (m Mode) UsesEngineLoad() bool {
	return m == ModeLLMDPrecise || m == ModeGIEApproxPrefix
}

// ScoresOverlap tells whether the mode's policy reads
// Candidate.OverlapBlocks, the cached prefix the router's index reports.
func (m Mode) ScoresOverlap() bool {
	return m == ModeKV || m == ModeLLMDPrecise
}

// SGLang's defaults (--cache-threshold, --balance-abs-threshold,
// --balance-rel-threshold, --max-tree-size).
const (
	SGLangCacheThreshold      = 0.3
	SGLangBalanceAbsThreshold = 64
	SGLangBalanceRelThreshold = 1.5
	SGLangMaxTreeSize         = 1 << 26
)

// sglangCacheAware keeps one token tree per worker, filled with the prompts
// it routed there. When in-flight requests are imbalanced (max − min above
// the absolute threshold and max above min × the relative one) it routes to
// the worker with the fewest; otherwise to the worker with the longest
// match if that match covers more than the cache threshold of the prompt,
// else to the worker with the smallest tree: the one SGLang deems to have
// the most cache to spare, whatever its load. The prompt is recorded on
// the chosen worker in every case. In-flight requests are the router's own
// count of booked requests, as SGLang counts requests it has sent and not
// seen finish.
type sglangCacheAware struct {
	mu    sync.RWMutex // guards trees and clock; Match under RLock, Insert under Lock
	trees map[kv.Worker]*prefixtree.Tree
	clock int64
}

func newSGLangCacheAware() policy {
	return &sglangCacheAware{trees: map[kv.Worker]*prefixtree.Tree{}}
}

func (s *sglangCacheAware) pick(req *Request, cands []Candidate, rng Rand) (int, error) {
	leastLoaded := func() int {
		return pickMin(len(cands), func(i int) float64 { return float64(cands[i].ActiveRequests) }, rng)
	}
	lo, hi := cands[0].ActiveRequests, cands[0].ActiveRequests
	for i := range cands {
		lo, hi = min(lo, cands[i].ActiveRequests), max(hi, cands[i].ActiveRequests)
	}
	var choice int
	if hi-lo > SGLangBalanceAbsThreshold && float64(hi) > float64(lo)*SGLangBalanceRelThreshold {
		choice = leastLoaded()
	} else {
		s.mu.RLock()
		matched := make([]int, len(cands))
		for i := range cands {
			if t := s.trees[cands[i].Worker]; t != nil {
				matched[i] = t.Match(req.Tokens)
			}
		}
		best := pickMin(len(cands), func(i int) float64 { return -float64(matched[i]) }, rng)
		if len(req.Tokens) > 0 && float64(matched[best])/float64(len(req.Tokens)) > SGLangCacheThreshold {
			choice = best
		} else {
			choice = pickMin(len(cands), func(i int) float64 {
				if t := s.trees[cands[i].Worker]; t != nil {
					return float64(t.Size())
				}
				return 0
			}, rng)
		}
		s.mu.RUnlock()
	}
	if req.Commit && len(req.Tokens) > 0 {
		s.mu.Lock()
		t := s.trees[cands[choice].Worker]
		if t == nil {
			t = prefixtree.New(SGLangMaxTreeSize)
			s.trees[cands[choice].Worker] = t
		}
		s.clock++
		t.Insert(req.Tokens, s.clock)
		s.mu.Unlock()
	}
	return choice, nil
}

// engineScores adds the two load scorers the Gateway API Inference
// Extension and llm-d share, each in [0, 1] with 1 the best: queue depth,
// min-max normalised over the candidates (all equal: 1), and free KV cache
// (1 − utilisation). An engine never scraped counts as idle.
func engineScores(cands []Candidate, weight float64, scores []float64) {
	lo, hi := cands[0].Engine.Waiting, cands[0].Engine.Waiting
	for i := range cands {
		lo, hi = min(lo, cands[i].Engine.Waiting), max(hi, cands[i].Engine.Waiting)
	}
	for i := range cands {
		q := 1.0
		if hi > lo {
			q = float64(hi-cands[i].Engine.Waiting) / float64(hi-lo)
		}
		kvFree := 1 - min(max(cands[i].Engine.KVUsage, 0), 1)
		scores[i] += weight*q + weight*kvFree
	}
}

// pickMax returns the index of the highest score, ties at random (the
// max-score picker of both schedulers).
func pickMax(scores []float64, rng Rand) int {
	return pickMin(len(scores), func(i int) float64 { return -scores[i] }, rng)
}

// llmdPrecise scores the fraction of the prompt's blocks cached on each
// worker, as the router's event-fed index knows it and weighted by tier
// (llmdPrefixBlocks), plus the engine load scorers, all with weight 1.
type llmdPrecise struct{}

// llm-d's tier weights (llm-d-kv-cache, DefaultKVCacheBackendConfig): a
// block on the GPU counts 1, on the CPU 0.8. Its scorer gives a medium it
// has no weight for 1, so disk blocks count as GPU ones.
const (
	LLMDGPUWeight   = 1.0
	LLMDCPUWeight   = 0.8
	LLMDOtherWeight = 1.0
)

// llmdPrefixBlocks is llm-d's LongestPrefixScorer on one worker: along the
// prompt's leading run of blocks the worker holds on any tier, each block
// adds the highest weight of the tiers holding it. With the index's
// cumulative overlaps that is the device run at the GPU's weight, its
// continuation on the host at the CPU's and the rest of the run on disk at
// the default. (A block past the device run that is back on the GPU as
// well as on the host counts 0.8 here, 1 in llm-d: the index reports runs,
// not each block's tiers.) Shared-cache blocks are no worker's own: llm-d
// keys every block by the pod that published it.
func llmdPrefixBlocks(c *Candidate) float64 {
	dev := c.OverlapBlocks
	host := max(c.HostBlocks, dev)
	disk := max(c.DiskBlocks, host)
	return LLMDGPUWeight*float64(dev) + LLMDCPUWeight*float64(host-dev) + LLMDOtherWeight*float64(disk-host)
}

func (llmdPrecise) pick(req *Request, cands []Candidate, rng Rand) (int, error) {
	scores := make([]float64, len(cands))
	if blocks := req.ISL / req.BlockSize; blocks > 0 {
		for i := range cands {
			scores[i] = llmdPrefixBlocks(&cands[i]) / float64(blocks)
		}
	}
	engineScores(cands, 1, scores)
	return pickMax(scores, rng), nil
}

// The Gateway API Inference Extension's prefix-cache scorer defaults.
const (
	GIEHashBlockTokens      = 64
	GIEMaxPrefixBlocks      = 256
	GIELRUCapacityPerServer = 31250
)

// gieApproxPrefix hashes the prompt in chained chunks of 64 tokens (at
// most 256 of them) and remembers, per server, the chunks of the prompts
// it sent there in an LRU of 31,250 entries. A server's prefix score is
// the fraction of the prompt's chunks it holds as a leading run; the
// engine load scorers are added with the same weight.
type gieApproxPrefix struct {
	mu      sync.Mutex // guards servers and their LRU order
	servers map[kv.Worker]*chunkLRU
}

func newGIEApproxPrefix() policy {
	return &gieApproxPrefix{servers: map[kv.Worker]*chunkLRU{}}
}

var gieHasher = blockhash.New(GIEHashBlockTokens, "")

func (g *gieApproxPrefix) pick(req *Request, cands []Candidate, rng Rand) (int, error) {
	// Chunks past the scored ones are not hashed at all; both hash runs
	// share one array sized for them.
	n := min(len(req.Tokens)/GIEHashBlockTokens, GIEMaxPrefixBlocks)
	hashes := make([]uint64, 2*n)
	local := gieHasher.AppendLocalHashes(hashes[:0:n], req.Tokens[:n*GIEHashBlockTokens])
	chunks := blockhash.AppendSequenceHashes(hashes[n:n], local)
	scores := make([]float64, len(cands))
	g.mu.Lock()
	if len(chunks) > 0 {
		for i := range cands {
			if l := g.servers[cands[i].Worker]; l != nil {
				scores[i] = float64(l.leadingRun(chunks)) / float64(len(chunks))
			}
		}
	}
	g.mu.Unlock()
	engineScores(cands, 1, scores)
	choice := pickMax(scores, rng)
	if req.Commit && len(chunks) > 0 {
		g.mu.Lock()
		l := g.servers[cands[choice].Worker]
		if l == nil {
			l = newChunkLRU(GIELRUCapacityPerServer)
			g.servers[cands[choice].Worker] = l
		}
		for _, h := range chunks {
			l.add(h)
		}
		g.mu.Unlock()
	}
	return choice, nil
}

// chunkLRU is a set of chunk hashes with least-recently-added eviction.
// Its recency list is threaded through a slice of slots, reused as hashes
// are evicted, so a full LRU adds a hash without allocating.
type chunkLRU struct {
	capacity int
	at       map[uint64]int32 // hash → its slot
	slots    []lruSlot
	// newest and oldest are slot indices, -1 when the set is empty.
	newest, oldest int32
}

type lruSlot struct {
	h            uint64
	newer, older int32 // neighbouring slots, -1 at either end
}

func newChunkLRU(capacity int) *chunkLRU {
	return &chunkLRU{capacity: capacity, at: make(map[uint64]int32), newest: -1, oldest: -1}
}

func (l *chunkLRU) add(h uint64) {
	if i, ok := l.at[h]; ok {
		l.unlink(i)
		l.pushNewest(i)
		return
	}
	if l.capacity <= 0 {
		return
	}
	var i int32
	if len(l.slots) < l.capacity {
		i = int32(len(l.slots))
		l.slots = append(l.slots, lruSlot{})
	} else {
		i = l.oldest
		l.unlink(i)
		delete(l.at, l.slots[i].h)
	}
	l.slots[i].h = h
	l.at[h] = i
	l.pushNewest(i)
}

func (l *chunkLRU) unlink(i int32) {
	s := &l.slots[i]
	if s.newer >= 0 {
		l.slots[s.newer].older = s.older
	} else {
		l.newest = s.older
	}
	if s.older >= 0 {
		l.slots[s.older].newer = s.newer
	} else {
		l.oldest = s.newer
	}
}

func (l *chunkLRU) pushNewest(i int32) {
	l.slots[i].newer, l.slots[i].older = -1, l.newest
	if l.newest >= 0 {
		l.slots[l.newest].newer = i
	} else {
		l.oldest = i
	}
	l.newest = i
}

func (l *chunkLRU) leadingRun(chunks []uint64) int {
	for i, h := range chunks {
		if _, ok := l.at[h]; !ok {
			return i
		}
	}
	return len(chunks)
}
