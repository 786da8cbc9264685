package vllmevents

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"

	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// HashBytes says which 8 bytes of a bin block hash become the uint64 hash.
type HashBytes uint8

const (
	// HashLast8 reads the last 8 bytes big-endian: vLLM's
	// int.from_bytes(hash[-8:], "big"). The default.
	HashLast8 HashBytes = iota
	// HashFirst8 reads the first 8 bytes big-endian (SGLang).
	HashFirst8
)

// DecodeOptions tune DecodeBatchWith. The zero value is vLLM's convention.
type DecodeOptions struct {
	HashBytes HashBytes
}

// DecodeBatch decodes one payload with vLLM's conventions (DecodeOptions{}).
func DecodeBatch(payload []byte) (*Batch, error) {
	return DecodeBatchWith(payload, DecodeOptions{})
}

// DecodeBatchWith decodes one payload. It returns an error wrapping
// ErrMalformedBatch when the batch is unusable; bad events inside a good
// batch are reported in Batch.Skipped instead. The returned batch does not
// alias payload.
func DecodeBatchWith(payload []byte, opts DecodeOptions) (*Batch, error) {
	r := &reader{b: payload}
	c, err := r.peek()
	if err != nil {
		return nil, batchErr(err)
	}
	var (
		b         Batch
		events    []byte // raw events array
		haveTS    bool
		haveEvts  bool
		rankRaw   []byte
		rankFound bool
	)
	switch {
	case isArray(c):
		n, err := r.readArrayLen()
		if err != nil {
			return nil, batchErr(err)
		}
		if n < 2 {
			return nil, batchErr(fmt.Errorf("batch array has %d elements, want at least 2", n))
		}
		if b.TS, err = r.readFloat(); err != nil {
			return nil, batchErr(fmt.Errorf("ts: %w", err))
		}
		haveTS = true
		if events, err = r.skip(); err != nil {
			return nil, batchErr(err)
		}
		haveEvts = true
		for i := 2; i < n; i++ {
			v, err := r.skip()
			if err != nil {
				return nil, batchErr(err)
			}
			if i == 2 {
				rankRaw, rankFound = v, true
			}
		}
	case isMap(c):
		n, err := r.readMapLen()
		if err != nil {
			return nil, batchErr(err)
		}
		for i := 0; i < n; i++ {
			key, kerr := r.mapKey()
			if kerr != nil {
				return nil, batchErr(kerr)
			}
			switch key {
			case "ts":
				if b.TS, err = r.readFloat(); err != nil {
					return nil, batchErr(fmt.Errorf("ts: %w", err))
				}
				haveTS = true
				continue
			}
			v, err := r.skip()
			if err != nil {
				return nil, batchErr(err)
			}
			switch key {
			case "events":
				events, haveEvts = v, true
			case "data_parallel_rank", "attn_dp_rank", "dp_rank":
				rankRaw, rankFound = v, true
			}
		}
	default:
		return nil, batchErr(fmt.Errorf("batch is code %s, want an array or a map", codeName(c)))
	}
	if r.left() != 0 {
		return nil, batchErr(fmt.Errorf("%d trailing bytes after the batch", r.left()))
	}
	if !haveTS || !haveEvts {
		return nil, batchErr(errors.New("batch lacks ts or events"))
	}
	if rankFound {
		rr := &reader{b: rankRaw}
		if !rr.readNil() {
			rank, err := rr.readInt()
			if err != nil || rank < 0 || int64(rank) > math.MaxUint32 {
				return nil, batchErr(fmt.Errorf("data-parallel rank: not a uint32"))
			}
			b.DPRank = &rank
		}
	}

	er := &reader{b: events}
	if er.readNil() {
		return &b, nil
	}
	n, err := er.readArrayLen()
	if err != nil {
		return nil, batchErr(fmt.Errorf("events: %w", err))
	}
	b.Events = make([]Event, 0, n)
	for i := 0; i < n; i++ {
		raw, err := er.skip()
		if err != nil { // cannot happen: skip above validated the structure
			return nil, batchErr(err)
		}
		ev, typ, err := decodeEvent(raw, opts)
		if err != nil {
			b.Skipped = append(b.Skipped, &EventError{Index: i, Type: typ, Err: err})
			continue
		}
		b.Events = append(b.Events, ev)
	}
	return &b, nil
}

func batchErr(err error) error { return fmt.Errorf("%w: %v", ErrMalformedBatch, err) }

func eventErr(field string, err error) error {
	return fmt.Errorf("%w: %s: %v", ErrMalformedEvent, field, err)
}

// mapKey reads a map key; keys that are not strings read as "" so their
// value is skipped as unknown.
func (r *reader) mapKey() (string, error) {
	c, err := r.peek()
	if err != nil {
		return "", err
	}
	if msgpcode.IsString(c) {
		return r.readString()
	}
	_, err = r.skip()
	return "", err
}

// Field positions in the positional (array) encodings; 0 is the type.
var (
	storedFields = []string{"type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
		"lora_id", "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
		"kv_cache_spec_sliding_window", "locality"}
	removedFields = []string{"type", "block_hashes", "medium", "group_idx"}
)

// sglangMetadataPos is where SGLang's positional BlockStored carries its
// metadata map ({"cache_salt": ..., "session_id": ...}): vLLM's lora_name
// position, which SGLang never fills. A map there is SGLang's.
const sglangMetadataPos = 7

// decodeEvent decodes one event from its raw bytes. It returns the type name
// whenever one could be read, for error reports.
func decodeEvent(raw []byte, opts DecodeOptions) (Event, string, error) {
	r := &reader{b: raw}
	c, _ := r.peek()
	// Collect the raw field values by name, whatever the shape.
	var (
		typ    string
		fields = map[string][]byte{}
	)
	switch {
	case isArray(c):
		n, _ := r.readArrayLen()
		if n == 0 {
			return nil, "", fmt.Errorf("%w: empty event array", ErrMalformedEvent)
		}
		t, err := r.readString()
		if err != nil {
			return nil, "", eventErr("type", err)
		}
		typ = t
		var names []string
		switch typ {
		case TypeBlockStored:
			names = storedFields
		case TypeBlockRemoved:
			names = removedFields
		}
		for i := 1; i < n; i++ {
			v, err := r.skip()
			if err != nil {
				return nil, typ, eventErr("fields", err)
			}
			if i < len(names) {
				name := names[i]
				if i == sglangMetadataPos && typ == TypeBlockStored && isMap(v[0]) {
					name = "metadata"
				}
				fields[name] = v
			}
		}
	case isMap(c):
		n, _ := r.readMapLen()
		haveType := false
		for i := 0; i < n; i++ {
			k, err := r.mapKey()
			if err != nil {
				return nil, "", eventErr("key", err)
			}
			if k == "type" {
				t, err := r.readString()
				if err != nil {
					return nil, "", eventErr("type", err)
				}
				typ, haveType = t, true
				continue
			}
			v, err := r.skip()
			if err != nil {
				return nil, typ, eventErr(k, err)
			}
			fields[k] = v
		}
		if !haveType {
			return nil, "", fmt.Errorf("%w: map event without \"type\"", ErrMalformedEvent)
		}
	default:
		return nil, "", fmt.Errorf("%w: event is code %s, want an array or a map", ErrMalformedEvent, codeName(c))
	}

	switch typ {
	case TypeBlockStored:
		ev, err := decodeStored(fields, opts)
		return ev, typ, err
	case TypeBlockRemoved:
		ev, err := decodeRemoved(fields, opts)
		return ev, typ, err
	case TypeAllBlocksCleared:
		return &AllBlocksCleared{}, typ, nil
	}
	return nil, typ, fmt.Errorf("%w: %q", ErrUnknownEvent, typ)
}

// field returns a reader on a field's raw value, or nil when the field is
// absent or nil.
func field(fields map[string][]byte, name string) *reader {
	raw, ok := fields[name]
	if !ok {
		return nil
	}
	r := &reader{b: raw}
	if r.readNil() {
		return nil
	}
	return r
}

func decodeStored(f map[string][]byte, opts DecodeOptions) (*BlockStored, error) {
	var ev BlockStored
	var err error
	if ev.BlockHashes, err = hashList(f, opts); err != nil {
		return nil, err
	}
	if r := field(f, "parent_block_hash"); r != nil {
		h, err := readHash(r, opts)
		if err != nil {
			return nil, eventErr("parent_block_hash", err)
		}
		ev.ParentBlockHash = &h
	}
	if r := field(f, "token_ids"); r != nil {
		if ev.TokenIDs, err = readTokens(r); err != nil {
			return nil, eventErr("token_ids", err)
		}
	}
	if r := field(f, "block_size"); r != nil {
		v, err := r.readUint(math.MaxInt32)
		if err != nil {
			return nil, eventErr("block_size", err)
		}
		ev.BlockSize = int(v)
	}
	if r := field(f, "lora_id"); r != nil {
		v, err := r.readInt()
		if err != nil {
			return nil, eventErr("lora_id", err)
		}
		ev.LoRAID = &v
	}
	if ev.Medium, err = medium(f); err != nil {
		return nil, err
	}
	if r := field(f, "lora_name"); r != nil {
		if ev.LoRAName, err = r.readString(); err != nil {
			return nil, eventErr("lora_name", err)
		}
	}
	if err := sglangMetadata(f, &ev); err != nil {
		return nil, err
	}
	if r := field(f, "extra_keys"); r != nil {
		ev.ExtraKeys = append([]byte(nil), r.b...)
	}
	if ev.GroupIdx, err = groupIdx(f); err != nil {
		return nil, err
	}
	if r := field(f, "kv_cache_spec_kind"); r != nil {
		if ev.KVCacheSpecKind, err = r.readString(); err != nil {
			return nil, eventErr("kv_cache_spec_kind", err)
		}
	}
	if r := field(f, "kv_cache_spec_sliding_window"); r != nil {
		v, err := r.readInt()
		if err != nil {
			return nil, eventErr("kv_cache_spec_sliding_window", err)
		}
		ev.KVCacheSpecSlidingWindow = &v
	}
	if r := field(f, "locality"); r != nil {
		if ev.Locality, err = r.readString(); err != nil {
			return nil, eventErr("locality", err)
		}
	}
	return &ev, nil
}

// sglangMetadata reads SGLang's cache_salt and session_id: top-level keys
// of a map event (SGLang after its PR #37482), or keys of the metadata map
// of a positional one (SGLang 0.5.18 on); a top-level value wins.
func sglangMetadata(f map[string][]byte, ev *BlockStored) error {
	if r := field(f, "metadata"); r != nil {
		n, err := r.readMapLen()
		if err != nil {
			return eventErr("metadata", err)
		}
		meta := map[string][]byte{}
		for range n {
			k, err := r.mapKey()
			if err != nil {
				return eventErr("metadata", err)
			}
			v, err := r.skip()
			if err != nil {
				return eventErr("metadata", err)
			}
			meta[k] = v
		}
		if err := readStrings(meta, ev); err != nil {
			return err
		}
	}
	return readStrings(f, ev)
}

// readStrings sets ev's CacheSalt and SessionID from the fields present.
func readStrings(f map[string][]byte, ev *BlockStored) error {
	for _, s := range []struct {
		name string
		to   *string
	}{{"cache_salt", &ev.CacheSalt}, {"session_id", &ev.SessionID}} {
		r := field(f, s.name)
		if r == nil {
			continue
		}
		v, err := r.readString()
		if err != nil {
			return eventErr(s.name, err)
		}
		*s.to = v
	}
	return nil
}

func decodeRemoved(f map[string][]byte, opts DecodeOptions) (*BlockRemoved, error) {
	var ev BlockRemoved
	var err error
	if ev.BlockHashes, err = hashList(f, opts); err != nil {
		return nil, err
	}
	if ev.Medium, err = medium(f); err != nil {
		return nil, err
	}
	if ev.GroupIdx, err = groupIdx(f); err != nil {
		return nil, err
	}
	return &ev, nil
}

func medium(f map[string][]byte) (Medium, error) {
	r := field(f, "medium")
	if r == nil {
		return "", nil
	}
	s, err := r.readString()
	if err != nil {
		return "", eventErr("medium", err)
	}
	return Medium(s), nil
}

func groupIdx(f map[string][]byte) (int, error) {
	r := field(f, "group_idx")
	if r == nil {
		return 0, nil
	}
	v, err := r.readUint(math.MaxInt32)
	if err != nil {
		return 0, eventErr("group_idx", err)
	}
	return int(v), nil
}

func hashList(f map[string][]byte, opts DecodeOptions) ([]uint64, error) {
	r := field(f, "block_hashes")
	if r == nil {
		return nil, fmt.Errorf("%w: block_hashes missing", ErrMalformedEvent)
	}
	n, err := r.readArrayLen()
	if err != nil {
		return nil, eventErr("block_hashes", err)
	}
	out := make([]uint64, n)
	for i := range out {
		if out[i], err = readHash(r, opts); err != nil {
			return nil, eventErr(fmt.Sprintf("block_hashes[%d]", i), err)
		}
	}
	return out, nil
}

// readHash reads one block hash: an integer (bits reinterpreted) or a bin.
func readHash(r *reader, opts DecodeOptions) (uint64, error) {
	c, err := r.peek()
	if err != nil {
		return 0, err
	}
	if isInt(c) {
		v, _, err := r.readRawInt()
		return v, err
	}
	if !msgpcode.IsBin(c) {
		return 0, fmt.Errorf("hash is code %s, want an integer or bin", codeName(c))
	}
	b, err := r.readStrBytes()
	if err != nil {
		return 0, err
	}
	switch {
	case len(b) == 0:
		return 0, errors.New("empty bin hash")
	case len(b) < 8:
		var v uint64
		for _, x := range b {
			v = v<<8 | uint64(x)
		}
		return v, nil
	case opts.HashBytes == HashFirst8:
		return binary.BigEndian.Uint64(b[:8]), nil
	default:
		return binary.BigEndian.Uint64(b[len(b)-8:]), nil
	}
}

// readTokens reads token_ids: integers, or [a, b, ...] arrays (EAGLE pairs)
// of which the first element is kept.
func readTokens(r *reader) ([]uint32, error) {
	n, err := r.readArrayLen()
	if err != nil {
		return nil, err
	}
	out := make([]uint32, n)
	for i := range out {
		c, err := r.peek()
		if err != nil {
			return nil, err
		}
		// Plain unsigned ids, nearly every token: read inline.
		if b := r.b[r.off:]; c <= 0x7f {
			out[i], r.off = uint32(c), r.off+1
			continue
		} else if c == msgpcode.Uint8 && len(b) >= 2 {
			out[i], r.off = uint32(b[1]), r.off+2
			continue
		} else if c == msgpcode.Uint16 && len(b) >= 3 {
			out[i], r.off = uint32(binary.BigEndian.Uint16(b[1:])), r.off+3
			continue
		} else if c == msgpcode.Uint32 && len(b) >= 5 {
			out[i], r.off = binary.BigEndian.Uint32(b[1:]), r.off+5
			continue
		}
		if isArray(c) {
			m, err := r.readArrayLen()
			if err != nil {
				return nil, err
			}
			if m == 0 {
				return nil, fmt.Errorf("token %d: empty pair", i)
			}
			v, err := r.readUint(math.MaxUint32)
			if err != nil {
				return nil, fmt.Errorf("token %d: %v", i, err)
			}
			out[i] = uint32(v)
			for j := 1; j < m; j++ {
				if _, err := r.skip(); err != nil {
					return nil, err
				}
			}
			continue
		}
		v, err := r.readUint(math.MaxUint32)
		if err != nil {
			return nil, fmt.Errorf("token %d: %v", i, err)
		}
		out[i] = uint32(v)
	}
	return out, nil
}
