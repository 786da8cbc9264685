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

// maxEventBytes bounds one event, so a runaway engine cannot make the
// frontend buffer without end.
const maxEventBytes = 16 << 20

// sseReader splits a server-sent event stream into events, keeping each
// event's bytes as they came.
type sseReader struct {
	br *bufio.Reader
}

// event is one server-sent event.
type event struct {
	raw     []byte // its lines, terminators and the blank line that ends it
	data    []byte // its data lines' values joined by "\n"
	hasData bool
}

func newSSEReader(r io.Reader) *sseReader { return &sseReader{br: bufio.NewReaderSize(r, 32<<10)} }

// buffered is how many bytes were read from the engine but not yet parsed.
func (s *sseReader) buffered() int { return s.br.Buffered() }

// next returns the next complete event. io.EOF means the stream ended
// (between events or in the middle of one); an error wrapping errMalformed
// means a line that no event stream has.
func (s *sseReader) next() (event, error) {
	var ev event
	for {
		line, err := s.line(len(ev.raw))
		if err != nil {
			if errors.Is(err, io.EOF) && len(line) > 0 {
				return event{}, fmt.Errorf("%w: the stream ended inside an event", io.ErrUnexpectedEOF)
			}
			return event{}, err
		}
		ev.raw = append(ev.raw, line...)
		content := bytes.TrimRight(line, "\r\n")
		switch {
		case len(content) == 0:
			if len(ev.raw) == len(line) {
				// Blank lines between events dispatch nothing.
				ev.raw = ev.raw[:0]
				continue
			}
			return ev, nil
		case content[0] == ':': // a comment
		case bytes.HasPrefix(content, []byte("data:")):
			v := content[len("data:"):]
			v = bytes.TrimPrefix(v, []byte(" "))
			if ev.hasData {
				ev.data = append(ev.data, '\n')
			}
			ev.data = append(ev.data, v...)
			ev.hasData = true
		case bytes.IndexByte(content, ':') > 0: // event:, id:, retry: and the like
		default:
			return event{}, fmt.Errorf("%w: line %.80q is not a field", errMalformed, content)
		}
	}
}

// line reads one line with its terminator; have is the size of the event
// so far. A line cut by the end of the stream comes with io.EOF.
func (s *sseReader) line(have int) ([]byte, error) {
	var acc []byte
	for {
		chunk, err := s.br.ReadSlice('\n')
		if errors.Is(err, bufio.ErrBufferFull) {
			acc = append(acc, chunk...)
			if have+len(acc) > maxEventBytes {
				return nil, fmt.Errorf("%w: an event larger than %d bytes", errMalformed, maxEventBytes)
			}
			continue
		}
		if acc != nil {
			chunk = append(acc, chunk...)
		}
		if have+len(chunk) > maxEventBytes {
			return nil, fmt.Errorf("%w: an event larger than %d bytes", errMalformed, maxEventBytes)
		}
		return chunk, err
	}
}
