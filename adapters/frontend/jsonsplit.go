package frontend

import (
	"encoding/json"
	"errors"
)

var errNotObject = errors.New("not a JSON object")

// splitObject cuts a JSON object into its members in one pass, without
// decoding values: a request body is mostly its prompt (50 kB of token ids
// for an 8k prompt), which encoding/json would scan twice to hand back as
// raw bytes. Structure is checked (strings, brackets, separators); the
// values the frontend reads are decoded properly afterwards, and the rest
// go to the engine, which validates them.
func splitObject(b []byte) (map[string]json.RawMessage, error) {
	ms, err := objectMembers(b)
	if err != nil {
		return nil, err
	}
	out := make(map[string]json.RawMessage, len(ms))
	for _, m := range ms {
		out[m.key] = m.val
	}
	return out, nil
}

// member is one member of a JSON object and where its bytes are, so that
// the object can be passed on less some members without copying the rest.
type member struct {
	key        string
	val        json.RawMessage
	start, end int // the object's bytes [start, end) hold `"key": value`
}

// objectMembers cuts a JSON object into its members, in their order.
func objectMembers(b []byte) ([]member, error) {
	i := skipSpace(b, 0)
	if i >= len(b) || b[i] != '{' {
		return nil, errNotObject
	}
	out := make([]member, 0, 8)
	i = skipSpace(b, i+1)
	if i < len(b) && b[i] == '}' {
		if skipSpace(b, i+1) != len(b) {
			return nil, errNotObject
		}
		return out, nil
	}
	for {
		if i >= len(b) || b[i] != '"' {
			return nil, errNotObject
		}
		start := i
		end, err := skipString(b, i)
		if err != nil {
			return nil, err
		}
		var key string
		if err := json.Unmarshal(b[i:end], &key); err != nil {
			return nil, err
		}
		i = skipSpace(b, end)
		if i >= len(b) || b[i] != ':' {
			return nil, errNotObject
		}
		i = skipSpace(b, i+1)
		vend, err := skipValue(b, i)
		if err != nil {
			return nil, err
		}
		out = append(out, member{key: key, val: json.RawMessage(b[i:vend]), start: start, end: vend})
		i = skipSpace(b, vend)
		if i >= len(b) {
			return nil, errNotObject
		}
		switch b[i] {
		case ',':
			i = skipSpace(b, i+1)
		case '}':
			if skipSpace(b, i+1) != len(b) {
				return nil, errNotObject
			}
			return out, nil
		default:
			return nil, errNotObject
		}
	}
}

// skipString returns the index just past the string starting at b[i].
func skipString(b []byte, i int) (int, error) {
	for j := i + 1; j < len(b); j++ {
		switch b[j] {
		case '\\':
			j++
		case '"':
			return j + 1, nil
		}
	}
	return 0, errNotObject
}

// skipValue returns the index just past the value starting at b[i].
func skipValue(b []byte, i int) (int, error) {
	if i >= len(b) {
		return 0, errNotObject
	}
	switch b[i] {
	case '"':
		return skipString(b, i)
	case '{', '[':
		depth := 0
		for j := i; j < len(b); j++ {
			switch b[j] {
			case '"':
				end, err := skipString(b, j)
				if err != nil {
					return 0, err
				}
				j = end - 1
			case '{', '[':
				depth++
			case '}', ']':
				if depth--; depth == 0 {
					if !json.Valid(b[i:j+1]) && len(b[i:j+1]) < 4096 {
						// Small nested values are checked whole; a large one
						// is a prompt, decoded right after.
						return 0, errNotObject
					}
					return j + 1, nil
				}
			}
		}
		return 0, errNotObject
	}
	j := i
	for j < len(b) && (b[j] >= 'a' && b[j] <= 'z' || b[j] >= '0' && b[j] <= '9' || b[j] == '-' || b[j] == '+' || b[j] == '.' || b[j] == 'E') {
		j++
	}
	if j == i || !json.Valid(b[i:j]) {
		return 0, errNotObject
	}
	return j, nil
}
