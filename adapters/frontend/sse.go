package frontend

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
)

// errMalformed marks input that is not a server-sent event stream.
var errMalformed = errors.New("malformed event stream")

// maxEventBytes bounds one event, so that an engine cannot make the
// frontend buffer without end: a chunk of one token with its top
// logprobs is a few kilobytes, and 150 streams of 16 MiB events held
// close to 1 GB.
const maxEventBytes = 1 << 20

// keepEventBuffer is the largest event buffer a stream keeps for its next
// event: one that grew beyond it for a large event is let go, so that a
// stream holds a large event's size only while it reads one.
const keepEventBuffer = 64 << 10

// sseReader splits a server-sent event stream into events, keeping each
// event's bytes as they came.
type sseReader struct {
	br *bufio.Reader
	// raw and data are the buffers of the event being read, reused from
	// one event to the next.
	raw, data []byte
}

// event is one server-sent event. Its slices are the reader's: valid until
// its next call.
type event struct {
	raw     []byte // its lines, terminators and the blank line that ends it
	data    []byte // its data lines' values joined by "\n"
	hasData bool
}

func newSSEReader(r io.Reader) *sseReader { return &sseReader{br: bufio.NewReaderSize(r, 32<<10)} }

// buffered is how many bytes were read from the engine but not yet parsed.
func (s *sseReader) buffered() int { return s.br.Buffered() }

// next returns the next complete event, valid until the next call. io.EOF
// means the stream ended (between events or in the middle of one); an
// error wrapping errMalformed means a line that no event stream has.
func (s *sseReader) next() (event, error) {
	if cap(s.raw) > keepEventBuffer {
		s.raw = nil
	}
	if cap(s.data) > keepEventBuffer {
		s.data = nil
	}
	raw, data := s.raw[:0], s.data[:0]
	defer func() { s.raw, s.data = raw, data }()
	lines := 0       // data lines
	var first [2]int // where the first data line's value is in raw
	for {
		start := len(raw)
		var err error
		raw, err = s.appendLine(raw)
		if err != nil {
			if errors.Is(err, io.EOF) && len(raw) > start {
				return event{}, fmt.Errorf("%w: the stream ended inside an event", io.ErrUnexpectedEOF)
			}
			return event{}, err
		}
		content := bytes.TrimRight(raw[start:], "\r\n")
		switch {
		case len(content) == 0:
			if start == 0 {
				// Blank lines between events dispatch nothing.
				raw = raw[:0]
				continue
			}
			ev := event{raw: raw, hasData: lines > 0}
			switch lines {
			case 0:
			case 1:
				// One data line, the usual case: its value is in raw.
				ev.data = raw[first[0]:first[1]]
			default:
				ev.data = data
			}
			return ev, nil
		case content[0] == ':': // a comment
		case bytes.HasPrefix(content, []byte("data:")):
			from := start + len("data:")
			if from < start+len(content) && raw[from] == ' ' {
				from++
			}
			to := start + len(content)
			lines++
			switch lines {
			case 1:
				first = [2]int{from, to}
			case 2:
				data = append(data, raw[first[0]:first[1]]...)
				fallthrough
			default:
				data = append(data, '\n')
				data = append(data, raw[from:to]...)
			}
		case bytes.IndexByte(content, ':') > 0: // event:, id:, retry: and the like
		default:
			return event{}, fmt.Errorf("%w: line %.80q is not a field", errMalformed, content)
		}
	}
}

// appendLine appends one line with its terminator to raw, the event so
// far. A line cut by the end of the stream comes with io.EOF.
func (s *sseReader) appendLine(raw []byte) ([]byte, error) {
	for {
		chunk, err := s.br.ReadSlice('\n')
		if len(raw)+len(chunk) > maxEventBytes {
			return raw, fmt.Errorf("%w: an event larger than %d bytes", errMalformed, maxEventBytes)
		}
		raw = append(raw, chunk...)
		if !errors.Is(err, bufio.ErrBufferFull) {
			return raw, err
		}
	}
}
