package vllmevents

import (
	"fmt"

	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// vLLM mixes per-block "extra keys" into its own block hash
// (vllm/v1/core/kv_cache_utils.py, generate_block_hash_extra_keys) and, since
// v0.10, publishes them with BlockStored, one entry per block: nil for a
// block without any, else a tuple ordered as the engine builds it:
//
//	LoRA name (every block of an adapter's request),
//	multimodal items covering the block: (identifier, start offset relative
//	  to the block) since v0.19, the bare identifier before,
//	the request's cache_salt (first block only),
//	prompt-embedding digests (bytes).
//
// ExtraKey is one element of such a tuple, typed but uninterpreted: which
// string is a salt and which an identifier is the consumer's call.

// ExtraKeyKind says what an ExtraKey holds.
type ExtraKeyKind uint8

const (
	// ExtraString: a bare string (LoRA name, salt, or a pre-v0.19
	// multimodal identifier).
	ExtraString ExtraKeyKind = iota + 1
	// ExtraIdentifierOffset: a (string, int) pair, a multimodal identifier
	// and its start offset relative to the block (may be negative: the
	// item started in an earlier block).
	ExtraIdentifierOffset
	// ExtraBytes: a binary value (prompt-embedding digest).
	ExtraBytes
	// ExtraInt, ExtraFloat, ExtraBool: scalars no engine sends today, kept so
	// that they can be counted rather than refused.
	ExtraInt
	ExtraFloat
	ExtraBool
	// ExtraOther: any other nested shape.
	ExtraOther
)

// ExtraKey is one extra key of one block.
type ExtraKey struct {
	Kind   ExtraKeyKind
	Str    string // ExtraString, ExtraIdentifierOffset
	Offset int64  // ExtraIdentifierOffset; also the value of ExtraInt
	Bytes  []byte // ExtraBytes
}

// ParseExtraKeys decodes the raw extra_keys of a BlockStored (its ExtraKeys
// field) into one entry per block, nil where the block has none. A nil or
// empty raw value gives nil. The result does not alias raw.
func ParseExtraKeys(raw []byte) ([][]ExtraKey, error) {
	if len(raw) == 0 {
		return nil, nil
	}
	r := &reader{b: raw}
	if r.readNil() {
		return nil, nil
	}
	n, err := r.readArrayLen()
	if err != nil {
		return nil, fmt.Errorf("extra_keys: %w", err)
	}
	out := make([][]ExtraKey, n)
	for i := range out {
		if r.readNil() {
			continue
		}
		m, err := r.readArrayLen()
		if err != nil {
			return nil, fmt.Errorf("extra_keys[%d]: %w", i, err)
		}
		keys := make([]ExtraKey, 0, m)
		for j := 0; j < m; j++ {
			k, err := r.readExtraKey()
			if err != nil {
				return nil, fmt.Errorf("extra_keys[%d][%d]: %w", i, j, err)
			}
			keys = append(keys, k)
		}
		out[i] = keys
	}
	if r.left() != 0 {
		return nil, fmt.Errorf("extra_keys: %d trailing bytes", r.left())
	}
	return out, nil
}

func (r *reader) readExtraKey() (ExtraKey, error) {
	c, err := r.peek()
	if err != nil {
		return ExtraKey{}, err
	}
	switch {
	case msgpcode.IsString(c):
		s, err := r.readString()
		return ExtraKey{Kind: ExtraString, Str: s}, err
	case msgpcode.IsBin(c):
		b, err := r.readStrBytes()
		return ExtraKey{Kind: ExtraBytes, Bytes: append([]byte(nil), b...)}, err
	case isInt(c):
		bits, _, err := r.readRawInt() // two's complement: int64 reads it back
		return ExtraKey{Kind: ExtraInt, Offset: int64(bits)}, err
	case c == msgpcode.False || c == msgpcode.True:
		r.off++
		return ExtraKey{Kind: ExtraBool}, nil
	case c == msgpcode.Float || c == msgpcode.Double:
		_, err := r.readFloat()
		return ExtraKey{Kind: ExtraFloat}, err
	case isArray(c):
		raw, err := r.skip()
		if err != nil {
			return ExtraKey{}, err
		}
		if k, ok := identifierOffset(raw); ok {
			return k, nil
		}
		return ExtraKey{Kind: ExtraOther}, nil
	}
	if _, err := r.skip(); err != nil {
		return ExtraKey{}, err
	}
	return ExtraKey{Kind: ExtraOther}, nil
}

// identifierOffset reads a [string, int] pair.
func identifierOffset(raw []byte) (ExtraKey, bool) {
	r := &reader{b: raw}
	if n, err := r.readArrayLen(); err != nil || n != 2 {
		return ExtraKey{}, false
	}
	s, err := r.readString()
	if err != nil {
		return ExtraKey{}, false
	}
	c, err := r.peek()
	if err != nil || !isInt(c) {
		return ExtraKey{}, false
	}
	bits, _, err := r.readRawInt()
	if err != nil || r.left() != 0 {
		return ExtraKey{}, false
	}
	return ExtraKey{Kind: ExtraIdentifierOffset, Str: s, Offset: int64(bits)}, true
}
