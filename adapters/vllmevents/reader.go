package vllmevents

import (
	"errors"
	"fmt"
	"math"

	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// reader is a bounds-checked msgpack cursor over one payload. It never
// recurses (skip walks nested values with a counter), never allocates more
// than the input can justify (every length is checked against the bytes
// left) and never panics; that is why decoding does not use
// msgpack.Decoder, whose Skip recurses once per nesting level.
type reader struct {
	b   []byte
	off int
}

var errShort = errors.New("unexpected end of data")

func (r *reader) left() int { return len(r.b) - r.off }

func (r *reader) peek() (byte, error) {
	if r.off >= len(r.b) {
		return 0, errShort
	}
	return r.b[r.off], nil
}

func (r *reader) take(n int) ([]byte, error) {
	if n < 0 || n > r.left() {
		return nil, errShort
	}
	s := r.b[r.off : r.off+n : r.off+n]
	r.off += n
	return s, nil
}

func (r *reader) uintN(n int) (uint64, error) {
	s, err := r.take(n)
	if err != nil {
		return 0, err
	}
	var v uint64
	for _, c := range s {
		v = v<<8 | uint64(c)
	}
	return v, nil
}

func codeName(c byte) string { return fmt.Sprintf("0x%02x", c) }

func isNil(c byte) bool { return c == msgpcode.Nil }

func isInt(c byte) bool {
	return msgpcode.IsFixedNum(c) || (c >= msgpcode.Uint8 && c <= msgpcode.Int64)
}

func isArray(c byte) bool {
	return msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32
}

func isMap(c byte) bool {
	return msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32
}

// readNil consumes a nil if one is next and reports whether it did.
func (r *reader) readNil() bool {
	if c, err := r.peek(); err == nil && isNil(c) {
		r.off++
		return true
	}
	return false
}

// readRawInt reads any msgpack integer. neg says the value is negative
// (only possible for signed codes); bits is its two's-complement uint64.
func (r *reader) readRawInt() (bits uint64, neg bool, err error) {
	c, err := r.peek()
	if err != nil {
		return 0, false, err
	}
	r.off++
	switch {
	case c <= msgpcode.PosFixedNumHigh:
		return uint64(c), false, nil
	case c >= msgpcode.NegFixedNumLow:
		v := int64(int8(c))
		return uint64(v), true, nil
	}
	var v uint64
	switch c {
	case msgpcode.Uint8:
		v, err = r.uintN(1)
	case msgpcode.Uint16:
		v, err = r.uintN(2)
	case msgpcode.Uint32:
		v, err = r.uintN(4)
	case msgpcode.Uint64:
		v, err = r.uintN(8)
	case msgpcode.Int8:
		v, err = r.uintN(1)
		v = uint64(int64(int8(v)))
	case msgpcode.Int16:
		v, err = r.uintN(2)
		v = uint64(int64(int16(v)))
	case msgpcode.Int32:
		v, err = r.uintN(4)
		v = uint64(int64(int32(v)))
	case msgpcode.Int64:
		v, err = r.uintN(8)
	default:
		r.off--
		return 0, false, fmt.Errorf("want an integer, got code %s", codeName(c))
	}
	if err != nil {
		return 0, false, err
	}
	isSigned := c >= msgpcode.Int8 && c <= msgpcode.Int64
	return v, isSigned && int64(v) < 0, nil
}

// readUint reads a non-negative integer no larger than max.
func (r *reader) readUint(max uint64) (uint64, error) {
	v, neg, err := r.readRawInt()
	if err != nil {
		return 0, err
	}
	if neg || v > max {
		return 0, fmt.Errorf("integer out of range")
	}
	return v, nil
}

// readInt reads an integer that fits a Go int.
func (r *reader) readInt() (int, error) {
	v, neg, err := r.readRawInt()
	if err != nil {
		return 0, err
	}
	if neg {
		if int64(v) < math.MinInt {
			return 0, fmt.Errorf("integer out of range")
		}
		return int(int64(v)), nil
	}
	if v > math.MaxInt {
		return 0, fmt.Errorf("integer out of range")
	}
	return int(v), nil
}

// readFloat reads a float32/float64 or any integer as a float64.
func (r *reader) readFloat() (float64, error) {
	c, err := r.peek()
	if err != nil {
		return 0, err
	}
	switch c {
	case msgpcode.Double:
		r.off++
		v, err := r.uintN(8)
		return math.Float64frombits(v), err
	case msgpcode.Float:
		r.off++
		v, err := r.uintN(4)
		return float64(math.Float32frombits(uint32(v))), err
	}
	if isInt(c) {
		v, neg, err := r.readRawInt()
		if neg {
			return float64(int64(v)), err
		}
		return float64(v), err
	}
	return 0, fmt.Errorf("want a number, got code %s", codeName(c))
}

func (r *reader) readLen(c byte, lo, mask, c16, c32 byte) (int, bool, error) {
	switch {
	case c >= lo && c <= lo|mask:
		r.off++
		return int(c & mask), true, nil
	case c == c16:
		r.off++
		v, err := r.uintN(2)
		return int(v), true, err
	case c == c32:
		r.off++
		v, err := r.uintN(4)
		return int(v), true, err
	}
	return 0, false, nil
}

// readArrayLen reads an array header. n is bounded by the bytes left (every
// element takes at least one byte), so callers may allocate n elements.
func (r *reader) readArrayLen() (int, error) {
	c, err := r.peek()
	if err != nil {
		return 0, err
	}
	n, ok, err := r.readLen(c, msgpcode.FixedArrayLow, msgpcode.FixedArrayMask, msgpcode.Array16, msgpcode.Array32)
	if !ok {
		return 0, fmt.Errorf("want an array, got code %s", codeName(c))
	}
	if err == nil && n > r.left() {
		err = errShort
	}
	return n, err
}

// readMapLen reads a map header (n key/value pairs, n*2 <= bytes left).
func (r *reader) readMapLen() (int, error) {
	c, err := r.peek()
	if err != nil {
		return 0, err
	}
	n, ok, err := r.readLen(c, msgpcode.FixedMapLow, msgpcode.FixedMapMask, msgpcode.Map16, msgpcode.Map32)
	if !ok {
		return 0, fmt.Errorf("want a map, got code %s", codeName(c))
	}
	if err == nil && n > r.left()/2 {
		err = errShort
	}
	return n, err
}

// readStrBytes reads a str (or, leniently, a bin) and returns its bytes,
// aliasing the input.
func (r *reader) readStrBytes() ([]byte, error) {
	c, err := r.peek()
	if err != nil {
		return nil, err
	}
	var n uint64
	switch {
	case msgpcode.IsFixedString(c):
		r.off++
		n = uint64(c & msgpcode.FixedStrMask)
	case c == msgpcode.Str8 || c == msgpcode.Bin8:
		r.off++
		n, err = r.uintN(1)
	case c == msgpcode.Str16 || c == msgpcode.Bin16:
		r.off++
		n, err = r.uintN(2)
	case c == msgpcode.Str32 || c == msgpcode.Bin32:
		r.off++
		n, err = r.uintN(4)
	default:
		return nil, fmt.Errorf("want a string, got code %s", codeName(c))
	}
	if err != nil {
		return nil, err
	}
	if n > uint64(r.left()) {
		return nil, errShort
	}
	return r.take(int(n))
}

func (r *reader) readString() (string, error) {
	b, err := r.readStrBytes()
	return string(b), err
}

// skip consumes one complete value of any type, nested or not, without
// recursion, and returns its raw bytes.
func (r *reader) skip() ([]byte, error) {
	start := r.off
	pending := 1
	for pending > 0 {
		if pending > r.left() {
			return nil, errShort
		}
		pending--
		c := r.b[r.off] // in range: pending ≤ left above
		// Scalars of a fixed size first: token ids and block hashes, most
		// of an event's elements, take one table load.
		if n := fixedSize[c]; n > 0 {
			if int(n) > r.left() {
				return nil, errShort
			}
			r.off += int(n)
			continue
		}
		switch {
		case msgpcode.IsFixedNum(c), c == msgpcode.Nil, c == msgpcode.False, c == msgpcode.True:
			r.off++
		case isArray(c):
			n, err := r.readArrayLen()
			if err != nil {
				return nil, err
			}
			pending += n
		case isMap(c):
			n, err := r.readMapLen()
			if err != nil {
				return nil, err
			}
			pending += 2 * n
		case msgpcode.IsString(c) || msgpcode.IsBin(c):
			if _, err := r.readStrBytes(); err != nil {
				return nil, err
			}
		default:
			r.off++
			var n uint64
			switch c {
			case msgpcode.Uint8, msgpcode.Int8:
				n = 1
			case msgpcode.Uint16, msgpcode.Int16:
				n = 2
			case msgpcode.Uint32, msgpcode.Int32, msgpcode.Float:
				n = 4
			case msgpcode.Uint64, msgpcode.Int64, msgpcode.Double:
				n = 8
			case msgpcode.FixExt1, msgpcode.FixExt2, msgpcode.FixExt4, msgpcode.FixExt8, msgpcode.FixExt16:
				n = 1 + 1<<(c-msgpcode.FixExt1) // type byte + data
			case msgpcode.Ext8, msgpcode.Ext16, msgpcode.Ext32:
				w := 1 << (c - msgpcode.Ext8) // 1, 2, 4 length bytes
				l, err := r.uintN(w)
				if err != nil {
					return nil, err
				}
				n = l + 1
			default: // 0xc1, never used
				return nil, fmt.Errorf("invalid msgpack code %s", codeName(c))
			}
			if n > uint64(r.left()) {
				return nil, errShort
			}
			r.off += int(n)
		}
	}
	return r.b[start:r.off:r.off], nil
}

// fixedSize is the encoded size of every msgpack value whose size its first
// byte fixes (ints, floats, nil, booleans, fixext), and 0 for the others.
var fixedSize = func() (t [256]uint8) {
	for c := 0x00; c <= 0x7f; c++ {
		t[c] = 1 // positive fixint
	}
	for c := 0xe0; c <= 0xff; c++ {
		t[c] = 1 // negative fixint
	}
	for c, n := range map[byte]uint8{
		msgpcode.Nil: 1, msgpcode.False: 1, msgpcode.True: 1,
		msgpcode.Uint8: 2, msgpcode.Int8: 2, msgpcode.Uint16: 3, msgpcode.Int16: 3,
		msgpcode.Uint32: 5, msgpcode.Int32: 5, msgpcode.Float: 5,
		msgpcode.Uint64: 9, msgpcode.Int64: 9, msgpcode.Double: 9,
		msgpcode.FixExt1: 3, msgpcode.FixExt2: 4, msgpcode.FixExt4: 6, msgpcode.FixExt8: 10, msgpcode.FixExt16: 18,
	} {
		t[c] = n
	}
	return t
}()
