package engine

import (
	"math"
	"time"
)

// The host tier: vLLM's CPU offloading (OffloadingConnector with a CPU
// backend and its LRU manager, --kv-offloading-size). As vLLM v0.11+ does
// (vllm/distributed/kv_transfer/kv_connector/v1/offloading/scheduler.py,
// vllm/v1/kv_offload/lru_manager.py at vllm-project/vllm 0072b0b), the
// host pool is written through, not filled on eviction: every full block a
// step computes (prompt or generated, and the blocks a request found in
// the GPU cache) is copied to the host unless the host holds it already,
// so a block evicted from the GPU is usually still on the host. The host
// pool evicts by LRU; a lookup touches the request's blocks, its first
// block last, so that a prefix outlives its suffixes.
//
// A waiting request whose prompt continues its GPU prefix hit on the host
// loads those blocks at the offload bandwidth instead of computing them,
// asynchronously, as vLLM does (same commit: the connector's
// get_num_new_matched_tokens answers (hits, True); the scheduler in
// vllm/v1/core/sched/scheduler.py allocates the request's blocks, local
// hits and loaded ones, schedules no token of it and parks it as
// WAITING_FOR_REMOTE_KVS; the worker copies on its own CUDA stream while
// the engine keeps stepping the others, and a load found finished after a
// step (get_finished) makes the request schedulable in the next one, with
// those tokens computed). So a load costs the other requests nothing, and
// the loading request waits for the link: its blocks take GPU slots at once
// (Stored on the GPU then, where vLLM caches them once loaded), it takes no
// token budget and no sequence slot while loading, and it joins the waiting
// queue's front when its load has ended by a step's start. The loads share
// one link in the order they were started (vllm/v1/kv_offload/worker/
// cpu_gpu.py: each CPU-to-GPU transfer waits for the previous one), each
// taking its bytes over --kv-offload-bandwidth from the step that started
// it, or from the end of the one before. When nothing else can run the step
// is that wait (StepResult.LoadWait). As the connector does, a request
// whose prefix holds a block another request is still loading is deferred
// (tried again next step, the queue moving on past it), and so is any host
// hit while max_num_seqs loads are in flight. The engine's clock is the sum
// of its steps' durations: a caller waits each step's Duration before the
// next Step, and the clock stands still only while the engine is idle, when
// no load is in flight.
//
// The pool publishes what vLLM's connector publishes (take_events):
// BlockStored with medium "CPU", no parent (parent_block_hash None), no
// token ids (token_ids []), the blocks in request order with those the
// host already held left out; BlockRemoved with medium "CPU" for the
// blocks its LRU evicts. Host events follow the step's GPU events.

// DefaultKVOffloadBandwidth is the host-to-GPU bandwidth in GB/s (1e9
// bytes per second): a PCIe Gen4 ×16 link moves 32 GB/s at most and about
// 25 in practice, Gen5 twice that.
const DefaultKVOffloadBandwidth = 25.0

// DefaultKVBytesPerToken sizes a block for the load time: the KV of one
// token over all layers of Llama-3.1-8B in bf16 (32 layers × 8 KV heads ×
// 128 dims × K and V × 2 bytes), the model class of the step-time fits.
const DefaultKVBytesPerToken = 131072

type hostEntry struct {
	hash       uint64
	prev, next int32
	parent     uint64 // the block before it in its request; none when root
	root       bool
}

// hostPool is an LRU set of block ids (front = evicted first).
type hostPool struct {
	capacity int
	idx      map[uint64]int32
	entries  []hostEntry
	freeIdx  []int32
	head     int32
	tail     int32
	// loadPerBlock is the time to load one block to the GPU.
	loadPerBlock time.Duration
	// linkFree is the engine clock at which the last load started ends.
	linkFree time.Duration
	// inFlight counts, by block id, the loads carrying each block now.
	inFlight map[uint64]int32
	// tokens holds each entry's tokens, entry i at [i·bs, (i+1)·bs), and
	// extra the adapter and extra keys of the entries that have any: what
	// the dump (Engine.HostBlocks) names a block by, which the events
	// leave out.
	tokens    []uint32
	noTokens  bool // Config.NoBlockTokens: tokens stays empty
	extra     map[int32]slotKeys
	blockSize int
	stored    []int    // scratch: block indices into the request stored
	evicted   []uint64 // scratch
}

func newHostPool(cfg Config) *hostPool {
	bw := cfg.KVOffloadBandwidth
	if bw == 0 {
		bw = DefaultKVOffloadBandwidth
	}
	per := float64(cfg.BlockSize*DefaultKVBytesPerToken) / (bw * 1e9)
	return &hostPool{
		capacity:     cfg.NumCPUBlocks,
		idx:          make(map[uint64]int32),
		inFlight:     make(map[uint64]int32),
		blockSize:    cfg.BlockSize,
		noTokens:     cfg.NoBlockTokens,
		head:         noBlock,
		tail:         noBlock,
		loadPerBlock: time.Duration(math.Round(per * float64(time.Second))),
	}
}

func (p *hostPool) has(h uint64) bool {
	_, ok := p.idx[h]
	return ok
}

func (p *hostPool) unlink(i int32) {
	e := &p.entries[i]
	if e.prev != noBlock {
		p.entries[e.prev].next = e.next
	} else {
		p.head = e.next
	}
	if e.next != noBlock {
		p.entries[e.next].prev = e.prev
	} else {
		p.tail = e.prev
	}
	e.prev, e.next = noBlock, noBlock
}

func (p *hostPool) pushBack(i int32) {
	e := &p.entries[i]
	e.prev, e.next = p.tail, noBlock
	if p.tail != noBlock {
		p.entries[p.tail].next = i
	} else {
		p.head = i
	}
	p.tail = i
}

// touch makes the held blocks among hashes the most recently used, the
// first one last (vLLM's LRUOffloadingManager.touch).
func (p *hostPool) touch(hashes []uint64) {
	for k := len(hashes) - 1; k >= 0; k-- {
		if i, ok := p.idx[hashes[k]]; ok {
			p.unlink(i)
			p.pushBack(i)
		}
	}
}

// prefix is how many of hashes, from the first, the pool holds.
func (p *hostPool) prefix(hashes []uint64) int {
	n := 0
	for n < len(hashes) && p.has(hashes[n]) {
		n++
	}
	return n
}

// store copies the blocks [from, to) of s the pool lacks, evicting the
// least recently used, touches them all and appends the events to evs.
func (p *hostPool) store(s *seqBlocks, from, to, group int, evs []BlockEvent) []BlockEvent {
	hashes := s.hashes[from:to]
	p.stored, p.evicted = p.stored[:0], p.evicted[:0]
	for i, h := range hashes {
		if !p.has(h) {
			p.stored = append(p.stored, from+i)
		}
	}
	// A request longer than the pool keeps its last blocks.
	if n := len(p.stored); n > p.capacity {
		p.stored = p.stored[n-p.capacity:]
	}
	for len(p.idx)+len(p.stored) > p.capacity {
		i := p.head
		p.unlink(i)
		h := p.entries[i].hash
		delete(p.idx, h)
		delete(p.extra, i)
		p.freeIdx = append(p.freeIdx, i)
		p.evicted = append(p.evicted, h)
	}
	bs := p.blockSize
	var ids []uint64
	if len(p.stored) > 0 {
		ids = make([]uint64, len(p.stored))
	}
	for k, b := range p.stored {
		var i int32
		if n := len(p.freeIdx); n > 0 {
			i = p.freeIdx[n-1]
			p.freeIdx = p.freeIdx[:n-1]
		} else {
			p.entries = append(p.entries, hostEntry{})
			if !p.noTokens {
				p.tokens = append(p.tokens, make([]uint32, bs)...)
			}
			i = int32(len(p.entries) - 1)
		}
		h := s.hashes[b]
		ids[k] = h
		en := &p.entries[i]
		en.hash, en.root, en.parent = h, b == 0, 0
		if b > 0 {
			en.parent = s.hashes[b-1]
		}
		if !p.noTokens {
			copy(p.tokens[int(i)*bs:], s.tokens[b*bs:(b+1)*bs])
		}
		if keys := s.keys.block(b, bs); keys != nil || (s.keys != nil && s.keys.lora != "") {
			if p.extra == nil {
				p.extra = map[int32]slotKeys{}
			}
			p.extra[i] = slotKeys{lora: s.keys.lora, keys: keys}
		}
		p.idx[h] = i
		p.pushBack(i)
	}
	p.touch(hashes)
	if len(p.evicted) > 0 {
		evs = append(evs, BlockEvent{Kind: Removed, Group: group, Host: true, BlockHashes: append([]uint64(nil), p.evicted...)})
	}
	if len(ids) > 0 {
		evs = append(evs, BlockEvent{Kind: Stored, Group: group, Host: true, BlockHashes: ids, TokenIDs: []uint32{}})
	}
	return evs
}

// HostBlocks lists the blocks of the host tier, each after its parent when
// the host holds that too, with their parents, tokens and keys (what the
// GPU's copy was Stored with; the host's own events name the ids alone).
// Nil without a host tier.
func (e *Engine) HostBlocks() []CachedBlock {
	p := e.host
	if p == nil {
		return nil
	}
	slots := make([]int32, 0, len(p.idx))
	for _, i := range p.idx {
		slots = append(slots, i)
	}
	order := parentsFirst(slots, func(i int32) (int32, bool) {
		if en := &p.entries[i]; !en.root {
			j, ok := p.idx[en.parent]
			return j, ok
		}
		return 0, false
	})
	bs := p.blockSize
	out := make([]CachedBlock, 0, len(order))
	for _, i := range order {
		en := &p.entries[i]
		cb := CachedBlock{Hash: en.hash, Host: true}
		if !p.noTokens {
			cb.Tokens = p.tokens[int(i)*bs : (int(i)+1)*bs : (int(i)+1)*bs]
		}
		if x, ok := p.extra[i]; ok {
			cb.LoRAName, cb.ExtraKeys = x.lora, x.keys
		}
		if !en.root {
			par := en.parent
			cb.Parent = &par
		}
		out = append(out, cb)
	}
	return out
}

// hostHits is how many of s's prompt blocks after its GPU hits the host
// tier holds (at most all but the last token's block, as on the GPU), and
// touches every prompt block it holds, as vLLM's lookup does.
func (e *Engine) hostHits(s *seq, gpuHits int) int {
	if e.host == nil {
		return 0
	}
	limit := (s.numTokens() - 1) / e.cfg.BlockSize
	e.bm.ensureHashes(&s.seqBlocks, limit)
	e.host.touch(s.hashes[:limit])
	return e.host.prefix(s.hashes[gpuHits:limit])
}

// offload copies to the host the full blocks s has computed since the
// last call, appending the host's events to evs.
func (e *Engine) offload(s *seq, evs []BlockEvent) []BlockEvent {
	full := min(s.numComputed, s.numTokens()) / e.cfg.BlockSize
	if full <= s.hostNext {
		return evs
	}
	e.bm.ensureHashes(&s.seqBlocks, full)
	evs = e.host.store(&s.seqBlocks, s.hostNext, full, e.bm.group, evs)
	e.host.touch(s.hashes[:s.hostNext])
	s.hostNext = full
	return evs
}

// deferLoad reports whether s must wait for another request's load: a block
// of its first blocks (GPU hits, then host hits) is still in flight, or the
// loads in flight are at max_num_seqs and s would start one.
func (e *Engine) deferLoad(s *seq, gpuHits, hostHits int) bool {
	if hostHits > 0 && len(e.loading) >= e.cfg.MaxNumSeqs {
		return true
	}
	for _, h := range s.hashes[:gpuHits+hostHits] {
		if e.host.inFlight[h] > 0 {
			return true
		}
	}
	return false
}

// startLoad puts s's host blocks [from, to) on the link.
func (e *Engine) startLoad(s *seq, from, to int) {
	p := e.host
	s.loadFrom, s.loadTo = from, to
	s.loadDone = max(e.clock, p.linkFree) + time.Duration(to-from)*p.loadPerBlock
	p.linkFree = s.loadDone
	for _, h := range s.hashes[from:to] {
		p.inFlight[h]++
	}
	s.hostNext = max(s.hostNext, to)
	e.m.HostHits += uint64((to - from) * e.cfg.BlockSize)
	s.state = stLoading
	e.loading = append(e.loading, s)
}

// endLoad takes s's blocks off the link.
func (e *Engine) endLoad(s *seq) {
	for _, h := range s.hashes[s.loadFrom:s.loadTo] {
		if e.host.inFlight[h]--; e.host.inFlight[h] == 0 {
			delete(e.host.inFlight, h)
		}
	}
}

// promoteLoads puts the requests whose loads have ended at the front of
// the waiting queue, in the order their loads ended.
func (e *Engine) promoteLoads() {
	n := 0
	for n < len(e.loading) && e.loading[n].loadDone <= e.clock {
		n++
	}
	for k := n - 1; k >= 0; k-- {
		s := e.loading[k]
		e.endLoad(s)
		s.state, s.loaded = stWaiting, true
		e.waiting.pushFront(s)
	}
	m := copy(e.loading, e.loading[n:])
	clear(e.loading[m:])
	e.loading = e.loading[:m]
}

// dropLoad forgets an aborted request's load. Its transfer keeps the link
// busy, unless no load is left to wait: an idle engine's clock stands still.
func (e *Engine) dropLoad(s *seq) {
	e.endLoad(s)
	for i, r := range e.loading {
		if r == s {
			e.loading = append(e.loading[:i], e.loading[i+1:]...)
			break
		}
	}
	if len(e.loading) == 0 {
		e.host.linkFree = min(e.host.linkFree, e.clock)
	}
}

// unloadWaiting releases the blocks of the waiting requests whose loads
// have ended, when nothing runs or loads: they hold what the queue's front
// needs, and only they could free it. Their blocks stay cached, so they
// find them again as GPU hits unless evicted. It returns how many it
// released (preempted, to be recomputed).
func (e *Engine) unloadWaiting() int {
	n := 0
	for i := range e.waiting.len() {
		if s := e.waiting.at(i); s.loaded {
			e.bm.release(&s.seqBlocks)
			s.loaded, s.numComputed = false, 0
			n++
		}
	}
	return n
}
