package zmqevents

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"strings"
	"sync"
	"testing"

	"github.com/go-zeromq/zmq4"

	"github.com/kvrouter/kvrouter/internal/testwait"
)

// zmtpGreeting is a valid ZMTP 3.0 NULL-mechanism greeting.
func zmtpGreeting() []byte {
	g := make([]byte, zmtpGreetingLen)
	g[0], g[9], g[10], g[11] = 0xff, 0x7f, 3, 0
	copy(g[12:], "NULL")
	return g
}

// hugeHeader is a long frame header claiming 2^50 bytes: zmq4 v0.17 alone
// tries to allocate them and panics.
func hugeHeader(flags byte) []byte {
	h := make([]byte, 9)
	h[0] = flags | flagLong
	binary.BigEndian.PutUint64(h[1:], 1<<50)
	return h
}

var hostile = append(zmtpGreeting(), hugeHeader(0x04)...) // a command, as the handshake expects

// sendHostile connects to a listening socket and sends the greeting and
// the huge header; it returns the connection, closed by the test's end.
func sendHostile(t *testing.T, endpoint string) {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(endpoint, "tcp://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	if _, err := c.Write(hostile); err != nil {
		t.Fatal(err)
	}
	go func() { _, _ = io.Copy(io.Discard, c) }()
}

// hostileThenProxy listens on a free port: its first connection gets the
// hostile bytes, the later ones are piped to target, so a dialing socket
// meets a hostile peer first and a well-behaved one on its next attempt.
func hostileThenProxy(t *testing.T, target string) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	track := func(c net.Conn) {
		mu.Lock()
		conns = append(conns, c)
		mu.Unlock()
	}
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		for _, c := range conns {
			_ = c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; ; i++ {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			track(c)
			if i == 0 {
				_, _ = c.Write(hostile)
				wg.Add(1)
				go func() { defer wg.Done(); _, _ = io.Copy(io.Discard, c) }()
				continue
			}
			up, err := net.Dial("tcp", strings.TrimPrefix(target, "tcp://"))
			if err != nil {
				_ = c.Close()
				continue
			}
			track(up)
			wg.Add(2)
			go func() { defer wg.Done(); _, _ = io.Copy(up, c); _ = up.Close() }()
			go func() { defer wg.Done(); _, _ = io.Copy(c, up); _ = c.Close() }()
		}
	}()
	return "tcp://" + ln.Addr().String()
}

func TestSubscriberSurvivesHugeFrameHeader(t *testing.T) {
	p := newPublisher(t, PublisherConfig{})
	s := newSubscriber(t, SubscriberConfig{Endpoint: hostileThenProxy(t, p.Endpoint())})
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
	endpoint := hostileThenProxy(t, p.ReplayEndpoint())
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
		sendHostile(t, p.Endpoint())
		testwait.Until(t, testTimeout, "the hostile subscriber is dropped", func() bool { return p.Stats().Oversized == 1 })
		s := newSubscriber(t, SubscriberConfig{Endpoint: p.Endpoint()})
		join(t, func(int) { _, _ = p.Publish(probe) }, s.Messages())
	})
	t.Run("router", func(t *testing.T) {
		sendHostile(t, p.ReplayEndpoint())
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

func TestPublisherSurvivesMalformedHandshakeMetadata(t *testing.T) {
	p := newPublisher(t, PublisherConfig{})
	c, err := net.Dial("tcp", strings.TrimPrefix(p.Endpoint(), "tcp://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// A property name length that runs past the end: zmq4 alone indexes
	// beyond the slice and panics.
	ready := append(zmtpGreeting(), flagCommand, 8, 5, 'R', 'E', 'A', 'D', 'Y', 2, 'a')
	if _, err := c.Write(ready); err != nil {
		t.Fatal(err)
	}
	go func() { _, _ = io.Copy(io.Discard, c) }()
	testwait.Until(t, testTimeout, "the peer is dropped", func() bool { return p.Stats().BadHandshakes == 1 })
	s := newSubscriber(t, SubscriberConfig{Endpoint: p.Endpoint()})
	join(t, func(int) { _, _ = p.Publish(probe) }, s.Messages())
}
