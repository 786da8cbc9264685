package zmqevents

import (
	"context"
	"errors"
	"fmt"
	"log"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-zeromq/zmq4"
	"golang.org/x/sync/semaphore"
)

// SubscriberConfig configures a Subscriber.
type SubscriberConfig struct {
	// Endpoint of the engine's PUB socket, e.g. "tcp://10.0.0.5:5557".
	Endpoint string
	// Topic is the subscription prefix; "" receives everything.
	Topic string
	// Handler, when set, receives every message on the Subscriber's
	// goroutine, in order, and Messages() is nil. It must not block for
	// long: the socket is not read meanwhile.
	Handler func(Message)
	// Buffer is how many messages wait for the Messages() reader; 0 means
	// 1024. When it is full, or MaxBufferedBytes is reached, the
	// Subscriber waits (it does not drop).
	Buffer int
	// MaxBufferedBytes bounds the payload and topic bytes waiting for the
	// Messages() reader, so that a slow reader and a publisher of large
	// messages cannot grow memory; 0 means 4 × MaxMessageBytes, and it is
	// at least MaxMessageBytes.
	MaxBufferedBytes int64
	// RetryInterval between connection attempts; 0 means zmq4's 250 ms.
	RetryInterval time.Duration
	// Logger receives zmq4's own diagnostics; nil discards them.
	Logger *log.Logger
	// MaxMessageBytes bounds a received message; a publisher announcing a
	// bigger one is disconnected (and redialled). 0 means
	// DefaultMaxMessageBytes.
	MaxMessageBytes int64
	// Log receives a rate-limited warning when a peer is dropped (an
	// oversized message, a bad or stalled handshake); nil discards.
	Log *slog.Logger
	// OnJoin, when set, is called on the Subscriber's goroutine after each
	// connection is made and the subscription sent, before anything is
	// received on it: what the publisher sends from then on reaches the
	// Subscriber, what it sent before did not. A consumer that caught up
	// by replay before that moment asks again from where it stopped. It
	// must not block.
	OnJoin func()

	handshakeTimeout time.Duration // 0: defaultHandshakeTimeout
}

// SubscriberStats are a Subscriber's counters.
type SubscriberStats struct {
	Received  uint64 // well-formed messages delivered
	Malformed uint64 // messages skipped: not 3 frames, or seq frame not 8 bytes
	Gaps      uint64 // messages that arrived after a gap (Message.Missed > 0)
	Missed    uint64 // sequence numbers missed in all gaps
	Resets    uint64 // messages whose seq did not grow (Message.Reset)
	Connects  uint64 // connections made; each has sent the subscription, so later batches reach it
	Oversized uint64 // connections dropped: the publisher announced a message above MaxMessageBytes

	BadHandshakes uint64 // connections dropped: the publisher's handshake was malformed or stalled
	BufferedBytes uint64 // bytes now waiting for the Messages() reader (not a counter)
}

// Subscriber receives a publisher's stream: it connects a SUB socket,
// checks each message's shape and sequence number and delivers the
// well-formed ones.
type Subscriber struct {
	cfg    SubscriberConfig
	sub    zmq4.Socket
	guard  *guardPolicy
	ctx    context.Context
	cancel context.CancelFunc
	out    chan Message
	wg     sync.WaitGroup

	// Messages travel run → queue → forward → out; budget holds their
	// bytes from the moment they are queued until the reader takes them.
	queue    chan Message
	budget   *semaphore.Weighted
	maxHeld  int64
	buffered atomic.Int64

	closeOnce sync.Once

	mu       sync.Mutex
	stats    SubscriberStats
	haveLast bool
	last     uint64
}

// NewSubscriber starts a Subscriber. It returns at once: connecting happens
// in the background and is retried until it succeeds or Close is called
// (the engine may start after the router), and again whenever the
// connection breaks.
func NewSubscriber(cfg SubscriberConfig) (*Subscriber, error) {
	if cfg.Buffer <= 0 {
		cfg.Buffer = 1024
	}
	logger := cfg.Logger
	if logger == nil {
		logger = log.New(discard{}, "", 0)
	}
	opts := []zmq4.Option{zmq4.WithLogger(logger), zmq4.WithDialerMaxRetries(-1)}
	if cfg.RetryInterval > 0 {
		opts = append(opts, zmq4.WithDialerRetry(cfg.RetryInterval))
	}
	guard := newGuardPolicy(cfg.MaxMessageBytes, cfg.Log, cfg.Endpoint)
	guard.setHandshakeTimeout(cfg.handshakeTimeout)
	ctx, cancel := context.WithCancel(withGuard(context.Background(), guard))
	s := &Subscriber{cfg: cfg, guard: guard, ctx: ctx, cancel: cancel}
	s.sub = zmq4.NewSub(ctx, opts...)
	if err := s.sub.SetOption(zmq4.OptionSubscribe, cfg.Topic); err != nil {
		cancel()
		_ = s.sub.Close()
		return nil, fmt.Errorf("zmqevents: subscribe: %w", err)
	}
	if cfg.Handler == nil {
		s.maxHeld = cfg.MaxBufferedBytes
		if s.maxHeld <= 0 {
			s.maxHeld = 4 * guard.max
		}
		s.maxHeld = max(s.maxHeld, guard.max)
		s.budget = semaphore.NewWeighted(s.maxHeld)
		s.queue = make(chan Message, cfg.Buffer)
		s.out = make(chan Message)
		s.wg.Add(1)
		go s.forward()
	}
	s.wg.Add(1)
	go s.run()
	return s, nil
}

// Messages is the stream of well-formed messages, in arrival order; it is
// closed by Close. Nil when a Handler is configured.
func (s *Subscriber) Messages() <-chan Message { return s.out }

// Stats returns the counters.
func (s *Subscriber) Stats() SubscriberStats {
	s.mu.Lock()
	st := s.stats
	s.mu.Unlock()
	st.Oversized = s.guard.oversized.Load()
	st.BufferedBytes = uint64(s.buffered.Load())
	st.BadHandshakes = s.guard.badHandshakes.Load()
	return st
}

func (s *Subscriber) run() {
	defer s.wg.Done()
	if s.queue != nil {
		defer close(s.queue)
	}
	retry := s.cfg.RetryInterval
	if retry <= 0 {
		retry = 250 * time.Millisecond
	}
	// The Subscriber redials itself rather than through zmq4's automatic
	// reconnect: zmq4 redials from inside the failed read, recursively when
	// the new connection fails its handshake too, and gives up silently
	// when that redial fails.
	for {
		if err := s.sub.Dial(guarded(s.cfg.Endpoint)); err != nil {
			s.guard.closeDialed()
		} else {
			s.mu.Lock()
			s.stats.Connects++
			s.mu.Unlock()
			if s.cfg.OnJoin != nil {
				s.cfg.OnJoin()
			}
			if !s.receive() {
				return
			}
		}
		select {
		case <-s.ctx.Done():
			return
		case <-time.After(retry):
		}
	}
}

// receive delivers messages until the connection breaks (true) or the
// Subscriber closes (false).
func (s *Subscriber) receive() bool {
	for {
		msg, err := s.sub.Recv()
		if s.ctx.Err() != nil {
			return false
		}
		if err != nil {
			return true // the only connection's reader has stopped
		}
		if msg.Type == zmq4.CmdMsg {
			continue
		}
		m, ok := s.check(msg.Frames)
		if !ok {
			continue
		}
		if s.cfg.Handler != nil {
			s.cfg.Handler(m)
			continue
		}
		if !s.enqueue(m) {
			return false
		}
	}
}

// held is what a message counts against MaxBufferedBytes.
func (s *Subscriber) held(m Message) int64 {
	return min(int64(len(m.Topic)+len(m.Payload)), s.maxHeld)
}

// enqueue waits for room for m; false when the Subscriber closes first.
func (s *Subscriber) enqueue(m Message) bool {
	n := s.held(m)
	if s.budget.Acquire(s.ctx, n) != nil {
		return false
	}
	s.buffered.Add(n)
	select {
	case s.queue <- m:
		return true
	case <-s.ctx.Done():
		return false
	}
}

// forward hands the queued messages to the Messages() reader.
func (s *Subscriber) forward() {
	defer s.wg.Done()
	defer close(s.out)
	for m := range s.queue {
		select {
		case s.out <- m:
			n := s.held(m)
			s.buffered.Add(-n)
			s.budget.Release(n)
		case <-s.ctx.Done():
			return
		}
	}
}

// check validates one message and tracks its sequence number.
func (s *Subscriber) check(frames [][]byte) (Message, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(frames) != 3 {
		s.stats.Malformed++
		return Message{}, false
	}
	seq, ok := DecodeSeq(frames[1])
	if !ok {
		s.stats.Malformed++
		return Message{}, false
	}
	m := Message{Topic: frames[0], Seq: seq, Payload: frames[2]}
	if s.haveLast {
		switch {
		case seq <= s.last:
			m.Reset = true
			s.stats.Resets++
		case seq > s.last+1:
			m.Missed = seq - s.last - 1
			s.stats.Gaps++
			s.stats.Missed += m.Missed
		}
	}
	s.haveLast, s.last = true, seq
	s.stats.Received++
	return m, true
}

// Close disconnects and stops the Subscriber; Messages() is closed once
// its goroutine has stopped. It is idempotent.
func (s *Subscriber) Close() error {
	var err error
	s.closeOnce.Do(func() {
		s.cancel()
		err = s.sub.Close()
		s.wg.Wait()
		// A dial that completed while closing may have added a
		// connection after the first Close; closing again releases it.
		_ = s.sub.Close()
		if errors.Is(err, net.ErrClosed) || errors.Is(err, context.Canceled) {
			err = nil // a connection zmq4 had already dropped
		}
	})
	return err
}

// DefaultReplayMaxBatches is how many batches one Replay collects at most:
// vLLM's buffer_steps, the most a vLLM replay endpoint holds.
const DefaultReplayMaxBatches = DefaultBufferSize

// DefaultReplayMaxBytes is how many payload bytes one Replay collects at
// most: four of the largest batches, or 10,000 batches of 6.7 kB.
const DefaultReplayMaxBytes = 4 * DefaultMaxMessageBytes

// ErrReplayTooLarge is wrapped by Replay's error when the endpoint sent more
// than ReplayConfig allows before its end marker.
var ErrReplayTooLarge = errors.New("zmqevents: replay above its bound")

// ReplayConfig bounds what one Replay holds, so that a broken or hostile
// replay endpoint cannot grow the caller's memory. Zero values mean the
// defaults.
type ReplayConfig struct {
	MaxBatches      int   // DefaultReplayMaxBatches
	MaxBytes        int64 // payload and topic bytes; DefaultReplayMaxBytes, at least MaxMessageBytes
	MaxMessageBytes int64 // one message, as SubscriberConfig.MaxMessageBytes
	Log             *slog.Logger
}

// Replay asks a publisher's replay endpoint for every buffered batch with
// seq >= start and collects them until the end marker. It connects a
// DEALER socket and sends the REQ-style request ["", start], which vLLM's
// publisher requires and this package's Publisher accepts; replies with or
// without the delimiter, and in the [seq, payload] or [topic, seq, payload]
// shape, are understood. Malformed replies are skipped. If ctx ends before
// the end marker, Replay returns what it got and an error wrapping
// ctx.Err(); if the endpoint sends more than cfg allows, what fits and an
// error wrapping ErrReplayTooLarge; if it announces a message above
// cfg.MaxMessageBytes, what came before and an error wrapping
// ErrMessageTooLarge. A replay that starts above the publisher's oldest
// buffered batch is complete; check the first Seq against start to see
// whether the ring had already dropped some.
func Replay(ctx context.Context, endpoint string, start uint64, cfg ReplayConfig) ([]Message, error) {
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	if cfg.MaxBatches <= 0 {
		cfg.MaxBatches = DefaultReplayMaxBatches
	}
	guard := newGuardPolicy(cfg.MaxMessageBytes, cfg.Log, endpoint)
	if cfg.MaxBytes <= 0 {
		cfg.MaxBytes = DefaultReplayMaxBytes
	}
	cfg.MaxBytes = max(cfg.MaxBytes, guard.max)
	sctx, cancel := context.WithCancel(withGuard(ctx, guard))
	defer cancel()
	dealer := zmq4.NewDealer(sctx, zmq4.WithLogger(log.New(discard{}, "", 0)), zmq4.WithDialerMaxRetries(-1))
	defer dealer.Close()
	if err := dealer.Dial(guarded(endpoint)); err != nil {
		guard.closeDialed()
		return nil, fmt.Errorf("zmqevents: replay dial %s: %w", endpoint, errOr(ctx.Err(), err))
	}
	if err := dealer.SendMulti(zmq4.NewMsgFrom([]byte{}, EncodeSeq(start))); err != nil {
		return nil, fmt.Errorf("zmqevents: replay request: %w", errOr(ctx.Err(), err))
	}
	var out []Message
	var held int64
	for {
		msg, err := dealer.Recv()
		if ctx.Err() != nil {
			return out, fmt.Errorf("zmqevents: replay incomplete after %d batches: %w", len(out), ctx.Err())
		}
		if err != nil {
			return out, fmt.Errorf("zmqevents: replay: %w", err)
		}
		if msg.Type == zmq4.CmdMsg {
			continue
		}
		f := msg.Frames
		if len(f) >= 3 && len(f[0]) == 0 {
			f = f[1:] // REQ-style delimiter
		}
		var m Message
		switch len(f) {
		case 2:
		case 3:
			m.Topic, f = f[0], f[1:]
		default:
			continue
		}
		seq, ok := DecodeSeq(f[0])
		if !ok {
			continue
		}
		if seq == EndSeq {
			return out, nil
		}
		m.Seq, m.Payload = seq, f[1]
		held += int64(len(m.Topic) + len(m.Payload))
		if len(out) == cfg.MaxBatches {
			return out, fmt.Errorf("%w: more than %d batches", ErrReplayTooLarge, cfg.MaxBatches)
		}
		if held > cfg.MaxBytes {
			return out, fmt.Errorf("%w: more than %d bytes after %d batches", ErrReplayTooLarge, cfg.MaxBytes, len(out))
		}
		out = append(out, m)
	}
}
func errOr(a, b error) error {
	if a != nil {
		return a
	}
	return b
}
