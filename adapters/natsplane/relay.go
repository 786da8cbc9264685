package natsplane

import (
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/nats-io/nats.go"
)

// relay is what replica sync and session sync share: it publishes one
// replica's updates on a subject, from a queue drained by one goroutine
// rather than on the routing path, and applies the other replicas' in
// arrival order.
type relay[T any] struct {
	nc     *nats.Conn
	subj   string
	id     string
	what   string // names the relay in logs
	log    *slog.Logger
	sub    *nats.Subscription
	msgs   chan *nats.Msg
	out    chan T
	stop   chan struct{}
	wg     sync.WaitGroup
	once   sync.Once
	encode func(routerID string, u T) ([]byte, error)
	decode func(data []byte) (routerID string, u T, err error)
	apply  func(u T) error

	published, publishErrors                 atomic.Uint64
	applied, ignored, malformed, applyErrors atomic.Uint64
	dropped                                  atomic.Uint64 // as of close, which resets the subscription's
}

// startRelay subscribes to subj. decode must wrap ErrUndecodable for a
// message that is not the relay's at all, and return the sender's id
// whenever the message has one.
func startRelay[T any](nc *nats.Conn, cfg ReplicaSyncConfig, what, subj string,
	encode func(string, T) ([]byte, error), decode func([]byte) (string, T, error), apply func(T) error,
) (*relay[T], error) {
	if err := cfg.Names.orDefault().Validate(); err != nil {
		return nil, err
	}
	if cfg.RouterID == "" || strings.Contains(cfg.RouterID, "/") {
		return nil, fmt.Errorf("natsplane: %s needs a router id without '/', got %q", what, cfg.RouterID)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	s := &relay[T]{
		nc: nc, subj: subj, id: cfg.RouterID, what: what, log: cfg.Logger,
		msgs: make(chan *nats.Msg, syncPending), out: make(chan T, syncOutbox),
		stop: make(chan struct{}), encode: encode, decode: decode, apply: apply,
	}
	sub, err := nc.ChanSubscribe(s.subj, s.msgs)
	if err != nil {
		return nil, fmt.Errorf("natsplane: %s: %w", what, err)
	}
	// Once the server knows the subscription, nothing a peer publishes
	// from now on is missed.
	if err := nc.Flush(); err != nil {
		_ = sub.Unsubscribe()
		return nil, fmt.Errorf("natsplane: %s: %w", what, err)
	}
	s.sub = sub
	s.wg.Go(s.receive)
	s.wg.Go(s.send)
	return s, nil
}

// Stats returns the counters.
func (s *relay[T]) Stats() ReplicaSyncStats {
	st := ReplicaSyncStats{
		Published: s.published.Load(), PublishErrors: s.publishErrors.Load(),
		Applied: s.applied.Load(), Ignored: s.ignored.Load(),
		Malformed: s.malformed.Load(), ApplyErrors: s.applyErrors.Load(), Dropped: s.dropped.Load(),
	}
	if n, err := s.sub.Dropped(); err == nil {
		st.Dropped = uint64(n)
	}
	return st
}

// close detaches the relay from its router, then stops applying and
// publishing once the updates already queued are sent.
func (s *relay[T]) close(detach func()) error {
	var err error
	s.once.Do(func() {
		detach()
		if n, e := s.sub.Dropped(); e == nil {
			s.dropped.Store(uint64(n))
		}
		err = s.sub.Unsubscribe()
		close(s.stop)
		s.wg.Wait()
	})
	return err
}

// enqueue is the router's observer. It runs under the router's lock,
// where neither encoding nor nc.Publish belongs: once the connection's
// write buffer is full, Publish writes to the socket itself, and a
// stalled server would stall every booking.
func (s *relay[T]) enqueue(u T) {
	select {
	case s.out <- u:
	default:
		s.count(&s.publishErrors, s.what+": outbox full; other replicas miss this update")
	}
}

// send publishes in booking order, so that peers see a request's add
// before its free, a session's binding before its close.
func (s *relay[T]) send() {
	for {
		select {
		case u := <-s.out:
			s.publish(u)
		case <-s.stop:
			for {
				select {
				case u := <-s.out:
					s.publish(u)
				default:
					return
				}
			}
		}
	}
}

func (s *relay[T]) publish(u T) {
	b, err := s.encode(s.id, u)
	if err == nil {
		err = s.nc.Publish(s.subj, b)
	}
	if err != nil {
		s.count(&s.publishErrors, s.what+": publish failed; other replicas miss this update", "err", err)
		return
	}
	s.published.Add(1)
}

// receive applies messages one at a time, in arrival order: a request's
// add must come before its free.
func (s *relay[T]) receive() {
	for {
		select {
		case m := <-s.msgs:
			s.handle(m.Data)
		case <-s.stop:
			return
		}
	}
}

func (s *relay[T]) handle(data []byte) {
	from, u, err := s.decode(data)
	switch {
	case errors.Is(err, ErrUndecodable):
		s.count(&s.malformed, s.what+": undecodable message skipped", "err", err)
		return
	case from == s.id:
		s.ignored.Add(1)
		return
	case err != nil:
		s.count(&s.malformed, s.what+": malformed message skipped", "router_id", from, "err", err)
		return
	}
	if err := s.apply(u); err != nil {
		s.count(&s.applyErrors, s.what+": update not applied", "router_id", from, "err", err)
		return
	}
	s.applied.Add(1)
}

// count bumps c and logs: the first occurrence as a warning, the rest at
// debug level, since a broken peer can repeat the same fault at the
// fleet's request rate.
func (s *relay[T]) count(c *atomic.Uint64, msg string, args ...any) {
	if c.Add(1) == 1 {
		s.log.Warn(msg, args...)
	} else {
		s.log.Debug(msg, args...)
	}
}
