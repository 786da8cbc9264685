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

// Blocks is the number of full blocks of blockSize tokens in the prompt.
func (r *Request) Blocks(blockSize int) int { return r.InputLength / blockSize }

// Tokens returns the prompt's token ids in copy c of the trace.
func (r *Request) Tokens(c int) []uint32 {
	return r.AppendTokens(make([]uint32, 0, len(r.HashIDs)*BlockTokens), c)
}

// AppendTokens appends the prompt Tokens returns to dst: with room for
// len(HashIDs) whole blocks in dst, nothing is reallocated.
func (r *Request) AppendTokens(dst []uint32, c int) []uint32 {
	n := len(dst)
	for _, id := range r.HashIDs {
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
	dense := make(map[uint64]uint32)
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 64<<20)
	n := 0
	for sc.Scan() {
		n++
		b := bytes.TrimSpace(sc.Bytes())
		if len(b) == 0 {
			continue
		}
		req, err := parseLine(b)
		if err != nil {
			err = fmt.Errorf("line %d: %w: %v", n, ErrBadLine, err)
			if skip == nil {
				return nil, err
			}
			skip(n, err)
			continue
		}
		tr.add(req, dense)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("line %d: %w", n+1, err)
	}
	return tr, nil
}

// add appends req, giving its ids dense indices; dense maps the ids seen so
// far to theirs.
func (tr *Trace) add(req Request, dense map[uint64]uint32) {
	req.idx = make([]uint32, len(req.HashIDs))
	for i, id := range req.HashIDs {
		d, ok := dense[id]
		if !ok {
			d = uint32(len(tr.IDs))
			dense[id] = d
			tr.IDs = append(tr.IDs, id)
		}
		req.idx[i] = d
	}
	tr.Requests = append(tr.Requests, req)
}

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
	dense := make(map[uint64]uint32, len(tr.IDs)*factor)
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
		out.add(r, dense)
	}
	return out, nil
}

func parseLine(b []byte) (Request, error) {
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
	req := Request{Timestamp: *l.Timestamp, InputLength: *l.InputLength, OutputLength: *l.OutputLength, HashIDs: *l.HashIDs}
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

func blockTokens(out *[BlockTokens]uint32, cid uint64) {
	s := mix64(cid ^ 0x6a09e667f3bcc909)
	for i := 0; i < BlockTokens; i += 2 {
		s += golden
		z := mix64(s)
		out[i] = uint32((z & 0xffffffff) * Vocab >> 32)
		out[i+1] = uint32((z >> 32) * Vocab >> 32)
	}
}
