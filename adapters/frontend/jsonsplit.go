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
func skipValue(b []byte, i int) (int, error) { return skip(b, i, true) }

// skip is skipValue; check validates small nested values and numbers,
// which input already known to be valid JSON does without.
func skip(b []byte, i int, check bool) (int, error) {
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
					if check && len(b[i:j+1]) < 4096 && !json.Valid(b[i:j+1]) {
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
	if j == i || check && !json.Valid(b[i:j]) {
		return 0, errNotObject
	}
	return j, nil
}

// members walks the members of a valid JSON object without decoding or
// checking them;
// key is raw (escapes left as they are).
type members struct {
	b        []byte
	i        int
	started  bool
	object   bool // b is an object
	key, val []byte
	err      error
}

func (m *members) next() bool {
	if m.err != nil {
		return false
	}
	if !m.started {
		m.started = true
		m.i = skipSpace(m.b, 0)
		if m.i >= len(m.b) || m.b[m.i] != '{' {
			return false
		}
		m.object = true
		m.i = skipSpace(m.b, m.i+1)
	} else {
		if m.i >= len(m.b) || m.b[m.i] != ',' {
			return false
		}
		m.i = skipSpace(m.b, m.i+1)
	}
	if m.i >= len(m.b) || m.b[m.i] != '"' {
		return false
	}
	end, err := skipString(m.b, m.i)
	if err != nil {
		m.err = err
		return false
	}
	m.key = m.b[m.i+1 : end-1]
	m.i = skipSpace(m.b, end)
	if m.i >= len(m.b) || m.b[m.i] != ':' {
		m.err = errNotObject
		return false
	}
	m.i = skipSpace(m.b, m.i+1)
	vend, err := skip(m.b, m.i, false)
	if err != nil {
		m.err = err
		return false
	}
	m.val = m.b[m.i:vend]
	m.i = skipSpace(m.b, vend)
	return true
}

// elements walks the elements of a valid JSON array without decoding them.
type elements struct {
	b       []byte
	i       int
	started bool
	val     []byte
}

func (e *elements) next() bool {
	if !e.started {
		e.started = true
		e.i = skipSpace(e.b, 0)
		if e.i >= len(e.b) || e.b[e.i] != '[' {
			return false
		}
		e.i = skipSpace(e.b, e.i+1)
		if e.i < len(e.b) && e.b[e.i] == ']' {
			return false
		}
	} else {
		if e.i >= len(e.b) || e.b[e.i] != ',' {
			return false
		}
		e.i = skipSpace(e.b, e.i+1)
	}
	end, err := skip(e.b, e.i, false)
	if err != nil {
		return false
	}
	e.val = e.b[e.i:end]
	e.i = skipSpace(e.b, end)
	return true
}
