// Package engine is the simulated vLLM engine behind the mocker (SPEC §8):
// a KV block manager with prefix caching, a vLLM v1-like scheduler
// (waiting and running queues, a per-step token budget, chunked prefill,
// recompute preemption) and a model of step time.
//
// The package is pure and deterministic: no I/O, no goroutines, no clock.
// The caller owns the loop: it adds requests, calls Step, publishes the
// step's KV events and outputs, and waits the step's Duration (divided by
// its speedup ratio) before the next Step. The same Config and the same
// sequence of calls give the same outputs, events and durations.
//
// An Engine is not safe for concurrent use.
//
// # Behaviour
//
// Each Step is one vLLM scheduler iteration followed by one forward pass.
// Running requests are served first, in the order they started running: a
// decoding request takes 1 token of the budget (MaxNumBatchedTokens), a
// request still prefilling takes as much of its remaining prompt as the
// budget leaves (chunked prefill). When the blocks a running request needs
// cannot be found even after evicting every inactive cached block, the
// running request that started last is preempted (recompute mode: its blocks
// are released and it goes back to the front of the waiting queue, keeping
// the tokens it generated), until the request fits or is itself preempted.
// If no request was preempted, waiting requests are then started in order
// while budget, MaxNumSeqs and blocks allow; the first that does not fit
// stops the queue (FCFS, as vLLM). A request starting for the first time
// looks its prompt up in the prefix cache: the leading full blocks found
// cached (active or inactive) are not computed. The last prompt token is
// always computed, as in vLLM: an identical prompt of 64 blocks hits 63 and
// prefills the 16 tokens of the last. These lookups feed PrefixQueries
// (prompt tokens) and PrefixHits (hit tokens) and the request's
// CachedTokens. A preempted request looks its prompt and generated tokens up
// again when it restarts (the blocks it released are often still cached),
// without counting in the prefix-cache metrics again.
//
// A request produces its first token in the step that computes its last
// prompt token, then one token per step; it finishes after exactly
// MaxTokens tokens, in the step that produces the last one, and its blocks
// are released then. KV events (Stored, Removed) are emitted when blocks are
// allocated, at scheduling time, as vLLM does: a block whose tokens are all
// computed by this step is Stored in this step.
//
// # KV blocks and events
//
// A full block is identified by its content: its engine id is a hash of
// Config.Seed, its parent's id and its tokens (not kvrouter's block hash, and
// different for every seed; kvrouter's sequence hash under
// Config.SequenceHashIDs), and the engine holds each content at most once:
// a request needing a block whose content is cached shares it (refcount) or
// revives it from the inactive LRU. Prompt and generated tokens alike fill
// blocks. An allocation that needs new slots evicts the least recently used
// inactive blocks and reports them in one Removed event, followed by one
// Stored event per run of consecutive new blocks of the request (with the
// parent of the run's first block; TokenIDs holds the run's tokens). Released
// blocks (finished, aborted or preempted requests) join the LRU tail block
// first, so a request's suffix is evicted before its prefix. The events of
// a step, applied in order, keep a consumer's index equal to the engine's
// cached blocks (held or inactive). With prefix caching off, blocks are
// anonymous and no events are emitted.
//
// Step time is StepTime: a prefill part for the step's new prompt tokens
// plus a decode part at the step's KV usage (see StepTime for why they add).
//
// # Disaggregated prefill and decode
//
// Two seams let a caller pair a prefill engine with a decode engine the way
// vLLM's KV connectors do, while the transfer itself (its time, its
// failures) stays the caller's business. On the prefill side,
// Request.HoldBlocks keeps a finished request's full prompt blocks pinned
// until Release, so the decode engine can still read them. On the decode
// side, Request.KVLoadedBlocks admits a request whose leading prompt blocks
// arrived from elsewhere, and CachedPrefixBlocks tells the caller which of
// them it need not fetch at all.
package engine

import (
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/kvrouter/kvrouter/core/blockhash"
)

// Config sizes the engine; the names follow vLLM's flags.
type Config struct {
	BlockSize           int    // tokens per KV block (--block-size, 16)
	NumGPUBlocks        int    // KV blocks on the GPU (--num-gpu-blocks, 16384)
	MaxNumSeqs          int    // most requests running at once (--max-num-seqs, 256)
	MaxNumBatchedTokens int    // token budget of one step (--max-num-batched-tokens, 8192)
	EnablePrefixCaching bool   // reuse cached blocks and emit KV events (true)
	Seed                uint64 // keys block ids and generated tokens: engines with different seeds differ
	// VocabSize bounds generated token ids: each is in [0, VocabSize).
	// 0 means 128000 (the range of the trace's synthesised tokens).
	VocabSize uint32
	// KVCacheGroups makes the engine a hybrid model's, in group_idx order
	// (--kv-cache-groups; see groups.go); nil is a plain model.
	KVCacheGroups []KVCacheGroup
	// Speed divides every step's model time: 0.5 is an engine half as
	// fast (an older GPU, a smaller tensor-parallel group). 0 means 1.
	Speed float64
	// NumCPUBlocks is the host tier's size in blocks (--num-cpu-blocks;
	// vLLM sizes it in bytes with --kv-offloading-size): 0 is none. See
	// host.go.
	NumCPUBlocks int
	// KVOffloadBandwidth is the host-to-GPU bandwidth in GB/s that host
	// blocks load at (--kv-offload-bandwidth); 0 means
	// DefaultKVOffloadBandwidth.
	KVOffloadBandwidth float64
	// NoBlockTokens keeps no copy of the cached blocks' tokens, which
	// only CachedBlocks and HostBlocks read, nor of the GPU blocks'
	// parents, which only CachedBlocks reads: they then list blocks
	// without tokens (Tokens nil), and CachedBlocks without parents
	// (Parent nil), by slot. For a caller that never lists them, such as
	// the simulator, the copy is a cache miss per new block, and the
	// parent would double the 16 bytes the engine keeps per block.
	NoBlockTokens bool
	// SequenceHashIDs names every full block by kvrouter's sequence hash
	// of it (core/blockhash: the chain of the blocks' local hashes under
	// the request's LoRA adapter and cache salt) instead of an id of the
	// engine's own, and publishes the blocks' local hashes with their
	// Stored events (BlockEvent.LocalHashes). Ids are opaque to a router,
	// so this changes nothing an engine does, only the names it gives;
	// Dynamo's mocker names its blocks by sequence hashes the same way.
	// A caller that hashed a prompt as the router does hands the hashes
	// over (Request.BlockIDs and Request.LocalHashes) and no block is
	// hashed twice. Not with multimodal requests, whose router hashes
	// mix in their items, nor with KVCacheGroups.
	SequenceHashIDs bool
	// ExpectedBlocks is about the most full blocks the engine is expected
	// to cache, from a caller that knows its workload (the simulator): the
	// block tables (the id map, the block array, the inactive queue) start
	// at the size that many blocks need, at most NumGPUBlocks' size,
	// instead of doubling their way there from a few slots, each doubling
	// a copy into fresh memory whose pages fault in one by one. Only a
	// hint: the tables still grow past it if they must. 0 starts them
	// small, for an engine that may never see many blocks (one of a
	// simulated fleet of hundreds).
	ExpectedBlocks int
}

// DefaultConfig is vLLM's defaults as the mocker's flags have them.
func DefaultConfig() Config {
	return Config{
		BlockSize:           16,
		NumGPUBlocks:        16384,
		MaxNumSeqs:          256,
		MaxNumBatchedTokens: 8192,
		EnablePrefixCaching: true,
		VocabSize:           128000,
	}
}

// Request is one generation request.
type Request struct {
	ID        string
	Tokens    []uint32 // prompt token ids (copied by Add, unless Owned)
	MaxTokens int      // tokens to generate (> 0); exactly this many are generated (no EOS)
	// Owned hands Tokens to the engine: the caller neither reads nor writes
	// them after Add, and the engine appends the generated tokens in place
	// when their capacity allows (a copy of every prompt was a tenth of the
	// simulator's time). BlockIDs and LocalHashes too: the caller may go
	// on reading the elements it handed over, the engine only appends.
	Owned bool
	// HoldBlocks keeps the prompt's full blocks held after the request
	// finishes, until Release: a prefill engine of a disaggregated pair must
	// not evict what the decode engine has yet to pull (vLLM's connectors
	// delay freeing those blocks). Held blocks are active: never evicted,
	// counted in KV usage, and they go back to the prefix cache (no Removed
	// event) when released. The rest of the request's blocks are released at
	// finish as usual. A prompt shorter than one block, or an engine with
	// prefix caching off (its blocks have no ids to pull), holds nothing; an
	// aborted request holds nothing either.
	HoldBlocks bool
	// KVLoadedBlocks says the KV of the prompt's first KVLoadedBlocks full
	// blocks is already present when the request is first scheduled: a
	// decode engine pulled it from a prefill engine. Those blocks take slots
	// (reusing cached copies) and new ones are Stored like any computed
	// block, but they cost no prefill time. The last prompt token is always
	// computed, as vLLM does after a KV load, so a prompt of whole blocks
	// computes one token. Only the first scheduling uses it: a preempted
	// request recomputes from its own cache like any other, since the
	// pulled copy is gone. At most len(Tokens)/BlockSize.
	KVLoadedBlocks int
	// LoRA, CacheSalt and MM key the prompt's blocks apart from the same
	// tokens under another adapter, salt or multimodal item (see
	// extrakeys.go). MM must be sorted by Offset and lie within the prompt.
	LoRA      string
	CacheSalt string
	MM        []MMFeature
	// Tag is handed back in every Output of the request: a caller that
	// numbers its requests reads the number there instead of parsing ID
	// for every token.
	Tag int32
	// BlockIDs and LocalHashes, on an engine of Config.SequenceHashIDs,
	// are the sequence and local hashes of the prompt's first
	// len(BlockIDs) full blocks, keyed by LoRA and CacheSalt as the router
	// keys them: the engine takes them instead of hashing those blocks. A
	// caller that hashed the prompt for the router (the simulator) hands
	// them over. As long as each other.
	BlockIDs    []uint64
	LocalHashes []uint64
}

// Output is one generated token.
type Output struct {
	ID    string
	Token uint32 // deterministic: a function of the prompt, Index and Config.Seed
	Tag   int32  // Request.Tag
	Index int    // 0-based position in the generation
	// Finished marks the last token (Index == MaxTokens-1).
	Finished bool
	// CachedTokens is set on the first output (Index 0) only: the prompt
	// tokens found in the prefix cache or loaded (KVLoadedBlocks) when the
	// request was first scheduled, as vLLM's usage counts them.
	CachedTokens int
}

// EventKind is the type of a KV event.
type EventKind uint8

const (
	Stored  EventKind = iota + 1 // blocks became full and cached
	Removed                      // cached blocks were evicted
	Cleared                      // every cached block was dropped
)

func (k EventKind) String() string {
	switch k {
	case Stored:
		return "stored"
	case Removed:
		return "removed"
	case Cleared:
		return "cleared"
	}
	return fmt.Sprintf("EventKind(%d)", uint8(k))
}

// BlockEvent is one vLLM KV event (BlockStored, BlockRemoved,
// AllBlocksCleared). Its slices may share memory with the engine and with
// other events: treat them as read-only.
type BlockEvent struct {
	Kind        EventKind
	Group       int      // the KV-cache group's group_idx (Config.Group describes it)
	BlockHashes []uint64 // the engine's own opaque block ids
	Parent      *uint64  // Stored: id of the parent of the first block, nil at the root
	TokenIDs    []uint32 // Stored: the tokens of all blocks, len = len(BlockHashes) × BlockSize
	// Stored: the blocks' adapter and, per block, their extra keys as vLLM
	// publishes them (nil when no block has any; see requestKeys.block).
	LoRAName  string
	ExtraKeys [][]any
	// Host marks the host tier's events (Config.NumCPUBlocks), published
	// with medium "CPU"; their Stored events have no parent and no tokens.
	Host bool
	// LocalHashes, on the Stored events of an engine of
	// Config.SequenceHashIDs, are the blocks' local hashes.
	LocalHashes []uint64
	// Tag and First, on the GPU's Stored events of the group the engine's
	// Config.BlockSize describes, are the Request.Tag of the request the
	// blocks were computed for and the place of the first among its
	// blocks: a caller that hashed the request's prompt finds the blocks'
	// hashes there. vLLM publishes neither.
	Tag   int32
	First int32
}

// StepResult is what one Step did.
type StepResult struct {
	// Duration is the model time of the step (not divided by any speedup);
	// 0 if nothing ran. A zero Duration while the engine is not Idle (every
	// running request was preempted in this step) means: Step again now.
	Duration      time.Duration
	PrefillTokens int // new (uncached) tokens computed for prefills (and recomputes)
	DecodeSeqs    int // requests that decoded one token
	// Outputs are in the order of the running queue, valid until the next
	// Step: the engine reuses the slice (a fresh one per step was the
	// simulator's largest allocation).
	Outputs   []Output
	Events    []BlockEvent // in the order they happened
	Preempted int          // requests preempted in this step
	KVUsage   float64      // KV usage during the step (the u of the decode time)
	// LoadWait: nothing could run until a host load ends, and Duration is
	// the wait for the first one (the engine polls its transfers, idle).
	LoadWait bool
}

// Metrics is the engine's state and counters, as vLLM's /metrics has them.
type Metrics struct {
	Running int     // vllm:num_requests_running
	Waiting int     // vllm:num_requests_waiting
	KVUsage float64 // vllm:kv_cache_usage_perc: blocks held by requests / NumGPUBlocks

	ActiveBlocks int // blocks held by requests (full and partial), HeldBlocks included
	HeldBlocks   int // blocks of finished requests held until Release (Request.HoldBlocks)
	CachedBlocks int // full blocks in the prefix cache (held or reusable)
	FreeBlocks   int // blocks neither held nor cached
	TotalBlocks  int // NumGPUBlocks

	PrefixQueries uint64 // vllm:prefix_cache_queries (tokens)
	PrefixHits    uint64 // vllm:prefix_cache_hits (tokens)
	// LoadedQueries and LoadedHits are the part of PrefixQueries and
	// PrefixHits due to requests whose KV was loaded (Request.KVLoadedBlocks):
	// their hits spared a transfer, not a prefill.
	LoadedQueries, LoadedHits uint64
	Preemptions               uint64 // vllm:num_preemptions
	// HostHits are the prompt tokens loaded from the host tier instead of
	// computed (vllm:external_prefix_cache_hits); HostBlocks the blocks
	// the host tier holds.
	HostHits   uint64
	HostBlocks int

	PromptTokens     uint64 // vllm:prompt_tokens: prompt tokens of requests that produced their first token
	GenerationTokens uint64 // vllm:generation_tokens: tokens generated
	RequestsAdded    uint64
	RequestsFinished uint64 // produced all their tokens
	RequestsAborted  uint64
	Steps            uint64 // steps that ran something
}

var (
	// ErrInvalid reports an invalid Config or Request.
	ErrInvalid = errors.New("engine: invalid argument")
	// ErrDuplicateID reports a request whose ID is already waiting or running.
	ErrDuplicateID = errors.New("engine: duplicate request id")
	// ErrPromptTooLong reports a request that cannot fit in the KV cache even alone.
	ErrPromptTooLong = errors.New("engine: prompt too long")
)

type seqState uint8

const (
	stWaiting seqState = iota
	stLoading          // its host blocks are on their way to the GPU (host.go)
	stRunning
	stDone
)

type seq struct {
	seqBlocks
	id         string
	tag        int32
	numPrompt  int
	maxTokens  int
	promptHash uint64

	loadedBlocks int // Request.KVLoadedBlocks, until the first scheduling

	numComputed  int  // tokens whose KV is computed (from the start of the last (re)schedule)
	generated    int  // outputs produced
	cachedTokens int  // tokens cached or loaded at first scheduling
	started      bool // scheduled at least once
	hold         bool // Request.HoldBlocks
	prefilled    bool // prefill (or recompute) complete: the next steps are decodes
	state        seqState
	chunk        int // tokens scheduled in the current step
	hostNext     int // full blocks already offered to the host tier
	// loaded: numComputed counts blocks a host load brought in; the next
	// scheduling computes from there without looking the prompt up again.
	loaded   bool
	loadDone time.Duration // engine clock at which its host load ends
	loadFrom int           // first block of its host load
	loadTo   int           // end of its host load, in blocks
}

func (s *seq) numTokens() int { return len(s.tokens) }

// Engine is one simulated vLLM engine (one data-parallel rank).
type Engine struct {
	cfg     Config
	bm      *blockManager
	waiting deque
	running []*seq
	byID    map[string]*seq
	// held are finished requests whose prompt blocks wait for Release;
	// heldBlocks counts their blocks.
	held       map[string]*seq
	heldBlocks int
	sched      []*seq    // scratch: requests scheduled in the current step
	host       *hostPool // the host tier, nil without one
	// clock is the model time of the steps so far: host loads end on it.
	// It stands still while the engine is idle, when no load is in flight.
	clock time.Duration
	// loading are the requests whose host blocks are in flight, in the
	// order the link carries them (host.go).
	loading []*seq
	outputs []Output // the last step's Outputs, reused
	// usage and decodeTime are the KV usage and the decode time at it
	// last computed, and decodeUsed the blocks held they were computed
	// for: the held count changes only at block boundaries, admissions
	// and finishes, so most steps reuse them (the fit and its rounding
	// cost a simulated step more than the rest of its timing, the
	// division a tenth of it). decodeUsed is -1 before the first.
	decodeUsed int
	usage      float64
	decodeTime time.Duration
	m          Metrics
}

// New makes an engine.
func New(cfg Config) (*Engine, error) {
	if cfg.VocabSize == 0 {
		cfg.VocabSize = 128000
	}
	if cfg.Speed == 0 {
		cfg.Speed = 1
	}
	switch {
	case !(cfg.Speed > 0) || math.IsInf(cfg.Speed, 1):
		return nil, fmt.Errorf("%w: speed %v", ErrInvalid, cfg.Speed)
	case cfg.BlockSize <= 0:
		return nil, fmt.Errorf("%w: block size %d", ErrInvalid, cfg.BlockSize)
	case cfg.NumGPUBlocks <= 0:
		return nil, fmt.Errorf("%w: %d GPU blocks", ErrInvalid, cfg.NumGPUBlocks)
	case cfg.MaxNumSeqs <= 0:
		return nil, fmt.Errorf("%w: max num seqs %d", ErrInvalid, cfg.MaxNumSeqs)
	case cfg.MaxNumBatchedTokens <= 0:
		return nil, fmt.Errorf("%w: max num batched tokens %d", ErrInvalid, cfg.MaxNumBatchedTokens)
	case cfg.NumCPUBlocks < 0:
		return nil, fmt.Errorf("%w: %d CPU blocks", ErrInvalid, cfg.NumCPUBlocks)
	case !(cfg.KVOffloadBandwidth >= 0) || math.IsInf(cfg.KVOffloadBandwidth, 1):
		return nil, fmt.Errorf("%w: KV offload bandwidth %v GB/s", ErrInvalid, cfg.KVOffloadBandwidth)
	case cfg.NumCPUBlocks > 0 && !cfg.EnablePrefixCaching:
		return nil, fmt.Errorf("%w: a host tier (%d CPU blocks) needs prefix caching: its blocks are found by their ids", ErrInvalid, cfg.NumCPUBlocks)
	case cfg.NumCPUBlocks > 0 && len(cfg.KVCacheGroups) > 0:
		return nil, fmt.Errorf("%w: a host tier with KV-cache groups is not simulated", ErrInvalid)
	case cfg.SequenceHashIDs && len(cfg.KVCacheGroups) > 0:
		return nil, fmt.Errorf("%w: sequence-hash ids with KV-cache groups", ErrInvalid)
	case cfg.ExpectedBlocks < 0:
		return nil, fmt.Errorf("%w: %d expected blocks", ErrInvalid, cfg.ExpectedBlocks)
	}
	bm := newBlockManager(cfg.BlockSize, cfg.NumGPUBlocks, cfg.EnablePrefixCaching, cfg.Seed)
	bm.noTokens = cfg.NoBlockTokens
	bm.reserve(cfg.ExpectedBlocks)
	if cfg.SequenceHashIDs {
		bm.seqIDs = true
		bm.plain = blockhash.New(cfg.BlockSize, "")
	}
	if err := bm.setupGroups(cfg); err != nil {
		return nil, err
	}
	e := &Engine{
		cfg:  cfg,
		bm:   bm,
		byID: make(map[string]*seq),
		held: make(map[string]*seq),

		decodeUsed: -1,
	}
	if cfg.NumCPUBlocks > 0 {
		e.host = newHostPool(cfg)
	}
	return e, nil
}

// Free ends the engine: the block tables that Config.ExpectedBlocks sized
// go to the next engine made in this process with as many expected
// blocks, instead of to the garbage collector. The engine must not be
// used again.
func (e *Engine) Free() {
	e.bm.giveBack()
	e.bm = nil
}

// Config returns the engine's configuration (defaults filled in).
func (e *Engine) Config() Config { return e.cfg }

// Add queues a request at the back of the waiting queue.
func (e *Engine) Add(r Request) error {
	switch {
	case r.ID == "":
		return fmt.Errorf("%w: empty request id", ErrInvalid)
	case len(r.Tokens) == 0:
		return fmt.Errorf("%w: request %q has an empty prompt", ErrInvalid, r.ID)
	case r.MaxTokens <= 0:
		return fmt.Errorf("%w: request %q asks for %d tokens (must be > 0)", ErrInvalid, r.ID, r.MaxTokens)
	case !validMM(r.MM, len(r.Tokens)):
		return fmt.Errorf("%w: request %q: multimodal items must be sorted, non-empty spans within the prompt", ErrInvalid, r.ID)
	case r.KVLoadedBlocks < 0 || r.KVLoadedBlocks > len(r.Tokens)/e.cfg.BlockSize:
		return fmt.Errorf("%w: request %q has %d loaded blocks, its prompt of %d tokens has %d full blocks",
			ErrInvalid, r.ID, r.KVLoadedBlocks, len(r.Tokens), len(r.Tokens)/e.cfg.BlockSize)
	}
	seqIDs := e.cfg.SequenceHashIDs
	switch {
	case seqIDs && len(r.MM) > 0:
		return fmt.Errorf("%w: request %q has multimodal items, which an engine of sequence-hash ids does not hash", ErrInvalid, r.ID)
	case !seqIDs && (len(r.BlockIDs) > 0 || len(r.LocalHashes) > 0):
		return fmt.Errorf("%w: request %q has block hashes, which an engine of its own ids does not take", ErrInvalid, r.ID)
	case len(r.LocalHashes) != len(r.BlockIDs):
		return fmt.Errorf("%w: request %q has %d local hashes for %d block ids", ErrInvalid, r.ID, len(r.LocalHashes), len(r.BlockIDs))
	case len(r.BlockIDs) > len(r.Tokens)/e.cfg.BlockSize:
		return fmt.Errorf("%w: request %q has %d block ids, its prompt of %d tokens has %d full blocks",
			ErrInvalid, r.ID, len(r.BlockIDs), len(r.Tokens), len(r.Tokens)/e.cfg.BlockSize)
	}
	if _, dup := e.byID[r.ID]; dup {
		return fmt.Errorf("%w: %q", ErrDuplicateID, r.ID)
	}
	if _, dup := e.held[r.ID]; dup {
		return fmt.Errorf("%w: %q", ErrDuplicateID, r.ID)
	}
	bs := e.cfg.BlockSize
	total := len(r.Tokens) + r.MaxTokens
	if blocks := (total + bs - 1) / bs; blocks > e.cfg.NumGPUBlocks {
		return fmt.Errorf("%w: request %q: prompt of %d tokens plus max_tokens %d needs %d KV blocks of %d tokens, but the engine has %d blocks (%d tokens)",
			ErrPromptTooLong, r.ID, len(r.Tokens), r.MaxTokens, blocks, bs, e.cfg.NumGPUBlocks, e.cfg.NumGPUBlocks*bs)
	}
	toks := r.Tokens
	if !r.Owned || cap(toks) < total {
		toks = make([]uint32, len(r.Tokens), total)
		copy(toks, r.Tokens)
	}
	// Room for every full block the request can reach: growing the
	// slices block by block cost more than the blocks' own hashing.
	hashes := r.BlockIDs
	if !r.Owned || cap(hashes) < total/bs {
		hashes = append(make([]uint64, 0, total/bs), r.BlockIDs...)
	}
	s := &seq{
		seqBlocks:    seqBlocks{tokens: toks, keys: newRequestKeys(&r), hashes: hashes, room: total / bs, tag: r.Tag},
		id:           r.ID,
		tag:          r.Tag,
		numPrompt:    len(r.Tokens),
		maxTokens:    r.MaxTokens,
		loadedBlocks: r.KVLoadedBlocks,
		hold:         r.HoldBlocks,
		state:        stWaiting,
	}
	if seqIDs {
		s.locals = r.LocalHashes
		if !r.Owned || cap(s.locals) < total/bs {
			s.locals = append(make([]uint64, 0, total/bs), r.LocalHashes...)
		}
	}
	e.byID[r.ID] = s
	e.waiting.pushBack(s)
	e.m.RequestsAdded++
	return nil
}

// fingerprint is a hash of s's whole prompt that seeds its generated
// tokens. It chains on the prompt's last full block id, which allocation
// has already computed, so that only the partial block's tokens are hashed
// again: hashing every prompt a second time cost more than the rest of Add.
func (e *Engine) fingerprint(s *seq) uint64 {
	bs := e.cfg.BlockSize
	full := s.numPrompt / bs
	e.bm.ensureHashes(&s.seqBlocks, full)
	var last uint64
	if full > 0 {
		last = s.hashes[full-1]
	}
	return hashBlock(e.cfg.Seed, last^promptSalt, s.tokens[full*bs:s.numPrompt])
}

// Abort drops a request (its client is gone) and releases its blocks now.
// It reports whether the request was waiting or running.
func (e *Engine) Abort(id string) bool {
	s, ok := e.byID[id]
	if !ok {
		return false
	}
	switch s.state {
	case stRunning:
		for i, r := range e.running {
			if r == s {
				e.running = append(e.running[:i], e.running[i+1:]...)
				break
			}
		}
	case stWaiting:
		e.waiting.remove(s)
	case stLoading:
		e.dropLoad(s)
	}
	e.bm.release(&s.seqBlocks)
	s.state = stDone
	delete(e.byID, id)
	e.m.RequestsAborted++
	return true
}

// Release returns the blocks a finished request holds (Request.HoldBlocks)
// to the prefix cache, where they stay reusable until evicted. It reports
// whether the request held any.
func (e *Engine) Release(id string) bool {
	s, ok := e.held[id]
	if !ok {
		return false
	}
	e.heldBlocks -= len(s.blocks)
	e.bm.release(&s.seqBlocks)
	delete(e.held, id)
	return true
}

// HeldBlocks names the blocks a finished request holds, in prompt order, or
// nil if it holds none. The ids are slot numbers, like vLLM's block ids:
// stable while held, reused after Release.
func (e *Engine) HeldBlocks(id string) []int {
	s, ok := e.held[id]
	if !ok {
		return nil
	}
	out := make([]int, len(s.blocks))
	for i, idx := range s.blocks {
		out[i] = int(idx)
	}
	return out
}

// CachedPrefixBlocks is how many leading full blocks of tokens the engine
// caches now (held or reusable): what a decode engine already has and need
// not pull. It changes nothing, and is 0 with prefix caching off.
func (e *Engine) CachedPrefixBlocks(tokens []uint32) int {
	s := seqBlocks{tokens: tokens}
	return e.bm.countPrefix(&s, len(tokens)/e.cfg.BlockSize)
}

// Idle reports that no request is waiting or running.
func (e *Engine) Idle() bool {
	return len(e.running) == 0 && e.waiting.len() == 0 && len(e.loading) == 0
}

// Recycle hands back the events of a step (StepResult.Events) that the
// caller is done with: it reads neither them nor their BlockHashes again.
// Later steps reuse the slice and the Removed events' id lists, which the
// engine made for the caller alone, instead of allocating new ones (a
// simulated fleet's steps publish millions of evictions). Stored events'
// ids and tokens belong to their requests and are not reused.
func (e *Engine) Recycle(events []BlockEvent) {
	for i := range events {
		if events[i].Kind == Removed {
			e.bm.spareIDs.put(events[i].BlockHashes)
		}
	}
	clear(events)
	e.bm.spareEvents.put(events)
}

// KVUsage is the fraction of the GPU blocks held by requests.
func (e *Engine) KVUsage() float64 {
	return float64(e.bm.used()) / float64(e.cfg.NumGPUBlocks)
}

// Metrics returns the engine's state and counters.
func (e *Engine) Metrics() Metrics {
	m := e.m
	m.Running = len(e.running)
	m.Waiting = e.waiting.len() + len(e.loading)
	m.KVUsage = e.KVUsage()
	m.ActiveBlocks = e.bm.used()
	m.HeldBlocks = e.heldBlocks
	m.CachedBlocks = e.bm.numActive + e.bm.numInactive
	m.FreeBlocks = e.bm.free()
	m.TotalBlocks = e.cfg.NumGPUBlocks
	if e.host != nil {
		m.HostBlocks = len(e.host.idx)
	}
	return m
}

// CachedBlocks lists every block the engine caches (active or inactive),
// each after its parent: the state its Stored and Removed events so far
// add up to. Nil with prefix caching off.
func (e *Engine) CachedBlocks() []CachedBlock { return e.bm.cached() }

// ResetPrefixCache drops every cached block, as vLLM's /reset_prefix_cache:
// it fails (false) while any request holds blocks. On success it returns the
// Cleared event to publish (none with prefix caching off).
func (e *Engine) ResetPrefixCache() ([]BlockEvent, bool) {
	if e.bm.used() > 0 {
		return nil, false
	}
	e.bm.reset()
	if !e.cfg.EnablePrefixCaching {
		return nil, true
	}
	return []BlockEvent{{Kind: Cleared}}, true
}

// Step runs one scheduler iteration and forward pass.
func (e *Engine) Step() StepResult {
	var res StepResult
	e.StepTo(&res)
	return res
}

// StepTo is Step writing its result into *res, which it overwrites: a
// caller that keeps the result of every step where it lives copies none
// of its thirteen words (returning and storing them cost a simulated
// step more than its scheduling).
func (e *Engine) StepTo(res *StepResult) {
	*res = StepResult{}
	if e.Idle() {
		return
	}
	bs := e.cfg.BlockSize
	budget := e.cfg.MaxNumBatchedTokens
	sched := e.sched[:0]
	if e.bm.events == nil {
		e.bm.events = e.bm.spareEvents.take()
	}
	if len(e.loading) > 0 {
		e.promoteLoads()
	}

	// Running requests first.
	preempted := 0
	for i := 0; i < len(e.running) && budget > 0; i++ {
		s := e.running[i]
		n := min(s.numTokens()-s.numComputed, budget)
		if e.bm.holds(&s.seqBlocks, s.numComputed+n) {
			s.chunk = n
			budget -= n
			sched = append(sched, s)
			continue
		}
		scheduled := true
		for !e.bm.allocate(&s.seqBlocks, s.numComputed+n) {
			victim := e.running[len(e.running)-1]
			e.running = e.running[:len(e.running)-1]
			e.preempt(victim)
			preempted++
			if victim == s {
				scheduled = false
				break
			}
		}
		if !scheduled {
			break
		}
		s.chunk = n
		budget -= n
		sched = append(sched, s)
	}

	// Then waiting requests, unless this step had to preempt. A request
	// deferred by the host tier (host.go) keeps its place and the next one
	// is tried, as vLLM skips it.
	if preempted == 0 {
		for i := 0; i < e.waiting.len() && budget > 0 && len(e.running) < e.cfg.MaxNumSeqs; {
			s := e.waiting.at(i)
			hits := 0
			if !s.loaded {
				// The last token is always computed: at most numTokens-1
				// tokens can come from the cache.
				hits = e.bm.countPrefix(&s.seqBlocks, (s.numTokens()-1)/bs)
				fromHost := e.hostHits(s, hits)
				if len(e.loading) > 0 && e.deferLoad(s, hits, fromHost) {
					i++
					continue
				}
				s.numComputed = (hits + fromHost) * bs
				pulled := 0
				if !s.started && s.loadedBlocks > 0 {
					pulled = min(s.loadedBlocks*bs, s.numTokens()-1)
					s.numComputed = max(s.numComputed, pulled)
				}
				if fromHost > 0 && s.numComputed > pulled {
					if !e.bm.allocate(&s.seqBlocks, s.numComputed) {
						s.numComputed = 0
						break
					}
					e.takeWaiting(i, s)
					e.firstSchedule(s, hits)
					e.startLoad(s, hits, hits+fromHost)
					continue
				}
			}
			n := min(s.numTokens()-s.numComputed, budget)
			if !e.bm.allocate(&s.seqBlocks, s.numComputed+n) {
				if !s.loaded {
					s.numComputed = 0
				}
				break
			}
			e.takeWaiting(i, s)
			if !s.loaded {
				e.firstSchedule(s, hits)
			}
			s.loaded = false
			s.state = stRunning
			e.running = append(e.running, s)
			s.chunk = n
			budget -= n
			sched = append(sched, s)
		}
	}
	e.m.Preemptions += uint64(preempted)
	res.Preempted = preempted
	// A step without events (most) keeps its empty list for the next.
	if len(e.bm.events) > 0 {
		res.Events = e.bm.events
		e.bm.events = nil
	}
	e.sched = sched
	if len(sched) == 0 {
		if res.Preempted == 0 && len(e.loading) == 0 && len(e.running) == 0 {
			res.Preempted = e.unloadWaiting()
			e.m.Preemptions += uint64(res.Preempted)
		}
		if res.Preempted == 0 && len(e.loading) > 0 {
			res.Duration = e.loading[0].loadDone - e.clock
			res.LoadWait = true
			e.clock += res.Duration
		}
		return
	}
	e.m.Steps++

	// The forward pass.
	decodeSeqs, prefillTokens := 0, 0
	for _, s := range sched {
		if s.prefilled {
			decodeSeqs++
		} else {
			prefillTokens += s.chunk
		}
	}
	res.DecodeSeqs, res.PrefillTokens = decodeSeqs, prefillTokens
	e.refreshUsage()
	res.KVUsage = e.usage
	d := e.stepTime(prefillTokens, decodeSeqs)
	if e.cfg.Speed != 1 {
		d = time.Duration(math.Round(float64(d) / e.cfg.Speed))
	}
	res.Duration = d
	e.clock += d

	outs := e.outputs[:0]
	finished := 0
	for _, s := range sched {
		s.numComputed += s.chunk
		s.chunk = 0
		if e.host != nil {
			res.Events = e.offload(s, res.Events)
		}
		if s.numComputed < s.numTokens() {
			continue // prefill chunk
		}
		s.prefilled = true
		if s.generated == 0 {
			s.promptHash = e.fingerprint(s)
		}
		gen := s.generated
		token := genToken(e.cfg.Seed, s.promptHash, gen, e.cfg.VocabSize)
		done := gen+1 == s.maxTokens
		cached := 0
		if gen == 0 {
			cached = s.cachedTokens
			e.m.PromptTokens += uint64(s.numPrompt)
		}
		// Filled in place, field by field: an Output built aside and
		// copied in was read back in halves its stores could not forward.
		if len(outs) == cap(outs) {
			outs = append(outs, Output{})
		} else {
			outs = outs[:len(outs)+1]
		}
		out := &outs[len(outs)-1]
		out.ID, out.Token, out.Tag, out.Index, out.Finished, out.CachedTokens = s.id, token, s.tag, gen, done, cached
		e.m.GenerationTokens++
		s.generated = gen + 1
		if done {
			e.finish(s)
			s.state = stDone
			delete(e.byID, s.id)
			e.m.RequestsFinished++
			finished++
		} else {
			s.tokens = append(s.tokens, token)
		}
	}
	if finished > 0 {
		kept := e.running[:0]
		for _, s := range e.running {
			if s.state == stRunning {
				kept = append(kept, s)
			}
		}
		clear(e.running[len(kept):])
		e.running = kept
	}
	// Not clear(sched): a call that cost more than the loop for the one
	// or two requests of most steps.
	for i := 0; i < len(sched); i++ {
		sched[i] = nil
	}
	res.Outputs = outs
	e.outputs = outs
}

// refreshUsage brings usage and decodeTime up to the blocks held now.
func (e *Engine) refreshUsage() {
	if used := e.bm.used(); used != e.decodeUsed {
		e.decodeUsed, e.usage = used, e.KVUsage()
		e.decodeTime = DecodeTime(e.usage)
	}
}

// stepTime is StepTime(prefillTokens, decodeSeqs, e.KVUsage()), after
// refreshUsage.
func (e *Engine) stepTime(prefillTokens, decodeSeqs int) time.Duration {
	var d time.Duration
	if prefillTokens > 0 {
		d = PrefillTime(prefillTokens)
	}
	if decodeSeqs > 0 {
		d += e.decodeTime
	}
	return d
}

// holds reports that s holds the blocks for its first upTo tokens
// already, so that allocate would change nothing: most of a running
// request's steps, which decode within its partial block. It answers
// without the division allocate starts with, a tenth of a simulated
// step at 512-token blocks.
func (m *blockManager) holds(s *seqBlocks, upTo int) bool {
	if m.allocateAll || !m.caching || len(m.groups) > 0 {
		return false
	}
	full := len(s.blocks) * m.blockSize
	return upTo == full || s.partial && full < upTo && upTo < full+m.blockSize
}

// takeWaiting removes s, the i-th waiting request.
func (e *Engine) takeWaiting(i int, s *seq) {
	if i == 0 {
		e.waiting.popFront()
		return
	}
	e.waiting.remove(s)
}

// firstSchedule counts s's prefix-cache lookup the first time it is
// scheduled (hits: its GPU hits in blocks).
func (e *Engine) firstSchedule(s *seq, hits int) {
	if s.started {
		return
	}
	s.started = true
	s.cachedTokens = s.numComputed
	if e.cfg.EnablePrefixCaching {
		e.m.PrefixQueries += uint64(s.numPrompt)
		e.m.PrefixHits += uint64(hits * e.cfg.BlockSize)
		if s.loadedBlocks > 0 {
			e.m.LoadedQueries += uint64(s.numPrompt)
			e.m.LoadedHits += uint64(hits * e.cfg.BlockSize)
		}
	}
	s.loadedBlocks = 0
}

// finish releases a finished request's blocks, but keeps its full prompt
// blocks held when it asked to (Request.HoldBlocks).
func (e *Engine) finish(s *seq) {
	keep := 0
	if s.hold && e.cfg.EnablePrefixCaching {
		keep = min(len(s.blocks), s.numPrompt/e.cfg.BlockSize)
	}
	if keep == 0 {
		e.bm.release(&s.seqBlocks)
		e.bm.spareBlocks.Keep(s.blocks, maxSpareLong)
		s.blocks = nil
		return
	}
	e.bm.releaseTail(&s.seqBlocks, keep)
	e.held[s.id] = s
	e.heldBlocks += keep
}

// preempt releases a running request's blocks and puts it back at the front
// of the waiting queue, to be recomputed (prompt and generated tokens).
func (e *Engine) preempt(s *seq) {
	e.bm.release(&s.seqBlocks)
	s.numComputed = 0
	s.prefilled = false
	s.chunk = 0
	s.state = stWaiting
	e.waiting.pushFront(s)
}
