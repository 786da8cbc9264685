// Package vllmevents is the codec of the KV-cache events vLLM (and SGLang)
// publish over ZeroMQ: msgpack batches of BlockStored, BlockRemoved and
// AllBlocksCleared events (SPEC §3.2). It is pure: no sockets (see package
// zmqevents for the transport) and no hashing (router.ApplyEngineStored
// turns token ids into the router's local hashes); it only exposes what the
// engine sent.
//
// # Wire format
//
// A payload is one batch. vLLM encodes it with msgspec; over its history
// three shapes exist, and DecodeBatch accepts all of them, mixed freely:
//
//   - batch as an array [ts, events] (old vLLM; msgspec omits a trailing
//     nil data_parallel_rank) or [ts, events, dp_rank|nil];
//   - batch as a map {"ts", "events", "data_parallel_rank"} (current vLLM),
//     the rank named "attn_dp_rank" by SGLang;
//   - each event either a positional array whose first element is the type
//     name ("BlockStored", "BlockRemoved", "AllBlocksCleared") or a map
//     whose "type" key holds it.
//
// Positional field order is BlockStored: type, block_hashes,
// parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
// extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window,
// locality;
// BlockRemoved: type, block_hashes, medium, group_idx; AllBlocksCleared:
// type. SGLang (0.5.18 on) puts a map {"cache_salt", "session_id"} at
// lora_name's position of a salted or session-attributed BlockStored, and
// after its PR #37482 sends map events with both as top-level keys; either
// way they become BlockStored.CacheSalt and SessionID. Trailing fields may be missing (msgspec omits trailing defaults) and
// take their zero value; extra trailing elements and unknown map keys are
// ignored; nil reads as the zero value everywhere except block_hashes,
// which is required.
//
// Block hashes arrive as msgpack uint64, int64 (the bits are reinterpreted:
// -1 is 0xffffffffffffffff) or bin. A bin hash of 8 bytes or more is cut to
// 8 bytes read big-endian: the last 8 by default (vLLM's
// int.from_bytes(h[-8:], "big")), the first 8 with HashFirst8 (SGLang); a
// shorter non-empty bin is read whole, big-endian. token_ids elements are
// integers or, under EAGLE, [a, b] pairs of which the first is kept.
//
// # Errors
//
// DecodeBatch fails only when the batch itself is unusable (not msgpack,
// not a batch, no events list, trailing bytes). An event that is malformed
// or of an unknown type is left out of Batch.Events and recorded in
// Batch.Skipped as an *EventError wrapping ErrMalformedEvent or
// ErrUnknownEvent, so one bad event never costs the rest of the batch.
// Decoding never panics and never recurses per nesting level, whatever the
// input (see FuzzDecodeBatch).
package vllmevents

import (
	"errors"
	"fmt"
	"strings"

	"github.com/kvrouter/kvrouter/core/kv"
)

// Event type names as they appear on the wire.
const (
	TypeBlockStored      = "BlockStored"
	TypeBlockRemoved     = "BlockRemoved"
	TypeAllBlocksCleared = "AllBlocksCleared"
)

// Medium is the storage medium an engine reports ("GPU", "CPU", "DISK", ...).
// The empty Medium is what a nil or absent medium decodes to; old vLLM sends
// none and means GPU.
type Medium string

// Tier maps a medium to the router's storage tier, as Dynamo does: "" (no
// medium: old vLLM, meaning GPU), GPU and DEVICE → device; CPU, CPU_PINNED
// and CPU_TIER1 → host_pinned; CPU_TIER2 (SGLang's and vLLM's second host
// tier, on disk in Dynamo's reading), DISK, NVME and STORAGE → disk;
// EXTERNAL, NETWORK, REMOTE and SHARED → external. Matching ignores case.
// Any other medium is not guessed: ok is false, and the caller does not
// place the event's blocks in any tier.
func Tier(m Medium) (tier kv.StorageTier, ok bool) {
	switch strings.ToUpper(string(m)) {
	case "", "GPU", "DEVICE":
		return kv.TierDevice, true
	case "CPU", "CPU_PINNED", "CPU_TIER1":
		return kv.TierHostPinned, true
	case "CPU_TIER2", "DISK", "NVME", "STORAGE":
		return kv.TierDisk, true
	case "EXTERNAL", "NETWORK", "REMOTE", "SHARED":
		return kv.TierExternal, true
	}
	return "", false
}

// Tier is Tier(m).
func (m Medium) Tier() (kv.StorageTier, bool) { return Tier(m) }

// Event is one decoded event: *BlockStored, *BlockRemoved or
// *AllBlocksCleared. The set is closed.
type Event interface {
	// Type is the wire type name (TypeBlockStored, ...).
	Type() string
	sealed()
}

// BlockStored says the engine now caches len(BlockHashes) blocks chained
// below ParentBlockHash (nil: the chain starts at the root). TokenIDs are
// the tokens of all those blocks, normally len(BlockHashes)*BlockSize.
type BlockStored struct {
	BlockHashes     []uint64
	ParentBlockHash *uint64
	TokenIDs        []uint32
	BlockSize       int
	LoRAID          *int   // deprecated by vLLM, kept for completeness
	Medium          Medium // "" when nil or absent
	LoRAName        string // "" when nil or absent
	// ExtraKeys is the raw msgpack of extra_keys (one entry per block:
	// multimodal ids, LoRA name, cache salt, ...), nil when nil or absent.
	ExtraKeys []byte
	GroupIdx  int // KV-cache group; 0 when nil or absent
	// KVCacheSpecKind is the group's attention kind (e.g. full or sliding
	// window), "" when nil or absent; KVCacheSpecSlidingWindow its window.
	KVCacheSpecKind          string
	KVCacheSpecSlidingWindow *int
	// Locality is where the blocks are stored relative to the engine,
	// "LOCAL" or "REMOTE", when it says (vLLM's storage tiers, v0.26 on);
	// "" when absent.
	Locality string
	// CacheSalt is the salt the blocks were computed under when the engine
	// names it in a field of its own (SGLang), "" otherwise; vLLM carries
	// it inside ExtraKeys instead.
	CacheSalt string
	// SessionID is the engine's session of the blocks (SGLang), "" when
	// absent.
	SessionID string
}

// BlockRemoved says the engine evicted these blocks.
type BlockRemoved struct {
	BlockHashes []uint64
	Medium      Medium
	GroupIdx    int
}

// AllBlocksCleared says the engine dropped its whole cache.
type AllBlocksCleared struct{}

func (*BlockStored) Type() string      { return TypeBlockStored }
func (*BlockRemoved) Type() string     { return TypeBlockRemoved }
func (*AllBlocksCleared) Type() string { return TypeAllBlocksCleared }
func (*BlockStored) sealed()           {}
func (*BlockRemoved) sealed()          {}
func (*AllBlocksCleared) sealed()      {}

// Batch is one published payload.
type Batch struct {
	TS     float64 // engine wall clock, seconds since the epoch
	Events []Event
	// DPRank is the data-parallel rank the batch names (nil: none, use the
	// socket's rank). A rank here overrides the socket's.
	DPRank *int
	// Skipped lists, on decoding, the events left out of Events because
	// they were malformed or of an unknown type. EncodeBatch ignores it.
	Skipped []*EventError
}

// Errors. Every decoding failure wraps exactly one of them.
var (
	// ErrMalformedBatch: the payload is not a usable batch; nothing decoded.
	ErrMalformedBatch = errors.New("vllmevents: malformed batch")
	// ErrMalformedEvent: one event could not be decoded and was skipped.
	ErrMalformedEvent = errors.New("vllmevents: malformed event")
	// ErrUnknownEvent: one event has a type this codec does not know and
	// was skipped (a newer engine, most likely).
	ErrUnknownEvent = errors.New("vllmevents: unknown event type")
)

// EventError describes one skipped event.
type EventError struct {
	Index int    // position in the batch's events list
	Type  string // the type name when one could be read, else ""
	Err   error  // ErrMalformedEvent or ErrUnknownEvent, possibly wrapped
}

func (e *EventError) Error() string {
	if e.Type != "" {
		return fmt.Sprintf("event %d (%s): %v", e.Index, e.Type, e.Err)
	}
	return fmt.Sprintf("event %d: %v", e.Index, e.Err)
}

func (e *EventError) Unwrap() error { return e.Err }

// Unknown reports whether the event was skipped for its unknown type (as
// opposed to being malformed).
func (e *EventError) Unknown() bool { return errors.Is(e.Err, ErrUnknownEvent) }

// DumpNextSeqHeader is the HTTP header of an engine's dump (a batch of
// single-block BlockStored events holding its whole cache, as kvrouter's
// mocker answers GET /kv_events/dump): the sequence number of the first
// published batch the dump does not include.
const DumpNextSeqHeader = "X-Kv-Events-Next-Seq"
