package zmqevents

import (
	"context"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"net"
	"sync"
	"time"

	"github.com/go-zeromq/zmq4"
)

// PublisherConfig configures a Publisher.
type PublisherConfig struct {
	// Endpoint the PUB socket binds, e.g. "tcp://*:5557" or
	// "tcp://127.0.0.1:0" (port 0: any free port, see Publisher.Endpoint).
	Endpoint string
	// ReplayEndpoint the ROUTER socket binds; "" disables replay.
	ReplayEndpoint string
	// Topic is the first frame of every message (vLLM's default is empty).
	Topic string
	// BufferSize is how many batches are kept for replay;
	// 0 means DefaultBufferSize.
	BufferSize int
	// HWM bounds the PUB socket's send queue (messages beyond it are
	// dropped, as ZeroMQ does); 0 means 100,000 like vLLM.
	HWM int
	// ReplayWithTopic makes replay answers [topic, seq, payload] instead
	// of vLLM's [seq, payload].
	ReplayWithTopic bool
	// Logger receives zmq4's own diagnostics; nil discards them.
	Logger *log.Logger
	// MaxMessageBytes bounds what a peer may send; a peer announcing more
	// is disconnected. Peers only send subscriptions and replay requests:
	// 0, or anything above 64 KiB, means 64 KiB. (zmq4's PUB keeps up to
	// 10 messages other than subscriptions that nobody reads, plus one per
	// connection.)
	MaxMessageBytes int64
	// Log receives a rate-limited warning when a peer is dropped (an
	// oversized message, a bad or stalled handshake); nil discards.
	Log *slog.Logger

	handshakeTimeout time.Duration // 0: defaultHandshakeTimeout
}

type entry struct {
	seq     uint64
	payload []byte
}

// Publisher publishes batches like vLLM's ZmqEventPublisher. Its methods are
// safe for concurrent use.
type Publisher struct {
	cfg    PublisherConfig
	topic  []byte
	pub    zmq4.Socket
	router zmq4.Socket

	pubGuard, routerGuard *guardPolicy // routerGuard nil without replay
	cancel                context.CancelFunc
	wg                    sync.WaitGroup

	mu     sync.Mutex
	closed bool
	next   uint64  // next sequence number
	ring   []entry // ring[i%len] holds seq i for the last min(next, len) seqs
	stats  PublisherStats
}

// PublisherStats are a Publisher's counters.
type PublisherStats struct {
	Published      uint64 // batches published
	ReplayRequests uint64 // well-formed replay requests served
	ReplayInvalid  uint64 // replay requests ignored (no 8-byte start frame)
	ReplaySent     uint64 // batches sent by replay (end markers excluded)
	Oversized      uint64 // peers dropped for announcing a message above MaxMessageBytes
	BadHandshakes  uint64 // peers dropped for a malformed or stalled handshake
}

// maxPeerRequestBytes bounds what the Publisher's peers send.
const maxPeerRequestBytes = 64 << 10

// NewPublisher binds the sockets.
func NewPublisher(cfg PublisherConfig) (*Publisher, error) {
	if cfg.BufferSize <= 0 {
		cfg.BufferSize = DefaultBufferSize
	}
	if cfg.HWM <= 0 {
		cfg.HWM = 100_000
	}
	logger := cfg.Logger
	if logger == nil {
		logger = log.New(discard{}, "", 0)
	}
	if cfg.MaxMessageBytes <= 0 || cfg.MaxMessageBytes > maxPeerRequestBytes {
		cfg.MaxMessageBytes = maxPeerRequestBytes
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &Publisher{
		cfg: cfg, topic: []byte(cfg.Topic), cancel: cancel, ring: make([]entry, cfg.BufferSize),
		pubGuard: newGuardPolicy(cfg.MaxMessageBytes, cfg.Log, cfg.Endpoint),
	}
	p.pubGuard.setHandshakeTimeout(cfg.handshakeTimeout)
	p.pub = zmq4.NewPub(withGuard(ctx, p.pubGuard), zmq4.WithLogger(logger))
	if err := p.pub.SetOption(zmq4.OptionHWM, cfg.HWM); err != nil {
		p.closeSockets()
		return nil, fmt.Errorf("zmqevents: pub hwm: %w", err)
	}
	if err := p.pub.Listen(guarded(cfg.Endpoint)); err != nil {
		p.closeSockets()
		return nil, fmt.Errorf("zmqevents: pub: %w", err)
	}
	if cfg.ReplayEndpoint != "" {
		p.routerGuard = newGuardPolicy(cfg.MaxMessageBytes, cfg.Log, cfg.ReplayEndpoint)
		p.routerGuard.setHandshakeTimeout(cfg.handshakeTimeout)
		p.router = zmq4.NewRouter(withGuard(ctx, p.routerGuard), zmq4.WithLogger(logger))
		if err := p.router.Listen(guarded(cfg.ReplayEndpoint)); err != nil {
			p.closeSockets()
			return nil, fmt.Errorf("zmqevents: replay: %w", err)
		}
		p.wg.Add(1)
		go p.serveReplay(ctx)
	}
	return p, nil
}

type discard struct{}

func (discard) Write(b []byte) (int, error) { return len(b), nil }

// Endpoint is the PUB endpoint actually bound ("tcp://127.0.0.1:40123"),
// with the port resolved when the configuration asked for port 0.
func (p *Publisher) Endpoint() string { return endpointOf(p.pub.Addr(), p.cfg.Endpoint) }

// ReplayEndpoint is the ROUTER endpoint actually bound, "" without replay.
func (p *Publisher) ReplayEndpoint() string {
	if p.router == nil {
		return ""
	}
	return endpointOf(p.router.Addr(), p.cfg.ReplayEndpoint)
}

func endpointOf(a net.Addr, fallback string) string {
	if a == nil {
		return fallback
	}
	if ta, ok := a.(*net.TCPAddr); ok {
		host := ta.IP.String()
		if ta.IP.IsUnspecified() {
			host = "127.0.0.1"
		}
		return "tcp://" + net.JoinHostPort(host, fmt.Sprint(ta.Port))
	}
	return fallback
}

// Publish sends [topic, seq, payload] and keeps (seq, payload) for replay.
// Sequence numbers start at 0 and grow by one per call. The payload is
// copied. Like ZeroMQ, it never blocks on slow subscribers.
func (p *Publisher) Publish(payload []byte) (uint64, error) {
	buf := append([]byte(nil), payload...)
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return 0, ErrClosed
	}
	seq := p.next
	if err := p.pub.SendMulti(zmq4.NewMsgFrom(p.topic, EncodeSeq(seq), buf)); err != nil {
		return 0, fmt.Errorf("zmqevents: publish: %w", err)
	}
	p.ring[seq%uint64(len(p.ring))] = entry{seq: seq, payload: buf}
	p.next++
	p.stats.Published++
	return seq, nil
}

// NextSeq is the sequence number the next Publish will use.
func (p *Publisher) NextSeq() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.next
}

// Buffered returns the range of sequence numbers kept for replay,
// [oldest, next); empty when oldest == next.
func (p *Publisher) Buffered() (oldest, next uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.oldestLocked(), p.next
}

func (p *Publisher) oldestLocked() uint64 {
	if n := uint64(len(p.ring)); p.next > n {
		return p.next - n
	}
	return 0
}

// Stats returns the counters.
func (p *Publisher) Stats() PublisherStats {
	p.mu.Lock()
	st := p.stats
	p.mu.Unlock()
	for _, g := range []*guardPolicy{p.pubGuard, p.routerGuard} {
		if g != nil {
			st.Oversized += g.oversized.Load()
			st.BadHandshakes += g.badHandshakes.Load()
		}
	}
	return st
}

// since copies the buffered entries with seq >= start.
func (p *Publisher) since(start uint64) []entry {
	p.mu.Lock()
	defer p.mu.Unlock()
	from := max(start, p.oldestLocked())
	if from >= p.next {
		return nil
	}
	out := make([]entry, 0, p.next-from)
	for s := from; s < p.next; s++ {
		out = append(out, p.ring[s%uint64(len(p.ring))])
	}
	return out
}

func (p *Publisher) serveReplay(ctx context.Context) {
	defer p.wg.Done()
	for {
		msg, err := p.router.Recv()
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			continue
		}
		if msg.Type == zmq4.CmdMsg {
			continue
		}
		p.answer(msg.Frames)
	}
}

// answer serves one request: frames are [identity, ("",) start].
func (p *Publisher) answer(frames [][]byte) {
	bad := func() {
		p.mu.Lock()
		p.stats.ReplayInvalid++
		p.mu.Unlock()
	}
	if len(frames) < 2 {
		bad()
		return
	}
	id, rest := frames[0], frames[1:]
	delim := len(rest) == 2 && len(rest[0]) == 0
	if delim {
		rest = rest[1:]
	}
	start, ok := DecodeSeq(rest[0])
	if len(rest) != 1 || !ok {
		bad()
		return
	}
	entries := p.since(start)
	p.mu.Lock()
	p.stats.ReplayRequests++
	p.mu.Unlock()
	send := func(seq uint64, payload []byte) error {
		f := make([][]byte, 0, 5)
		f = append(f, id)
		if delim {
			f = append(f, nil)
		}
		if p.cfg.ReplayWithTopic {
			f = append(f, p.topic)
		}
		f = append(f, EncodeSeq(seq), payload)
		return p.router.SendMulti(zmq4.NewMsgFrom(f...))
	}
	for _, e := range entries {
		if send(e.seq, e.payload) != nil {
			return // client gone or closing
		}
		p.mu.Lock()
		p.stats.ReplaySent++
		p.mu.Unlock()
	}
	_ = send(EndSeq, nil)
}

// Close unbinds the sockets and stops the replay server. Further Publish
// calls fail with ErrClosed. It is idempotent.
func (p *Publisher) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	p.mu.Unlock()
	err := p.closeSockets()
	p.wg.Wait()
	if errors.Is(err, net.ErrClosed) || errors.Is(err, context.Canceled) {
		err = nil // a connection zmq4 had already dropped
	}
	return err
}

func (p *Publisher) closeSockets() error {
	p.cancel()
	var err error
	if p.router != nil {
		err = p.router.Close()
	}
	if e := p.pub.Close(); e != nil && err == nil {
		err = e
	}
	return err
}
