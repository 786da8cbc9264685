package zmqevents

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"github.com/go-zeromq/zmq4/transport"
	"golang.org/x/text/cases"
	"golang.org/x/text/language"
	"golang.org/x/time/rate"
)

// DefaultMaxMessageBytes bounds one received ZMQ message (the sum of its
// frames), like libzmq's ZMQ_MAXMSGSIZE. vLLM's largest event batch is one
// scheduler step that stores a whole prompt without chunking: a 1M-token
// prompt at block size 16 is one BlockStored of 65,536 32-byte hashes and
// 1,048,576 token ids, 7,471,147 bytes of msgpack with every token id
// above 65,535 (5 bytes each); a 128k-token prompt is 933,929 bytes. 16 MiB
// covers the former twice over.
const DefaultMaxMessageBytes = 16 << 20

// maxFramesPerMessage bounds the frames of one message: zmq4 keeps a slice
// header per frame, so a stream of empty frames would otherwise grow a
// message without its byte size moving. kvrouter's messages have at most 5.
const maxFramesPerMessage = 1024

// ErrMessageTooLarge is wrapped by the error that drops a connection whose
// peer announced a message above the maximum.
var ErrMessageTooLarge = errors.New("zmqevents: message above the maximum size")

// ErrBadHandshake is wrapped by the error that drops a connection whose
// peer sent a malformed handshake.
var ErrBadHandshake = errors.New("zmqevents: malformed ZMTP handshake")

// guardError is a net.Error so that zmq4 treats the failed read as a
// broken connection and drops the peer.
type guardError struct {
	msg   string
	cause error
}

func tooLarge(format string, args ...any) error {
	return &guardError{msg: fmt.Sprintf(format, args...), cause: ErrMessageTooLarge}
}

func (e *guardError) Error() string   { return "zmqevents: " + e.msg }
func (e *guardError) Unwrap() error   { return e.cause }
func (e *guardError) Timeout() bool   { return false }
func (e *guardError) Temporary() bool { return false }

// defaultHandshakeTimeout bounds a peer's greeting and READY command (the
// handshake is two round trips; libzmq's ZMQ_HANDSHAKE_IVL is 30 s).
const defaultHandshakeTimeout = 10 * time.Second

// maxHandshakeBytes bounds the first frame after the greeting, the
// handshake's READY command: kvrouter's peers send a socket type and at
// most a 255-byte identity.
const maxHandshakeBytes = 8 << 10

// zmtpGuard checks a ZMTP 3.x inbound byte stream (the 64-byte greeting,
// then frames: a flags byte, a 1- or 8-byte size, the body) as zmq4 reads
// it, and fails the read that would complete a frame header whose size
// takes its message above max, before zmq4 allocates the frame. Commands
// are frames too and are held to the same bound. The handshake's READY
// command is checked whole before its last byte is passed on, because
// zmq4 indexes its metadata without bounds checks.
type zmtpGuard struct {
	max int64

	handshake []byte // the first frame's body so far, until it is complete
	inFirst   bool   // the first frame's body is being read
	firstDone bool

	greeting int // greeting bytes still to come
	header   [9]byte
	have     int    // bytes of header read so far
	body     uint64 // body bytes of the current frame still to come
	msgBytes int64  // body bytes of the current message so far
	frames   int    // frames of the current message so far
	more     bool   // the last complete frame announced another one
}

const (
	zmtpGreetingLen = 64
	flagMore        = 0x01
	flagLong        = 0x02
	flagCommand     = 0x04
)

func newZMTPGuard(max int64) zmtpGuard {
	return zmtpGuard{max: max, greeting: zmtpGreetingLen}
}

// check consumes b and returns how many of its bytes precede the header of
// an oversized frame, with the error; n == len(b) and nil when b is fine.
func (g *zmtpGuard) check(b []byte) (n int, err error) {
	for n < len(b) {
		switch {
		case g.greeting > 0:
			k := min(g.greeting, len(b)-n)
			g.greeting -= k
			n += k
		case g.body > 0:
			k := min(g.body, uint64(len(b)-n))
			if g.inFirst {
				g.handshake = append(g.handshake, b[n:n+int(k)]...)
			}
			g.body -= k
			n += int(k)
			if g.inFirst && g.body == 0 {
				if err := g.firstFrameDone(); err != nil {
					return n - 1, err
				}
			}
		default:
			headerStart := n - g.have
			g.header[g.have] = b[n]
			g.have++
			n++
			size, complete := g.headerSize()
			if !complete {
				continue
			}
			if err := g.frame(size); err != nil {
				return max(headerStart, 0), err
			}
		}
	}
	return n, nil
}

// headerSize decodes the header read so far.
func (g *zmtpGuard) headerSize() (uint64, bool) {
	if g.have < 2 {
		return 0, false
	}
	if g.header[0]&flagLong == 0 {
		return uint64(g.header[1]), true
	}
	if g.have < 9 {
		return 0, false
	}
	return binary.BigEndian.Uint64(g.header[1:9]), true
}

// frame accounts a complete frame header announcing size body bytes.
func (g *zmtpGuard) frame(size uint64) error {
	if !g.more {
		g.msgBytes, g.frames = 0, 0
	}
	g.have = 0
	g.more = g.header[0]&flagMore != 0
	g.frames++
	if g.frames > maxFramesPerMessage {
		return tooLarge("message of more than %d frames", maxFramesPerMessage)
	}
	if size > uint64(g.max-g.msgBytes) {
		return tooLarge("frame of %d bytes takes its message above the maximum of %d bytes", size, g.max)
	}
	g.msgBytes += int64(size)
	g.body = size
	if !g.firstDone {
		if g.header[0]&flagCommand == 0 || g.more {
			return &guardError{msg: "the peer's handshake does not start with a single-frame command", cause: ErrBadHandshake}
		}
		if size > maxHandshakeBytes {
			return tooLarge("handshake frame of %d bytes, above %d", size, maxHandshakeBytes)
		}
		g.handshake = make([]byte, 0, size)
		g.inFirst = true
		if size == 0 {
			return g.firstFrameDone()
		}
	}
	return nil
}

// firstFrameDone checks the handshake frame once complete.
func (g *zmtpGuard) firstFrameDone() error {
	g.inFirst, g.firstDone = false, true
	body := g.handshake
	g.handshake = nil
	if len(body) == 0 || int(body[0]) > len(body)-1 {
		return nil // zmq4 rejects it without reading metadata
	}
	name, meta := body[1:1+int(body[0])], body[1+int(body[0]):]
	if string(name) != "READY" || validMetadata(meta) {
		return nil
	}
	return &guardError{msg: "the peer's READY command has malformed metadata or no known Socket-Type", cause: ErrBadHandshake}
}

// validMetadata reports whether p is what zmq4 can take as a READY
// command's metadata: a sequence of properties (a 1-byte name length, the
// name, a 4-byte value length, the value) whose Socket-Type, the last one
// under zmq4's name normalisation, is a socket type zmq4 knows (it panics
// on any other).
func validMetadata(p []byte) bool {
	socketType, found := "", false
	for len(p) > 0 {
		k := int(p[0])
		if len(p) < 1+k+4 {
			return false
		}
		name := p[1 : 1+k]
		v := binary.BigEndian.Uint32(p[1+k:])
		p = p[1+k+4:]
		if uint64(v) > uint64(len(p)) {
			return false
		}
		// A Caser is stateful: one per use.
		if cases.Title(language.Und, cases.NoLower).String(string(name)) == "Socket-Type" {
			socketType, found = string(p[:v]), true
		}
		p = p[v:]
	}
	return found && knownSocketTypes[zmq4.SocketType(socketType)]
}

var knownSocketTypes = map[zmq4.SocketType]bool{
	zmq4.Pair: true, zmq4.Pub: true, zmq4.Sub: true, zmq4.Req: true, zmq4.Rep: true, zmq4.Dealer: true,
	zmq4.Router: true, zmq4.Pull: true, zmq4.Push: true, zmq4.XPub: true, zmq4.XSub: true,
}

// guardPolicy is what one socket's connections are held to; it travels to
// the transport in the socket's context.
type guardPolicy struct {
	max              int64
	handshakeTimeout time.Duration
	oversized        atomic.Uint64
	badHandshakes    atomic.Uint64
	log              *slog.Logger
	endpoint         string
	every            rate.Sometimes

	mu     sync.Mutex
	dialed *guardedConn // the last connection dialed, see closeDialed
}

type guardKey struct{}

func newGuardPolicy(maxBytes int64, logger *slog.Logger, endpoint string) *guardPolicy {
	if maxBytes <= 0 {
		maxBytes = DefaultMaxMessageBytes
	}
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return &guardPolicy{
		max: maxBytes, handshakeTimeout: defaultHandshakeTimeout, log: logger, endpoint: endpoint,
		every: rate.Sometimes{First: 1, Interval: 10 * time.Second},
	}
}

// setHandshakeTimeout overrides the default; d <= 0 keeps it.
func (p *guardPolicy) setHandshakeTimeout(d time.Duration) {
	if d > 0 {
		p.handshakeTimeout = d
	}
}

// withGuard returns the context to create a zmq4 socket with so that its
// connections are held to p.
func withGuard(ctx context.Context, p *guardPolicy) context.Context {
	return context.WithValue(ctx, guardKey{}, p)
}

func (p *guardPolicy) reject(conn net.Conn, err error) {
	counter := &p.oversized
	if errors.Is(err, ErrBadHandshake) {
		counter = &p.badHandshakes
	}
	counter.Add(1)
	p.every.Do(func() {
		p.log.Warn("zmq peer dropped", "endpoint", p.endpoint, "peer", conn.RemoteAddr().String(), "max_message_bytes", p.max,
			"err", err, "oversized_total", p.oversized.Load(), "bad_handshakes_total", p.badHandshakes.Load())
	})
}

// closeDialed closes the connection of a zmq4 Dial that failed its
// handshake: zmq4 returns the error without closing it.
func (p *guardPolicy) closeDialed() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.dialed != nil {
		_ = p.dialed.Close()
		p.dialed = nil
	}
}

// A guardedConn runs a zmtpGuard on what zmq4 reads: once the guard
// refuses, it closes the connection and fails every read. It also closes a
// connection whose handshake zmq4 does not complete: zmq4 accepts peers one at a time, so a silent one would block
// the listener, and it leaves the connection of a failed handshake open.
// zmq4 reads again right after a successful handshake; a connection not
// read past its handshake within the handshake timeout was abandoned.
type guardedConn struct {
	net.Conn
	policy   *guardPolicy
	guard    zmtpGuard
	err      error
	state    atomic.Int32 // handshaking, adopted or abandoned
	watchdog *time.Timer
}

const (
	handshaking int32 = iota
	adopted
	abandoned
)

func newGuardedConn(c net.Conn, p *guardPolicy) *guardedConn {
	g := &guardedConn{Conn: c, policy: p, guard: newZMTPGuard(p.max)}
	g.watchdog = time.AfterFunc(p.handshakeTimeout, g.abandon)
	return g
}

func (c *guardedConn) abandon() {
	if c.state.CompareAndSwap(handshaking, abandoned) {
		c.policy.reject(c.Conn, &guardError{msg: fmt.Sprintf("handshake not completed within %v", c.policy.handshakeTimeout), cause: ErrBadHandshake})
		_ = c.Conn.Close()
	}
}

func (c *guardedConn) Close() error {
	c.watchdog.Stop()
	return c.Conn.Close()
}

func (c *guardedConn) Read(b []byte) (int, error) {
	if c.err != nil {
		return 0, c.err
	}
	if c.guard.firstDone && c.state.CompareAndSwap(handshaking, adopted) {
		c.watchdog.Stop()
	}
	n, err := c.Conn.Read(b)
	ok, gerr := c.guard.check(b[:n])
	if gerr == nil {
		return n, err
	}
	c.err = gerr
	c.policy.reject(c.Conn, gerr)
	_ = c.Conn.Close()
	if ok > 0 {
		return ok, nil // the next read reports the error
	}
	return 0, gerr
}

type guardedListener struct {
	net.Listener
	policy *guardPolicy
}

func (l guardedListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return newGuardedConn(c, l.policy), nil
}

// guardedTransport is a zmq4 transport over net whose connections are
// guarded by the policy found in the socket's context.
type guardedTransport struct{ inner transport.Transport }

func policyOf(ctx context.Context) *guardPolicy {
	if p, ok := ctx.Value(guardKey{}).(*guardPolicy); ok {
		return p
	}
	return newGuardPolicy(0, nil, "")
}

func (t guardedTransport) Dial(ctx context.Context, dialer transport.Dialer, addr string) (net.Conn, error) {
	c, err := t.inner.Dial(ctx, dialer, addr)
	if err != nil {
		return nil, err
	}
	p := policyOf(ctx)
	g := newGuardedConn(c, p)
	p.mu.Lock()
	p.dialed = g
	p.mu.Unlock()
	return g, nil
}

func (t guardedTransport) Listen(ctx context.Context, addr string) (net.Listener, error) {
	l, err := t.inner.Listen(ctx, addr)
	if err != nil {
		return nil, err
	}
	return guardedListener{Listener: l, policy: policyOf(ctx)}, nil
}

func (t guardedTransport) Addr(ep string) (string, error) { return t.inner.Addr(ep) }

// guardedSchemes maps the endpoint schemes users write to the guarded
// transports registered for them.
var guardedSchemes = map[string]string{"tcp": "kvrouter-guarded-tcp", "ipc": "kvrouter-guarded-ipc"}

func init() {
	networks := map[string]string{"tcp": "tcp", "ipc": "unix"}
	for scheme, name := range guardedSchemes {
		if err := zmq4.RegisterTransport(name, guardedTransport{inner: transport.New(networks[scheme])}); err != nil {
			panic(err)
		}
	}
}

// guarded returns the endpoint zmq4 must be given so that the connection
// goes through the guard; endpoints of other transports (inproc) are
// returned unchanged.
func guarded(endpoint string) string {
	scheme, rest, ok := strings.Cut(endpoint, "://")
	if name, known := guardedSchemes[scheme]; ok && known {
		return name + "://" + rest
	}
	return endpoint
}
