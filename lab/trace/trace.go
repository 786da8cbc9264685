// Package trace loads the Mooncake request traces (JSON lines of timestamp,
// input_length, output_length and hash_ids) and turns them into the token
// ids and block hashes a router would see.
//
// Each hash id stands for one 512-token block of content; equal ids mean
// equal content. A request's prompt is the concatenation of its ids' blocks,
// the last one cut to input_length. Token ids are synthesised
// deterministically from the id (a splitmix64 stream, tokens in [0, Vocab)),
// so any two runs, machines or components agree on them.
//
// Copies: to scale a trace over many disjoint worker groups, copy k of a
// trace maps every id into its own id space (ContentID), so the content, and
// therefore every block hash, of copy k never coincides with copy 0's.
package trace

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/bits"
	"os"
)

// BlockTokens is the number of tokens one hash id stands for.
const BlockTokens = 512

// Vocab bounds the synthesised token ids: every token is in [0, Vocab).
const Vocab = 128000

// MaxID is the largest hash id a trace may hold: ids live in the low 40
// bits of a content id, the copy number in the bits above.
const MaxID = 1<<40 - 1

// MaxCopies bounds the copy number.
const MaxCopies = 1 << 24

// Request is one line of a trace.
type Request struct {
	// Timestamp is the arrival time in milliseconds from the trace start.
	Timestamp    int64
	InputLength  int
	OutputLength int
	// HashIDs are the content ids of the prompt's 512-token blocks;
	// len(HashIDs) = ceil(InputLength / 512).
	HashIDs []uint64
	// idx are HashIDs as dense indices into Trace.IDs.
	idx []uint32
}

// DenseIDs are HashIDs as indices into the loaded trace's IDs; nil for a
// request that was not read by Load or Parse.
func (r *Request) DenseIDs() []uint32 { return r.idx }

// Blocks is the number of full blocks of blockSize tokens in the prompt.
func (r *Request) Blocks(blockSize int) int { return r.InputLength / blockSize }

// Tokens returns the prompt's token ids in copy c of the trace.
func (r *Request) Tokens(c int) []uint32 {
	return r.AppendTokens(make([]uint32, 0, len(r.HashIDs)*BlockTokens), c)
}

// AppendTokens appends the prompt Tokens returns to dst: with room for
// len(HashIDs) whole blocks in dst, nothing is reallocated.
func (r *Request) AppendTokens(dst []uint32, c int) []uint32 { return r.AppendTokensFrom(dst, c, 0) }

// AppendTokensFrom is AppendTokens writing the tokens of the blocks from
// block skip on only: the room of the first skip blocks holds whatever
// dst's memory held, for a caller that knows nothing reads them.
func (r *Request) AppendTokensFrom(dst []uint32, c, skip int) []uint32 {
	n := len(dst)
	skip = min(max(skip, 0), len(r.HashIDs))
	if room := skip * BlockTokens; cap(dst)-n >= room {
		dst = dst[:n+room]
	} else {
		dst = append(dst, make([]uint32, room)...)
	}
	for _, id := range r.HashIDs[skip:] {
		dst = AppendBlockTokens(dst, ContentID(id, c))
	}
	return dst[:n+r.InputLength]
}

// Trace is a loaded trace.
type Trace struct {
	Requests []Request
	// IDs are the distinct hash ids in order of first appearance; a request's
	// dense index i names IDs[i].
	IDs []uint64
}

type line struct {
	Timestamp    *int64    `json:"timestamp"`
	InputLength  *int      `json:"input_length"`
	OutputLength *int      `json:"output_length"`
	HashIDs      *[]uint64 `json:"hash_ids"`
}

// Load reads a trace file.
func Load(path string) (*Trace, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	tr, err := Parse(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return tr, nil
}

// ErrBadLine wraps every error about the content of a trace line.
var ErrBadLine = errors.New("bad trace line")

// Parse reads a trace in JSON lines. Blank lines are skipped. Every field is
// required, and len(hash_ids) must be ceil(input_length/512); a line that
// breaks a rule fails the whole parse with its line number.
func Parse(r io.Reader) (*Trace, error) { return ParseSkipping(r, nil) }

// ParseSkipping is Parse that, when skip is not nil, hands each malformed
// line to skip (its 1-based number and what is wrong with it) and goes on
// without it: one bad line of a long production trace should not void the
// rest. With skip nil the first bad line fails the parse.
func ParseSkipping(r io.Reader, skip func(line int, err error)) (*Trace, error) {
	tr := &Trace{}
	var dense denseIDs
	var ids idArena
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 64<<20)
	n := 0
	for sc.Scan() {
		n++
		b := bytes.TrimSpace(sc.Bytes())
		if len(b) == 0 {
			continue
		}
		req, err := parseLine(b, &ids)
		if err != nil {
			err = fmt.Errorf("line %d: %w: %v", n, ErrBadLine, err)
			if skip == nil {
				return nil, err
			}
			skip(n, err)
			continue
		}
		tr.add(req, &dense)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("line %d: %w", n+1, err)
	}
	return tr, nil
}

// add appends req, giving its ids dense indices; dense maps the ids seen so
// far to theirs.
func (tr *Trace) add(req Request, dense *denseIDs) {
	req.idx = dense.idx.take(len(req.HashIDs))
	for i, id := range req.HashIDs {
		d, ok := dense.get(id)
		if !ok {
			d = uint32(len(tr.IDs))
			dense.put(id, d)
			tr.IDs = append(tr.IDs, id)
		}
		req.idx[i] = d
	}
	tr.Requests = append(tr.Requests, req)
}

// denseIDs maps hash ids to dense indices. Traces number their ids from 0
// in order of first appearance, so most ids index a slice; a map holds the
// ones too large for it. Growing a map of a trace's 180,000 ids took as long
// as parsing the trace's JSON.
type denseIDs struct {
	small []uint32 // index+1 of id, 0 for none
	large map[uint64]uint32
	idx   arena[uint32]
}

// denseSlack bounds the slice: ids up to 4 times the count seen so far,
// plus this, index it.
const denseSlack = 1 << 16

func (m *denseIDs) get(id uint64) (uint32, bool) {
	if id < uint64(len(m.small)) && m.small[id] != 0 {
		return m.small[id] - 1, true
	}
	d, ok := m.large[id]
	return d, ok
}

// put records a new id's index d (ids get consecutive indices from 0).
func (m *denseIDs) put(id uint64, d uint32) {
	if id >= uint64(len(m.small)) && id < 4*uint64(d)+denseSlack {
		m.small = append(m.small, make([]uint32, int(id)+1-len(m.small))...)
		m.small = m.small[:cap(m.small)]
	}
	if id < uint64(len(m.small)) {
		m.small[id] = d + 1
		return
	}
	if m.large == nil {
		m.large = make(map[uint64]uint32)
	}
	m.large[id] = d
}

// arena hands out slices of one large backing array, capped to their
// length, so that a trace's many short slices cost one allocation per chunk.
type arena[T any] struct{ free []T }

const arenaChunk = 1 << 12

func (a *arena[T]) take(n int) []T {
	if n > len(a.free) {
		a.free = make([]T, max(n, arenaChunk))
	}
	s := a.free[:n:n]
	a.free = a.free[n:]
	return s
}

type idArena = arena[uint64]

// Stretch returns the trace with every hash id h replaced by the factor ids
// h·factor … h·factor+factor-1, and every prompt lengthened to match (its
// last block keeps its cut): requests that shared a k-block prefix share a
// k·factor-block prefix, so the prefix tree keeps its shape with deeper
// chains. This is how Dynamo's indexer benchmarks lengthen a trace
// (--trace-length-factor). A factor of 1 returns tr itself.
func (tr *Trace) Stretch(factor int) (*Trace, error) {
	if factor < 1 {
		return nil, fmt.Errorf("trace: length factor %d below 1", factor)
	}
	if factor == 1 {
		return tr, nil
	}
	f := uint64(factor)
	out := &Trace{Requests: make([]Request, 0, len(tr.Requests))}
	var dense denseIDs
	for _, r := range tr.Requests {
		ids := make([]uint64, 0, len(r.HashIDs)*factor)
		for _, id := range r.HashIDs {
			if id > (MaxID-(f-1))/f {
				return nil, fmt.Errorf("trace: hash id %d times length factor %d exceeds %d", id, factor, uint64(MaxID))
			}
			for j := range f {
				ids = append(ids, id*f+j)
			}
		}
		r.HashIDs = ids
		r.InputLength += (factor - 1) * (len(ids) / factor) * BlockTokens
		out.add(r, &dense)
	}
	return out, nil
}

func parseLine(b []byte, ids *idArena) (Request, error) {
	req, ok := scanLine(b, ids)
	if !ok {
		var err error
		if req, err = decodeLine(b); err != nil {
			return Request{}, err
		}
	}
	return validate(req)
}

// validate holds a parsed line to the trace's rules.
func validate(req Request) (Request, error) {
	if req.Timestamp < 0 {
		return Request{}, fmt.Errorf("negative timestamp %d", req.Timestamp)
	}
	if req.InputLength <= 0 {
		return Request{}, fmt.Errorf("input_length %d is not positive", req.InputLength)
	}
	if req.OutputLength < 0 {
		return Request{}, fmt.Errorf("negative output_length %d", req.OutputLength)
	}
	if want := (req.InputLength + BlockTokens - 1) / BlockTokens; len(req.HashIDs) != want {
		return Request{}, fmt.Errorf("%d hash_ids for input_length %d, want ceil(%d/%d) = %d",
			len(req.HashIDs), req.InputLength, req.InputLength, BlockTokens, want)
	}
	for _, id := range req.HashIDs {
		if id > MaxID {
			return Request{}, fmt.Errorf("hash id %d exceeds %d", id, uint64(MaxID))
		}
	}
	return req, nil
}

// decodeLine parses a line with encoding/json: the lines scanLine leaves,
// which it holds to JSON's every rule (and names the first broken one).
func decodeLine(b []byte) (Request, error) {
	var l line
	dec := json.NewDecoder(bytes.NewReader(b))
	if err := dec.Decode(&l); err != nil {
		return Request{}, err
	}
	if dec.More() {
		return Request{}, errors.New("trailing data after the JSON object")
	}
	switch {
	case l.Timestamp == nil:
		return Request{}, errors.New("missing timestamp")
	case l.InputLength == nil:
		return Request{}, errors.New("missing input_length")
	case l.OutputLength == nil:
		return Request{}, errors.New("missing output_length")
	case l.HashIDs == nil:
		return Request{}, errors.New("missing hash_ids")
	}
	return Request{Timestamp: *l.Timestamp, InputLength: *l.InputLength, OutputLength: *l.OutputLength, HashIDs: *l.HashIDs}, nil
}

// scanLine reads the lines traces are made of, an object of the four
// fields, each once, with integer values, without encoding/json (which
// took most of a trace's loading). Anything else, unknown keys, escapes,
// null, floats, leading zeros, numbers out of range, is not ok and goes to
// decodeLine, so that both accept and reject the same lines alike.
func scanLine(b []byte, ids *idArena) (req Request, ok bool) {
	s := lineScanner{b: b}
	if !s.byte('{') {
		return Request{}, false
	}
	var seen uint8
	for {
		key, ok := s.key()
		if !ok {
			return Request{}, false
		}
		switch string(key) {
		case "timestamp":
			req.Timestamp, ok = s.int(), seen&1 == 0
			seen |= 1
		case "input_length":
			req.InputLength, ok = s.intOfSize(), seen&2 == 0
			seen |= 2
		case "output_length":
			req.OutputLength, ok = s.intOfSize(), seen&4 == 0
			seen |= 4
		case "hash_ids":
			req.HashIDs, ok = s.uints(ids), seen&8 == 0
			seen |= 8
		default:
			return Request{}, false
		}
		if !ok || s.bad {
			return Request{}, false
		}
		if s.byte('}') {
			break
		}
		if !s.byte(',') {
			return Request{}, false
		}
	}
	s.space()
	return req, seen == 15 && s.i == len(b) && !s.bad
}

// lineScanner walks a line; bad records any malformed token.
type lineScanner struct {
	b   []byte
	i   int
	bad bool
}

func (s *lineScanner) space() {
	for s.i < len(s.b) {
		switch s.b[s.i] {
		case ' ', '\t', '\n', '\r':
			s.i++
		default:
			return
		}
	}
}

// byte skips white space and then c, if c is next.
func (s *lineScanner) byte(c byte) bool {
	s.space()
	if s.i < len(s.b) && s.b[s.i] == c {
		s.i++
		return true
	}
	return false
}

// key reads `"name":`, a name of lower-case letters and underscores.
func (s *lineScanner) key() ([]byte, bool) {
	if !s.byte('"') {
		return nil, false
	}
	start := s.i
	for s.i < len(s.b) && (s.b[s.i] >= 'a' && s.b[s.i] <= 'z' || s.b[s.i] == '_') {
		s.i++
	}
	end := s.i
	if !s.byte('"') || !s.byte(':') {
		return nil, false
	}
	return s.b[start:end], true
}

// digits reads a JSON integer's digits: 0, or a non-zero digit and more.
func (s *lineScanner) digits() []byte {
	start := s.i
	for s.i < len(s.b) && s.b[s.i] >= '0' && s.b[s.i] <= '9' {
		s.i++
	}
	d := s.b[start:s.i]
	if len(d) == 0 || len(d) > 1 && d[0] == '0' {
		s.bad = true
	}
	// A fraction or exponent makes it no integer of this grammar.
	if s.i < len(s.b) && (s.b[s.i] == '.' || s.b[s.i] == 'e' || s.b[s.i] == 'E') {
		s.bad = true
	}
	return d
}

func (s *lineScanner) int() int64 {
	s.space()
	neg := s.i < len(s.b) && s.b[s.i] == '-'
	if neg {
		s.i++
	}
	var v uint64
	for _, c := range s.digits() {
		if v > (math.MaxInt64+1)/10 {
			s.bad = true
			return 0
		}
		v = v*10 + uint64(c-'0')
	}
	if neg && v > math.MaxInt64+1 || !neg && v > math.MaxInt64 {
		s.bad = true
		return 0
	}
	if neg {
		return -int64(v)
	}
	return int64(v)
}

// intOfSize reads an int, which is 32 bits wide on some platforms.
func (s *lineScanner) intOfSize() int {
	v := s.int()
	if int64(int(v)) != v {
		s.bad = true
	}
	return int(v)
}

func (s *lineScanner) uint() uint64 {
	s.space()
	var v uint64
	for _, c := range s.digits() {
		hi, lo := bits.Mul64(v, 10)
		lo, carry := bits.Add64(lo, uint64(c-'0'), 0)
		if hi != 0 || carry != 0 {
			s.bad = true
			return 0
		}
		v = lo
	}
	return v
}

// uints reads an array of unsigned integers into ids' room.
func (s *lineScanner) uints(ids *idArena) []uint64 {
	if !s.byte('[') {
		s.bad = true
		return nil
	}
	start := s.i
	n := 0
	if !s.byte(']') {
		// Count first, so that the ids land in the arena in one piece.
		for !s.bad {
			s.uint()
			n++
			if s.byte(']') {
				break
			}
			if !s.byte(',') {
				s.bad = true
			}
		}
	}
	if s.bad {
		return nil
	}
	out := ids.take(n)
	s.i = start
	for i := range out {
		out[i] = s.uint()
		s.byte(',')
	}
	s.byte(']')
	return out
}

// ContentID is the id that hash id stands for in copy c: copy 0 is the
// trace itself, copy c ≥ 1 lives in its own id space, disjoint from every
// other copy's. c must be in [0, MaxCopies) and id ≤ MaxID.
func ContentID(id uint64, c int) uint64 {
	if c < 0 || c >= MaxCopies {
		panic(fmt.Sprintf("trace: copy %d out of range", c))
	}
	return uint64(c)<<40 | id&MaxID
}

// splitmix64 increment and finaliser.
const golden = 0x9e3779b97f4a7c15

func mix64(z uint64) uint64 {
	z = (z ^ z>>30) * 0xbf58476d1ce4e5b9
	z = (z ^ z>>27) * 0x94d049bb133111eb
	return z ^ z>>31
}

// AppendBlockTokens appends the 512 token ids of content id cid (see
// ContentID) to dst. The tokens are a splitmix64 stream seeded by cid, each
// 64-bit output giving two tokens scaled into [0, Vocab).
func AppendBlockTokens(dst []uint32, cid uint64) []uint32 {
	n := len(dst)
	if cap(dst)-n >= BlockTokens {
		// Every token is written below: clearing the room first cost
		// as much as generating the tokens.
		dst = dst[:n+BlockTokens]
	} else {
		dst = append(dst, make([]uint32, BlockTokens)...)
	}
	blockTokens((*[BlockTokens]uint32)(dst[n:]), cid)
	return dst
}

// tokenSeed separates a content id's token stream from the id itself.
const tokenSeed = 0x6a09e667f3bcc909

// blockTokensGeneric is blockTokens in Go: pair k of the tokens is mixed
// from mix64(cid^tokenSeed) + (k+1)·golden.
func blockTokensGeneric(out *[BlockTokens]uint32, cid uint64) {
	s := mix64(cid ^ tokenSeed)
	for i := 0; i < BlockTokens; i += 2 {
		s += golden
		z := mix64(s)
		out[i] = uint32((z & 0xffffffff) * Vocab >> 32)
		out[i+1] = uint32((z >> 32) * Vocab >> 32)
	}
}
