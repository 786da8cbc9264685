// Package kv holds the vocabulary shared by every part of kvrouter: worker
// identities and the router's internal model of KV-cache events.
//
// The event model mirrors the JSON shape engines and routers exchange on the
// event plane (worker_id, storage_tier, event{event_id, dp_rank, data}) so
// that a dump written by one component can be replayed by any other.
package kv

import (
	"encoding/json"
	"errors"
	"fmt"
)

// Worker identifies one engine rank. A data-parallel engine exposes one
// Worker per rank; everything in the router (index, load, selection) keys on
// the pair, never on the engine alone.
type Worker struct {
	ID     uint64 `json:"worker_id"`
	DPRank uint32 `json:"dp_rank"`
}

func (w Worker) String() string { return fmt.Sprintf("%d/%d", w.ID, w.DPRank) }

// StorageTier says where a cached block lives.
type StorageTier string

const (
	TierDevice     StorageTier = "device"
	TierHostPinned StorageTier = "host_pinned"
	TierDisk       StorageTier = "disk"
	TierExternal   StorageTier = "external"
)

// Block is one cached block as an engine reports it. EngineHash is the
// engine's own opaque id (vLLM's SHA-256 chain, SGLang's chain, ...): it is
// only ever used to resolve parents and removals. LocalHash is the router's
// content hash (see package blockhash) and is what the index walks by.
type Block struct {
	EngineHash uint64 `json:"block_hash"`
	LocalHash  uint64 `json:"tokens_hash"`
}

// Stored says a worker now holds Blocks, a chain hanging below the block the
// worker knows as Parent (nil: the chain starts at the root).
type Stored struct {
	Parent        *uint64 `json:"parent_hash"`
	StartPosition *uint32 `json:"start_position"`
	Blocks        []Block `json:"blocks"`
}

// Removed says a worker dropped the blocks it knows by these engine hashes.
type Removed struct {
	EngineHashes []uint64 `json:"block_hashes"`
}

// Kind discriminates the three event payloads.
type Kind uint8

const (
	KindStored Kind = iota + 1
	KindRemoved
	KindCleared
)

func (k Kind) String() string {
	switch k {
	case KindStored:
		return "stored"
	case KindRemoved:
		return "removed"
	case KindCleared:
		return "cleared"
	}
	return "unknown"
}

// Event is one KV event of one worker rank. Exactly one of Stored/Removed is
// set, according to Kind; Cleared carries no payload.
type Event struct {
	Worker  Worker
	Tier    StorageTier
	EventID uint64
	Kind    Kind
	Stored  Stored
	Removed Removed
}

// StoredEvent builds a Stored event; parent may be nil.
func StoredEvent(w Worker, id uint64, parent *uint64, blocks ...Block) Event {
	return Event{Worker: w, Tier: TierDevice, EventID: id, Kind: KindStored, Stored: Stored{Parent: parent, Blocks: blocks}}
}

// RemovedEvent builds a Removed event.
func RemovedEvent(w Worker, id uint64, engineHashes ...uint64) Event {
	return Event{Worker: w, Tier: TierDevice, EventID: id, Kind: KindRemoved, Removed: Removed{EngineHashes: engineHashes}}
}

// ClearedEvent builds a Cleared event.
func ClearedEvent(w Worker, id uint64) Event {
	return Event{Worker: w, Tier: TierDevice, EventID: id, Kind: KindCleared}
}

// Ptr returns a pointer to h, for Stored.Parent literals.
func Ptr(h uint64) *uint64 { return &h }

type wireEvent struct {
	WorkerID    uint64      `json:"worker_id"`
	StorageTier StorageTier `json:"storage_tier,omitempty"`
	Event       wireInner   `json:"event"`
}

type wireInner struct {
	EventID uint64          `json:"event_id"`
	DPRank  uint32          `json:"dp_rank"`
	Data    json.RawMessage `json:"data"`
}

// ErrMalformedEvent wraps every decoding failure of UnmarshalJSON.
var ErrMalformedEvent = errors.New("kv: malformed event")

// UnmarshalJSON reads the plane's JSON shape. A missing storage tier means
// device memory. Events as kvrouter writes them take a single-pass decoder;
// anything it does not expect (other key spellings, extra keys, escapes)
// goes through encoding/json, which also words the errors.
func (e *Event) UnmarshalJSON(b []byte) error {
	if ev, ok := decodeFast(b); ok {
		*e = ev
		return nil
	}
	return e.unmarshalSlow(b)
}

func (e *Event) unmarshalSlow(b []byte) error {
	var w wireEvent
	if err := json.Unmarshal(b, &w); err != nil {
		return fmt.Errorf("%w: %v", ErrMalformedEvent, err)
	}
	out := Event{Worker: Worker{ID: w.WorkerID, DPRank: w.Event.DPRank}, Tier: w.StorageTier, EventID: w.Event.EventID}
	if out.Tier == "" {
		out.Tier = TierDevice
	}
	var name string
	if json.Unmarshal(w.Event.Data, &name) == nil {
		if name != "cleared" {
			return fmt.Errorf("%w: unknown event %q", ErrMalformedEvent, name)
		}
		out.Kind = KindCleared
		*e = out
		return nil
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(w.Event.Data, &m); err != nil || len(m) != 1 {
		return fmt.Errorf("%w: data must be \"cleared\" or an object with one key", ErrMalformedEvent)
	}
	switch {
	case m["stored"] != nil:
		out.Kind = KindStored
		if err := json.Unmarshal(m["stored"], &out.Stored); err != nil {
			return fmt.Errorf("%w: stored: %v", ErrMalformedEvent, err)
		}
	case m["removed"] != nil:
		out.Kind = KindRemoved
		if err := json.Unmarshal(m["removed"], &out.Removed); err != nil {
			return fmt.Errorf("%w: removed: %v", ErrMalformedEvent, err)
		}
	default:
		return fmt.Errorf("%w: unknown event data", ErrMalformedEvent)
	}
	*e = out
	return nil
}
