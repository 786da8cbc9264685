package kv

import (
	"encoding/json"
	"fmt"
	"strconv"
)

// The event plane carries every KV event as JSON, hundreds of thousands per
// second into one router, and encoding/json's reflection (four passes per
// event, through maps and raw messages) made it the plane's ceiling. The
// shape is fixed, so both directions are written out here.

// MarshalJSON writes the event in the plane's JSON shape.
func (e Event) MarshalJSON() ([]byte, error) { return e.AppendJSON(nil) }

// AppendJSON appends the event in the plane's JSON shape to dst.
func (e Event) AppendJSON(dst []byte) ([]byte, error) {
	tier := e.Tier
	if tier == "" {
		tier = TierDevice
	}
	dst = append(dst, `{"worker_id":`...)
	dst = strconv.AppendUint(dst, e.Worker.ID, 10)
	dst = append(dst, `,"storage_tier":`...)
	dst = appendString(dst, string(tier))
	dst = append(dst, `,"event":{"event_id":`...)
	dst = strconv.AppendUint(dst, e.EventID, 10)
	dst = append(dst, `,"dp_rank":`...)
	dst = strconv.AppendUint(dst, uint64(e.Worker.DPRank), 10)
	dst = append(dst, `,"data":`...)
	switch e.Kind {
	case KindStored:
		dst = append(dst, `{"stored":{"parent_hash":`...)
		dst = appendOptUint(dst, e.Stored.Parent)
		dst = append(dst, `,"start_position":`...)
		if p := e.Stored.StartPosition; p != nil {
			dst = strconv.AppendUint(dst, uint64(*p), 10)
		} else {
			dst = append(dst, "null"...)
		}
		dst = append(dst, `,"blocks":[`...)
		for i, b := range e.Stored.Blocks {
			if i > 0 {
				dst = append(dst, ',')
			}
			dst = append(dst, `{"block_hash":`...)
			dst = strconv.AppendUint(dst, b.EngineHash, 10)
			dst = append(dst, `,"tokens_hash":`...)
			dst = strconv.AppendUint(dst, b.LocalHash, 10)
			dst = append(dst, '}')
		}
		dst = append(dst, "]}}"...)
	case KindRemoved:
		dst = append(dst, `{"removed":{"block_hashes":[`...)
		for i, h := range e.Removed.EngineHashes {
			if i > 0 {
				dst = append(dst, ',')
			}
			dst = strconv.AppendUint(dst, h, 10)
		}
		dst = append(dst, "]}}"...)
	case KindCleared:
		dst = append(dst, `"cleared"`...)
	default:
		return nil, fmt.Errorf("kv: cannot encode event of kind %d", e.Kind)
	}
	return append(dst, "}}"...), nil
}

func appendOptUint(dst []byte, v *uint64) []byte {
	if v == nil {
		return append(dst, "null"...)
	}
	return strconv.AppendUint(dst, *v, 10)
}

// appendString writes s as a JSON string; tiers are plain words, anything
// else is left to encoding/json's escaping.
func appendString(dst []byte, s string) []byte {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c >= 0x7f || c == '"' || c == '\\' || c == '<' || c == '>' || c == '&' {
			b, _ := json.Marshal(s)
			return append(dst, b...)
		}
	}
	dst = append(dst, '"')
	dst = append(dst, s...)
	return append(dst, '"')
}

// scanner is the single-pass decoder. Every method reports failure rather
// than an error: on failure the caller falls back to encoding/json.
type scanner struct {
	b []byte
	i int
}

func (s *scanner) ws() {
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case ' ', '\t', '\n', '\r':
			s.i++
		default:
			return
		}
	}
}

func (s *scanner) peek() byte {
	s.ws()
	if s.i < len(s.b) {
		return s.b[s.i]
	}
	return 0
}

func (s *scanner) eat(c byte) bool {
	if s.peek() == c {
		s.i++
		return true
	}
	return false
}

func (s *scanner) lit(word string) bool {
	s.ws()
	if len(s.b)-s.i >= len(word) && string(s.b[s.i:s.i+len(word)]) == word {
		s.i += len(word)
		return true
	}
	return false
}

// str reads a string without escapes (keys and tiers never have any); the
// bytes alias the input.
func (s *scanner) str() ([]byte, bool) {
	if !s.eat('"') {
		return nil, false
	}
	start := s.i
	for s.i < len(s.b) {
		switch c := s.b[s.i]; {
		case c == '"':
			s.i++
			return s.b[start : s.i-1], true
		case c == '\\' || c < 0x20 || c >= 0x80:
			return nil, false
		}
		s.i++
	}
	return nil, false
}

func (s *scanner) uint(bits int) (uint64, bool) {
	s.ws()
	start := s.i
	for s.i < len(s.b) && s.b[s.i] >= '0' && s.b[s.i] <= '9' {
		s.i++
	}
	n := s.i - start
	if n == 0 || n > 1 && s.b[start] == '0' {
		return 0, false
	}
	if s.i < len(s.b) {
		if c := s.b[s.i]; c == '.' || c == 'e' || c == 'E' {
			return 0, false
		}
	}
	v, err := strconv.ParseUint(string(s.b[start:s.i]), 10, bits)
	return v, err == nil
}

// object calls field for each key of an object; field reports whether it
// read the value.
func (s *scanner) object(field func(key []byte) bool) bool {
	if !s.eat('{') {
		return false
	}
	if s.eat('}') {
		return true
	}
	for {
		key, ok := s.str()
		if !ok || !s.eat(':') || !field(key) {
			return false
		}
		if s.eat('}') {
			return true
		}
		if !s.eat(',') {
			return false
		}
	}
}

// array calls elem for each element; a null array is empty.
func (s *scanner) array(elem func() bool) (isNull, ok bool) {
	if s.lit("null") {
		return true, true
	}
	if !s.eat('[') {
		return false, false
	}
	if s.eat(']') {
		return false, true
	}
	for {
		if !elem() {
			return false, false
		}
		if s.eat(']') {
			return false, true
		}
		if !s.eat(',') {
			return false, false
		}
	}
}

func decodeFast(b []byte) (Event, bool) {
	s := scanner{b: b}
	ev := Event{Tier: TierDevice}
	var sawData bool
	ok := s.object(func(key []byte) bool {
		switch string(key) {
		case "worker_id":
			v, ok := s.uint(64)
			ev.Worker.ID = v
			return ok
		case "storage_tier":
			if s.lit("null") {
				ev.Tier = TierDevice
				return true
			}
			t, ok := s.str()
			if ok {
				ev.Tier = tierOf(t)
			}
			return ok
		case "event":
			return s.object(func(key []byte) bool {
				switch string(key) {
				case "event_id":
					v, ok := s.uint(64)
					ev.EventID = v
					return ok
				case "dp_rank":
					v, ok := s.uint(32)
					ev.Worker.DPRank = uint32(v)
					return ok
				case "data":
					sawData = true
					return s.data(&ev)
				}
				return false
			})
		}
		return false
	})
	if !ok || !sawData || s.peek() != 0 || s.i != len(s.b) {
		return Event{}, false
	}
	return ev, true
}

func (s *scanner) data(ev *Event) bool {
	ev.Kind, ev.Stored, ev.Removed = 0, Stored{}, Removed{}
	if s.peek() == '"' {
		w, ok := s.str()
		if !ok || string(w) != "cleared" {
			return false
		}
		ev.Kind = KindCleared
		return true
	}
	keys := 0
	ok := s.object(func(key []byte) bool {
		keys++
		switch string(key) {
		case "stored":
			ev.Kind = KindStored
			return s.object(func(key []byte) bool {
				switch string(key) {
				case "parent_hash":
					if s.lit("null") {
						ev.Stored.Parent = nil
						return true
					}
					v, ok := s.uint(64)
					ev.Stored.Parent = &v
					return ok
				case "start_position":
					if s.lit("null") {
						ev.Stored.StartPosition = nil
						return true
					}
					v, ok := s.uint(32)
					p := uint32(v)
					ev.Stored.StartPosition = &p
					return ok
				case "blocks":
					blocks := make([]Block, 0, 16)
					isNull, ok := s.array(func() bool {
						var blk Block
						ok := s.object(func(key []byte) bool {
							var ok bool
							switch string(key) {
							case "block_hash":
								blk.EngineHash, ok = s.uint(64)
							case "tokens_hash":
								blk.LocalHash, ok = s.uint(64)
							}
							return ok
						})
						blocks = append(blocks, blk)
						return ok
					})
					if isNull {
						blocks = nil
					}
					ev.Stored.Blocks = blocks
					return ok
				}
				return false
			})
		case "removed":
			ev.Kind = KindRemoved
			return s.object(func(key []byte) bool {
				if string(key) != "block_hashes" {
					return false
				}
				hashes := make([]uint64, 0, 8)
				isNull, ok := s.array(func() bool {
					v, ok := s.uint(64)
					hashes = append(hashes, v)
					return ok
				})
				if isNull {
					hashes = nil
				}
				ev.Removed.EngineHashes = hashes
				return ok
			})
		}
		return false
	})
	return ok && keys == 1
}

// tierOf spares the usual tiers an allocation.
func tierOf(b []byte) StorageTier {
	switch string(b) {
	case "", string(TierDevice):
		return TierDevice
	case string(TierHostPinned):
		return TierHostPinned
	case string(TierDisk):
		return TierDisk
	case string(TierExternal):
		return TierExternal
	}
	return StorageTier(b)
}
