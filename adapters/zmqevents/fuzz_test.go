package zmqevents

import (
	"encoding/binary"
	"io"
	"net"
	"testing"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/security/null"

	"github.com/kvrouter/kvrouter/internal/zmtptest"
)

// zmtpStream is a well-formed inbound stream: greeting, READY with
// metadata, then a 3-frame message with a long payload frame.
func zmtpStream() []byte {
	var b []byte
	frame := func(flags byte, body []byte) {
		if len(body) > 255 {
			var h [9]byte
			h[0] = flags | flagLong
			binary.BigEndian.PutUint64(h[1:], uint64(len(body)))
			b = append(b, h[:]...)
		} else {
			b = append(b, flags, byte(len(body)))
		}
		b = append(b, body...)
	}
	b = append(b, zmtptest.Greeting()...)
	ready := append([]byte{5}, "READY"...)
	ready = append(ready, 11)
	ready = append(ready, "Socket-Type"...)
	ready = append(ready, 0, 0, 0, 3)
	ready = append(ready, "PUB"...)
	frame(flagCommand, ready)
	frame(flagMore, nil)
	frame(flagMore, EncodeSeq(7))
	frame(0, make([]byte, 300))
	return b
}

func fuzzSeeds(f *testing.F) {
	good := zmtpStream()
	f.Add(good, uint32(1000), uint8(0))
	f.Add(good, uint32(100), uint8(3))
	f.Add(hostile, uint32(DefaultMaxMessageBytes), uint8(8))
	f.Add(append(zmtptest.Greeting(), zmtptest.HugeHeader(0)...), uint32(1<<20), uint8(1))
	f.Add(append(zmtptest.Greeting(), flagCommand, 8, 5, 'R', 'E', 'A', 'D', 'Y', 2, 'a'), uint32(1<<20), uint8(0))
}

// referenceViolation walks a whole stream the simple way and returns where
// the header of the first frame the guard must refuse starts, and how long
// that header is; ok is false when the stream holds none.
func referenceViolation(b []byte, maxBytes int64) (at, headerLen int, ok bool) {
	pos, msg, frames, more, first := zmtpGreetingLen, int64(0), 0, false, true
	for pos < len(b) {
		flags := b[pos]
		headerLen = 2
		if flags&flagLong != 0 {
			headerLen = 9
		}
		if len(b)-pos < headerLen {
			return 0, 0, false
		}
		size := uint64(b[pos+1])
		if flags&flagLong != 0 {
			size = binary.BigEndian.Uint64(b[pos+1:])
		}
		if first && (flags&flagCommand == 0 || flags&flagMore != 0) {
			return pos, headerLen, true
		}
		if !more {
			msg, frames = 0, 0
		}
		more = flags&flagMore != 0
		frames++
		if frames > maxFramesPerMessage || size > uint64(maxBytes-msg) || (first && size > maxHandshakeBytes) {
			return pos, headerLen, true
		}
		msg += int64(size)
		bodyAt := pos + headerLen
		if size > uint64(len(b)-bodyAt) {
			return 0, 0, false
		}
		body := b[bodyAt : bodyAt+int(size)]
		if first && len(body) > 0 && int(body[0]) <= len(body)-1 &&
			string(body[1:1+int(body[0])]) == "READY" && !validMetadata(body[1+int(body[0]):]) {
			return bodyAt + int(size) - 1, 1, true // the body's last byte is withheld
		}
		first = false
		pos = bodyAt + int(size)
	}
	return 0, 0, false
}

// FuzzZMTPGuard: any stream, in any chunking, is passed on exactly up to
// the first frame the simple reference refuses, whose header is never
// passed on whole; nothing panics.
func FuzzZMTPGuard(f *testing.F) {
	fuzzSeeds(f)
	f.Fuzz(func(t *testing.T, stream []byte, maxBytes uint32, chunk uint8) {
		limit := int64(maxBytes) + 1
		g := newZMTPGuard(limit)
		step := int(chunk%16) + 1
		passed, refused := 0, false
		for i := 0; i < len(stream) && !refused; i += step {
			n, err := g.check(stream[i:min(i+step, len(stream))])
			passed += n
			refused = err != nil
		}
		at, headerLen, want := referenceViolation(stream, limit)
		switch {
		case refused != want:
			t.Fatalf("guard refused %v, reference %v (at %d)", refused, want, at)
		case !refused && passed != len(stream):
			t.Fatalf("passed %d of %d bytes without refusing", passed, len(stream))
		case refused && (passed < at || passed >= at+headerLen):
			t.Fatalf("passed %d bytes; the refused header is [%d, %d)", passed, at, at+headerLen)
		}
	})
}

// FuzzGuardedZMTPConn: zmq4 itself, reading any stream through the guard
// as a listening ROUTER or a dialing SUB, never panics.
func FuzzGuardedZMTPConn(f *testing.F) {
	fuzzSeeds(f)
	f.Fuzz(func(t *testing.T, stream []byte, maxBytes uint32, kind uint8) {
		ours, theirs := net.Pipe()
		defer theirs.Close()
		go func() { _, _ = io.Copy(io.Discard, theirs) }()
		go func() { _, _ = theirs.Write(stream); _ = theirs.Close() }()
		policy := newGuardPolicy(int64(maxBytes)+1, nil, "")
		conn := newGuardedConn(ours, policy)
		typ, server := zmq4.Router, true
		if kind%2 == 1 {
			typ, server = zmq4.Sub, false
		}
		zc, err := zmq4.Open(conn, null.Security(), typ, zmq4.SocketIdentity("fuzz"), server, nil)
		if err != nil {
			_ = conn.Close()
			return
		}
		defer zc.Close()
		for range len(stream) + 1 { // each message consumes at least a byte
			if _, err := zc.RecvMsg(); err != nil && zc.Closed() {
				return
			}
		}
	})
}
