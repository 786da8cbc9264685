package vllmevents

import (
	"bytes"
	"errors"
	"fmt"

	"github.com/vmihailenco/msgpack/v5"
)

// Encoding selects the shape EncodeBatch writes. Each reproduces msgspec's
// output for vLLM's structs byte for byte: floats as float64, integers in
// their shortest form, strings as fixstr/str8/..., and trailing fields equal
// to their default (nil) omitted (omit_defaults).
type Encoding int

const (
	// EncodingArray: batch [ts, events(, dp_rank)] and positional events
	// ["BlockStored", ...]; vLLM's array_like structs (until mid-2026).
	EncodingArray Encoding = iota
	// EncodingMap: events as maps {"type": ..., field: value, ...} with the
	// batch still the array [ts, events(, dp_rank)], as the transitional
	// vLLM and SGLang releases send it.
	EncodingMap
	// EncodingMapBatch: events as maps and the batch as the map {"ts",
	// "events"(, "data_parallel_rank")}; current vLLM main, where neither
	// struct is array_like any more.
	EncodingMapBatch
)

func (e Encoding) String() string {
	switch e {
	case EncodingArray:
		return "array"
	case EncodingMap:
		return "map"
	case EncodingMapBatch:
		return "map-batch"
	}
	return fmt.Sprintf("Encoding(%d)", int(e))
}

// EncodeBatch encodes b as an engine would. Hashes are written as unsigned
// integers (vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES), a nil DPRank is
// omitted, "" strings (Medium, LoRAName, KVCacheSpecKind) are written as nil
// and GroupIdx 0 counts as the default. ExtraKeys, when set, must hold one
// msgpack value and is written verbatim. CacheSalt and SessionID, when set,
// are written as SGLang writes them: keys of a map event, or the metadata
// map at position 7 of an array event (ErrNoPosition when the event also
// has a LoRAName or a field after it). b.Skipped is ignored.
func EncodeBatch(b *Batch, enc Encoding) ([]byte, error) {
	if b == nil {
		return nil, errors.New("vllmevents: nil batch")
	}
	if enc < EncodingArray || enc > EncodingMapBatch {
		return nil, fmt.Errorf("vllmevents: unknown encoding %d", int(enc))
	}
	var buf bytes.Buffer
	e := msgpack.NewEncoder(&buf)
	w := &writer{e: e}
	if enc == EncodingMapBatch {
		n := 2
		if b.DPRank != nil {
			n = 3
		}
		w.mapLen(n)
		w.str("ts")
		w.float(b.TS)
		w.str("events")
	} else {
		n := 2
		if b.DPRank != nil {
			n = 3
		}
		w.arrayLen(n)
		w.float(b.TS)
	}
	w.arrayLen(len(b.Events))
	for i, ev := range b.Events {
		if err := w.event(ev, enc != EncodingArray); err != nil {
			return nil, fmt.Errorf("vllmevents: event %d: %w", i, err)
		}
	}
	if b.DPRank != nil {
		if enc == EncodingMapBatch {
			w.str("data_parallel_rank")
		}
		w.int(int64(*b.DPRank))
	}
	if w.err != nil {
		return nil, fmt.Errorf("vllmevents: %w", w.err)
	}
	return buf.Bytes(), nil
}

// writer wraps msgpack.Encoder, keeping the first error.
type writer struct {
	e   *msgpack.Encoder
	err error
}

func (w *writer) do(err error) {
	if w.err == nil {
		w.err = err
	}
}

func (w *writer) arrayLen(n int) { w.do(w.e.EncodeArrayLen(n)) }
func (w *writer) mapLen(n int)   { w.do(w.e.EncodeMapLen(n)) }
func (w *writer) str(s string)   { w.do(w.e.EncodeString(s)) }
func (w *writer) float(f float64) {
	w.do(w.e.EncodeFloat64(f))
}
func (w *writer) uint(v uint64) { w.do(w.e.EncodeUint(v)) }
func (w *writer) int(v int64)   { w.do(w.e.EncodeInt(v)) }
func (w *writer) nil()          { w.do(w.e.EncodeNil()) }

func (w *writer) optStr(s string) {
	if s == "" {
		w.nil()
		return
	}
	w.str(s)
}

func (w *writer) optInt(p *int) {
	if p == nil {
		w.nil()
		return
	}
	w.int(int64(*p))
}

func (w *writer) hashes(hs []uint64) {
	w.arrayLen(len(hs))
	for _, h := range hs {
		w.uint(h)
	}
}

// encField is one named event field and how to write it.
type encField struct {
	name      string
	isDefault bool // equal to its default: omitted when trailing (array) or always (map)
	hasDflt   bool // the field has a default at all (msgspec omits only those)
	write     func()
}

func (w *writer) event(ev Event, asMap bool) error {
	var (
		typ    string
		fields []encField
	)
	switch ev := ev.(type) {
	case *BlockStored:
		if ev == nil {
			return errors.New("nil *BlockStored")
		}
		if ev.BlockSize < 0 || ev.GroupIdx < 0 {
			return errors.New("negative block_size or group_idx")
		}
		typ = TypeBlockStored
		fields = []encField{
			{name: "block_hashes", write: func() { w.hashes(ev.BlockHashes) }},
			{name: "parent_block_hash", write: func() {
				if ev.ParentBlockHash == nil {
					w.nil()
				} else {
					w.uint(*ev.ParentBlockHash)
				}
			}},
			{name: "token_ids", write: func() {
				w.arrayLen(len(ev.TokenIDs))
				for _, t := range ev.TokenIDs {
					w.uint(uint64(t))
				}
			}},
			{name: "block_size", write: func() { w.int(int64(ev.BlockSize)) }},
			{name: "lora_id", write: func() { w.optInt(ev.LoRAID) }},
			{name: "medium", write: func() { w.optStr(string(ev.Medium)) }},
			{name: "lora_name", write: func() { w.optStr(ev.LoRAName) }},
			{name: "extra_keys", hasDflt: true, isDefault: len(ev.ExtraKeys) == 0, write: func() {
				if len(ev.ExtraKeys) == 0 {
					w.nil()
					return
				}
				r := &reader{b: ev.ExtraKeys}
				if _, err := r.skip(); err != nil || r.left() != 0 {
					w.do(errors.New("extra_keys is not one msgpack value"))
					return
				}
				_, err := w.e.Writer().Write(ev.ExtraKeys)
				w.do(err)
			}},
			{name: "group_idx", hasDflt: true, isDefault: ev.GroupIdx == 0, write: func() { w.int(int64(ev.GroupIdx)) }},
			{name: "kv_cache_spec_kind", hasDflt: true, isDefault: ev.KVCacheSpecKind == "", write: func() { w.optStr(ev.KVCacheSpecKind) }},
			{name: "kv_cache_spec_sliding_window", hasDflt: true, isDefault: ev.KVCacheSpecSlidingWindow == nil, write: func() { w.optInt(ev.KVCacheSpecSlidingWindow) }},
			{name: "locality", hasDflt: true, isDefault: ev.Locality == "", write: func() { w.optStr(ev.Locality) }},
		}
		if ev.CacheSalt != "" || ev.SessionID != "" {
			if !asMap {
				return w.sglangPositional(ev, fields)
			}
			fields = append(fields,
				encField{name: "cache_salt", hasDflt: true, isDefault: ev.CacheSalt == "", write: func() { w.str(ev.CacheSalt) }},
				encField{name: "session_id", hasDflt: true, isDefault: ev.SessionID == "", write: func() { w.str(ev.SessionID) }})
		}
	case *BlockRemoved:
		if ev == nil {
			return errors.New("nil *BlockRemoved")
		}
		if ev.GroupIdx < 0 {
			return errors.New("negative group_idx")
		}
		typ = TypeBlockRemoved
		fields = []encField{
			{name: "block_hashes", write: func() { w.hashes(ev.BlockHashes) }},
			{name: "medium", write: func() { w.optStr(string(ev.Medium)) }},
			{name: "group_idx", hasDflt: true, isDefault: ev.GroupIdx == 0, write: func() { w.int(int64(ev.GroupIdx)) }},
		}
	case *AllBlocksCleared:
		if ev == nil {
			return errors.New("nil *AllBlocksCleared")
		}
		typ = TypeAllBlocksCleared
	default:
		return fmt.Errorf("unsupported event %T", ev)
	}

	if asMap {
		n := 1
		for _, f := range fields {
			if !(f.hasDflt && f.isDefault) {
				n++
			}
		}
		w.mapLen(n)
		w.str("type")
		w.str(typ)
		for _, f := range fields {
			if f.hasDflt && f.isDefault {
				continue
			}
			w.str(f.name)
			f.write()
		}
		return w.err
	}
	// Positional: drop trailing defaulted fields.
	last := len(fields)
	for last > 0 && fields[last-1].hasDflt && fields[last-1].isDefault {
		last--
	}
	w.arrayLen(1 + last)
	w.str(typ)
	for _, f := range fields[:last] {
		f.write()
	}
	return w.err
}

// ErrNoPosition: the event has CacheSalt or SessionID and a field past
// medium, and the array shape has no position for both (SGLang's metadata
// map takes vLLM's lora_name position).
var ErrNoPosition = errors.New("vllmevents: cache_salt or session_id beside lora_name or a later field has no array position")

// sglangPositional writes a BlockStored carrying CacheSalt or SessionID as
// SGLang's array_like BlockStoredWithMetadata: the fields up to medium, then
// the metadata map, whose unset keys are left out.
func (w *writer) sglangPositional(ev *BlockStored, fields []encField) error {
	const medium = 6 // block_hashes .. medium
	for _, f := range fields[medium:] {
		if f.name == "lora_name" && ev.LoRAName != "" || f.hasDflt && !f.isDefault {
			return ErrNoPosition
		}
	}
	w.arrayLen(1 + medium + 1)
	w.str(TypeBlockStored)
	for _, f := range fields[:medium] {
		f.write()
	}
	var meta []string
	if ev.CacheSalt != "" {
		meta = append(meta, "cache_salt", ev.CacheSalt)
	}
	if ev.SessionID != "" {
		meta = append(meta, "session_id", ev.SessionID)
	}
	w.mapLen(len(meta) / 2)
	for _, s := range meta {
		w.str(s)
	}
	return w.err
}
