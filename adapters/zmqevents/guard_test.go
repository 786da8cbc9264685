package zmqevents

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"

	"github.com/kvrouter/kvrouter/internal/testwait"
	"github.com/kvrouter/kvrouter/internal/zmtptest"
)

// hostile is the reproduction: greeting, then a frame header claiming 2^50
// bytes; zmq4 v0.17 alone tries to allocate them and panics.
var hostile = zmtptest.Hostile()

func TestSubscriberSurvivesHugeFrameHeader(t *testing.T) {
	p := newPublisher(t, PublisherConfig{})
	s := newSubscriber(t, SubscriberConfig{Endpoint: zmtptest.FirstThenProxy(t, zmtptest.Hostile(), p.Endpoint())})
	testwait.Until(t, testTimeout, "the hostile publisher is dropped", func() bool { return s.Stats().Oversized == 1 })
	join(t, func(int) { _, _ = p.Publish(probe) }, s.Messages())
}

func TestReplaySurvivesHugeFrameHeader(t *testing.T) {
	p := newPublisher(t, PublisherConfig{ReplayEndpoint: "tcp://127.0.0.1:0"})
	for range 3 {
		if _, err := p.Publish(probe); err != nil {
			t.Fatal(err)
		}
	}
	endpoint := zmtptest.FirstThenProxy(t, zmtptest.Hostile(), p.ReplayEndpoint())
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	if msgs, err := Replay(ctx, endpoint, 0, ReplayConfig{}); !errors.Is(err, ErrMessageTooLarge) || len(msgs) != 0 {
		t.Fatalf("hostile replay endpoint: %d messages, err %v; want none and ErrMessageTooLarge", len(msgs), err)
	}
	msgs, err := Replay(ctx, endpoint, 0, ReplayConfig{})
	if err != nil || len(msgs) != 3 {
		t.Fatalf("replay after the hostile peer: %d messages, err %v; want 3", len(msgs), err)
	}
}

func TestPublisherSurvivesHugeFrameHeader(t *testing.T) {
	p := newPublisher(t, PublisherConfig{ReplayEndpoint: "tcp://127.0.0.1:0"})
	t.Run("pub", func(t *testing.T) {
		zmtptest.Send(t, p.Endpoint(), hostile)
		testwait.Until(t, testTimeout, "the hostile subscriber is dropped", func() bool { return p.Stats().Oversized == 1 })
		s := newSubscriber(t, SubscriberConfig{Endpoint: p.Endpoint()})
		join(t, func(int) { _, _ = p.Publish(probe) }, s.Messages())
	})
	t.Run("router", func(t *testing.T) {
		zmtptest.Send(t, p.ReplayEndpoint(), hostile)
		testwait.Until(t, testTimeout, "the hostile replay client is dropped", func() bool { return p.Stats().Oversized == 2 })
		ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
		defer cancel()
		msgs, err := Replay(ctx, p.ReplayEndpoint(), 0, ReplayConfig{})
		if err != nil || uint64(len(msgs)) != p.NextSeq() {
			t.Fatalf("replay after the hostile peer: %d messages, err %v; want %d", len(msgs), err, p.NextSeq())
		}
	})
}

// TestOversizedMessageAfterHandshake drops a publisher whose message,
// made of frames each below the maximum, exceeds it, and redials it.
func TestOversizedMessageAfterHandshake(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	pub := zmq4.NewPub(ctx) // unguarded, as a foreign publisher
	defer pub.Close()
	if err := pub.Listen("tcp://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	s := newSubscriber(t, SubscriberConfig{Endpoint: endpointOf(pub.Addr(), ""), MaxMessageBytes: 1000})
	big := bytes.Repeat([]byte{1}, 600)
	testwait.Until(t, testTimeout, "the publisher is dropped twice", func() bool {
		_ = pub.Send(zmq4.NewMsgFrom(nil, EncodeSeq(0), big, big))
		return s.Stats().Oversized >= 2
	})
	if st := s.Stats(); st.Received != 0 {
		t.Fatalf("an oversized message was delivered: %+v", st)
	}
}

// floodingReplayEndpoint answers every replay request with n batches of
// size bytes each, then the end marker: more than a bounded Replay holds.
func floodingReplayEndpoint(t *testing.T, n, size int) string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	router := zmq4.NewRouter(ctx)
	if err := router.Listen("tcp://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() { cancel(); _ = router.Close(); <-done })
	payload := bytes.Repeat([]byte{0xc0}, size)
	go func() {
		defer close(done)
		for {
			req, err := router.Recv()
			if err != nil {
				if ctx.Err() != nil {
					return
				}
				continue
			}
			id := req.Frames[0]
			for seq := range n {
				if router.SendMulti(zmq4.NewMsgFrom(id, nil, EncodeSeq(uint64(seq)), payload)) != nil {
					break
				}
			}
			_ = router.SendMulti(zmq4.NewMsgFrom(id, nil, EncodeSeq(EndSeq), nil))
		}
	}()
	return endpointOf(router.Addr(), "")
}

func TestReplayBoundsWhatItHolds(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	t.Run("bytes", func(t *testing.T) {
		const size, maxBytes = 64 << 10, 1 << 20
		msgs, err := Replay(ctx, floodingReplayEndpoint(t, 200, size), 0, ReplayConfig{MaxBytes: maxBytes, MaxMessageBytes: 2 * size})
		if !errors.Is(err, ErrReplayTooLarge) || len(msgs) != maxBytes/size {
			t.Fatalf("%d batches of %d bytes, err %v; want %d and ErrReplayTooLarge", len(msgs), size, err, maxBytes/size)
		}
	})
	t.Run("batches", func(t *testing.T) {
		msgs, err := Replay(ctx, floodingReplayEndpoint(t, 200, 10), 0, ReplayConfig{MaxBatches: 50})
		if !errors.Is(err, ErrReplayTooLarge) || len(msgs) != 50 {
			t.Fatalf("%d batches, err %v; want 50 and ErrReplayTooLarge", len(msgs), err)
		}
	})
	t.Run("within bounds", func(t *testing.T) {
		msgs, err := Replay(ctx, floodingReplayEndpoint(t, 50, 10), 0, ReplayConfig{MaxBatches: 50})
		if err != nil || len(msgs) != 50 {
			t.Fatalf("%d batches, err %v; want 50", len(msgs), err)
		}
	})
}

func TestPublisherSurvivesMalformedHandshakes(t *testing.T) {
	ready := func(metadata ...byte) []byte {
		body := append([]byte{5, 'R', 'E', 'A', 'D', 'Y'}, metadata...)
		return append(append(zmtptest.Greeting(), flagCommand, byte(len(body))), body...)
	}
	property := func(name, value string) []byte {
		p := append([]byte{byte(len(name))}, name...)
		p = binary.BigEndian.AppendUint32(p, uint32(len(value)))
		return append(p, value...)
	}
	for _, tc := range []struct {
		name string
		peer []byte // zmq4 alone panics on each
	}{
		{"name runs past the end", ready(2, 'a')},
		{"value length runs past the end", ready(property("Socket-Type", "SUB")[:15]...)},
		{"no socket type", ready(property("Identity", "x")...)},
		{"unknown socket type", ready(property("Socket-Type", "STREAM")...)},
		{"last socket type unknown", ready(append(property("Socket-Type", "SUB"), property("socket-type", "")...)...)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPublisher(t, PublisherConfig{})
			zmtptest.Send(t, p.Endpoint(), tc.peer)
			testwait.Until(t, testTimeout, "the peer is dropped", func() bool { return p.Stats().BadHandshakes == 1 })
			s := newSubscriber(t, SubscriberConfig{Endpoint: p.Endpoint()})
			join(t, func(int) { _, _ = p.Publish(probe) }, s.Messages())
		})
	}
}

// TestSlowReaderBoundsBufferedBytes: a publisher of large messages and a
// reader that does not keep up hold at most MaxBufferedBytes, and nothing
// is dropped.
func TestSlowReaderBoundsBufferedBytes(t *testing.T) {
	const size, budget, n = 10_000, 40_960, 50
	p := newPublisher(t, PublisherConfig{})
	s := newSubscriber(t, SubscriberConfig{Endpoint: p.Endpoint(), MaxMessageBytes: 2 * size, MaxBufferedBytes: budget})
	sent := join(t, func(int) { _, _ = p.Publish(probe) }, s.Messages())
	for i := range n {
		if _, err := p.Publish(bytes.Repeat([]byte{byte(i)}, size)); err != nil {
			t.Fatal(err)
		}
	}
	testwait.Until(t, testTimeout, "the buffer fills", func() bool { return s.Stats().BufferedBytes >= budget/size*size })
	for i := range n {
		if st := s.Stats(); st.BufferedBytes > budget {
			t.Fatalf("%d bytes buffered, bound %d", st.BufferedBytes, budget)
		}
		m := <-s.Messages()
		if m.Seq != uint64(sent+i) || len(m.Payload) != size || m.Payload[0] != byte(i) {
			t.Fatalf("message %d: seq %d, %d bytes; want seq %d", i, m.Seq, len(m.Payload), sent+i)
		}
	}
}

// TestStalledHandshakesAreClosed: zmq4 handshakes with one peer at a time
// and leaves the connection of a failed handshake open; a silent peer or
// one of the wrong socket type is disconnected after the handshake
// timeout, and the socket serves the next peer.
func TestStalledHandshakesAreClosed(t *testing.T) {
	ready := append(zmtptest.Greeting(), flagCommand, 28, 5, 'R', 'E', 'A', 'D', 'Y', 11)
	ready = append(ready, "Socket-Type"...)
	ready = append(ready, 0, 0, 0, 4, 'P', 'U', 'S', 'H')
	for _, tc := range []struct {
		name string
		peer []byte
	}{
		{"silent", nil},
		{"greeting only", zmtptest.Greeting()},
		{"incompatible socket type", ready},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newPublisher(t, PublisherConfig{handshakeTimeout: 100 * time.Millisecond})
			closed := zmtptest.Send(t, p.Endpoint(), tc.peer)
			select {
			case <-closed:
			case <-time.After(testTimeout):
				t.Fatal("the peer's connection is still open")
			}
			if st := p.Stats(); st.BadHandshakes != 1 {
				t.Fatalf("stats %+v: want 1 bad handshake", st)
			}
			s := newSubscriber(t, SubscriberConfig{Endpoint: p.Endpoint()})
			join(t, func(int) { _, _ = p.Publish(probe) }, s.Messages())
		})
	}
}

// TestSubscriberRedialsASilentPublisher: a publisher that accepts the
// connection and never greets does not hold the Subscriber forever.
func TestSubscriberRedialsASilentPublisher(t *testing.T) {
	p := newPublisher(t, PublisherConfig{})
	s := newSubscriber(t, SubscriberConfig{Endpoint: zmtptest.FirstThenProxy(t, nil, p.Endpoint()), handshakeTimeout: 100 * time.Millisecond})
	join(t, func(int) { _, _ = p.Publish(probe) }, s.Messages())
	if st := s.Stats(); st.BadHandshakes != 1 {
		t.Fatalf("stats %+v: want 1 bad handshake", st)
	}
}

// TestIPCEndpointsAreGuarded: ipc:// endpoints go through the guard too.
func TestIPCEndpointsAreGuarded(t *testing.T) {
	endpoint := "ipc://" + filepath.Join(t.TempDir(), "events.sock")
	p := newPublisher(t, PublisherConfig{Endpoint: endpoint})
	c, err := net.Dial("unix", strings.TrimPrefix(endpoint, "ipc://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write(hostile); err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, testTimeout, "the hostile peer is dropped", func() bool { return p.Stats().Oversized == 1 })
	s := newSubscriber(t, SubscriberConfig{Endpoint: endpoint})
	join(t, func(int) { _, _ = p.Publish(probe) }, s.Messages())
}
