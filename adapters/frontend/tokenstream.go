package frontend

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"strings"
	"sync"
)

// decodeTokenList reads an engine's /tokenize answer, {"tokens": [ids],
// ...}, as it arrives, the ids straight into the list: the answer is about
// as large as the prompt, and reading it whole first doubled what a large
// prompt cost. Members other than "tokens" are skipped, not checked.
func decodeTokenList(r io.Reader) ([]uint32, error) {
	br := tokenReaders.Get().(*bufio.Reader)
	br.Reset(r)
	defer func() {
		br.Reset(nil) // the pool must not keep the engine's body alive
		tokenReaders.Put(br)
	}()
	d := tokenDecoder{r: br}
	if c, err := d.nonSpace(); err != nil || c != '{' {
		return nil, errors.New("the answer is not a JSON object")
	}
	var ids []uint32
	found := false
	for {
		c, err := d.nonSpace()
		if err != nil {
			return nil, err
		}
		if c == '}' && !found {
			break
		}
		if c != '"' {
			return nil, fmt.Errorf("unexpected %q where a key was due", c)
		}
		key, err := d.key()
		if err != nil {
			return nil, err
		}
		if c, err := d.nonSpace(); err != nil || c != ':' {
			return nil, errors.New("a key without a value")
		}
		// Keys match without regard to case, as encoding/json (and the
		// decoding this replaced) matches them.
		if strings.EqualFold(key, "tokens") {
			if ids, err = d.ids(); err != nil {
				return nil, err
			}
			found = true
		} else if err := d.skipValue(); err != nil {
			return nil, err
		}
		c, err = d.nonSpace()
		switch {
		case err != nil:
			return nil, err
		case c == '}':
			if !found {
				return nil, errors.New("no token list")
			}
			return ids, nil
		case c != ',':
			return nil, fmt.Errorf("unexpected %q after a value", c)
		}
	}
	return nil, errors.New("no token list")
}

// tokenReaders recycles decodeTokenList's buffers: a fresh 32 KiB one per
// answer cost more than decoding a short answer does.
var tokenReaders = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, 32<<10) }}

type tokenDecoder struct{ r *bufio.Reader }

func (d *tokenDecoder) nonSpace() (byte, error) {
	for {
		c, err := d.r.ReadByte()
		if err != nil {
			if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			return 0, err
		}
		if !isSpace(c) {
			return c, nil
		}
	}
}

// key reads the rest of a key whose opening quote was read.
func (d *tokenDecoder) key() (string, error) {
	raw := []byte{'"'}
	for {
		c, err := d.r.ReadByte()
		if err != nil {
			return "", io.ErrUnexpectedEOF
		}
		raw = append(raw, c)
		switch c {
		case '\\':
			c, err = d.r.ReadByte()
			if err != nil {
				return "", io.ErrUnexpectedEOF
			}
			raw = append(raw, c)
		case '"':
			var k string
			if err := json.Unmarshal(raw, &k); err != nil {
				return "", err
			}
			return k, nil
		}
	}
}

// idChunk is where ids collect while their count is unknown: the list is
// allocated once, at its size, at the end; growing it by append would copy
// it over and over and leave several times its size behind.
type idChunk [8192]uint32

var idChunks = sync.Pool{New: func() any { return new(idChunk) }}

// pooledChunks is how many chunks one list returns to the pool: 32k ids.
const pooledChunks = 4

// ids reads a list of plain non-negative integers below 2³².
func (d *tokenDecoder) ids() ([]uint32, error) {
	if c, err := d.nonSpace(); err != nil || c != '[' {
		return nil, errors.New("tokens is not a list")
	}
	var chunks []*idChunk
	defer func() {
		// Only a few go back: the pool is for the common prompt, and one
		// huge prompt should not leave megabytes in it.
		for _, ch := range chunks[:min(len(chunks), pooledChunks)] {
			idChunks.Put(ch)
		}
	}()
	n := 0
	add := func(v uint32) {
		if n%len(idChunk{}) == 0 {
			chunks = append(chunks, idChunks.Get().(*idChunk))
		}
		chunks[len(chunks)-1][n%len(idChunk{})] = v
		n++
	}
	collected := func() []uint32 {
		out := make([]uint32, 0, n)
		for i, ch := range chunks {
			out = append(out, ch[:min(len(ch), n-i*len(ch))]...)
		}
		return out
	}
	c, err := d.nonSpace()
	if err != nil {
		return nil, err
	}
	if c == ']' {
		return collected(), nil
	}
	for {
		if c < '0' || c > '9' {
			return nil, fmt.Errorf("token %d is not a non-negative integer", n)
		}
		v := uint64(c - '0')
		for {
			if c, err = d.r.ReadByte(); err != nil {
				return nil, io.ErrUnexpectedEOF
			}
			if c < '0' || c > '9' {
				break
			}
			if v = v*10 + uint64(c-'0'); v > math.MaxUint32 {
				return nil, fmt.Errorf("token %d is beyond 2³²", n)
			}
		}
		add(uint32(v))
		if isSpace(c) {
			if c, err = d.nonSpace(); err != nil {
				return nil, err
			}
		}
		switch c {
		case ']':
			return collected(), nil
		case ',':
			if c, err = d.nonSpace(); err != nil {
				return nil, err
			}
		default:
			return nil, fmt.Errorf("token %d is not a non-negative integer", n-1)
		}
	}
}

// skipValue passes over one value, tracking only strings and nesting.
func (d *tokenDecoder) skipValue() error {
	c, err := d.nonSpace()
	if err != nil {
		return err
	}
	switch c {
	case '"':
		return d.skipString()
	case '{', '[':
		for depth := 1; depth > 0; {
			if c, err = d.r.ReadByte(); err != nil {
				return io.ErrUnexpectedEOF
			}
			switch c {
			case '"':
				if err := d.skipString(); err != nil {
					return err
				}
			case '{', '[':
				depth++
			case '}', ']':
				depth--
			}
		}
		return nil
	}
	// A literal (number, true, false, null) runs to the next separator,
	// which is left for the caller.
	for {
		next, err := d.r.Peek(1)
		if err != nil {
			return io.ErrUnexpectedEOF
		}
		if next[0] == ',' || next[0] == '}' || next[0] == ']' || isSpace(next[0]) {
			return nil
		}
		_, _ = d.r.ReadByte()
	}
}

func (d *tokenDecoder) skipString() error {
	for {
		c, err := d.r.ReadByte()
		if err != nil {
			return io.ErrUnexpectedEOF
		}
		switch c {
		case '\\':
			if _, err := d.r.ReadByte(); err != nil {
				return io.ErrUnexpectedEOF
			}
		case '"':
			return nil
		}
	}
}
