package zmqevents

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"runtime"
	"testing"
	"time"

	"github.com/go-zeromq/zmq4"
)

const testTimeout = 10 * time.Second

var probe = []byte("probe")

func newPublisher(t *testing.T, cfg PublisherConfig) *Publisher {
	t.Helper()
	if cfg.Endpoint == "" {
		cfg.Endpoint = "tcp://127.0.0.1:0"
	}
	p, err := NewPublisher(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

func newSubscriber(t *testing.T, cfg SubscriberConfig) *Subscriber {
	t.Helper()
	if cfg.RetryInterval == 0 {
		cfg.RetryInterval = 20 * time.Millisecond
	}
	s, err := NewSubscriber(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// join beats the ZeroMQ slow joiner: it sends probes in a bounded loop
// until one arrives on got, and returns how many it sent. Every probe sent
// after the first received one is delivered too (one TCP stream).
func join(t testing.TB, send func(i int), got <-chan Message) int {
	t.Helper()
	deadline := time.After(testTimeout)
	for i := 0; ; i++ {
		send(i)
		select {
		case m := <-got:
			if !bytes.Equal(m.Payload, probe) {
				t.Fatalf("unexpected message before join: %+v", m)
			}
			return i + 1
		case <-time.After(50 * time.Millisecond):
		case <-deadline:
			t.Fatal("subscriber never joined")
		}
	}
}

// next returns the next non-probe message.
func next(t *testing.T, ch <-chan Message) Message {
	t.Helper()
	deadline := time.After(testTimeout)
	for {
		select {
		case m, ok := <-ch:
			if !ok {
				t.Fatal("channel closed")
			}
			if !bytes.Equal(m.Payload, probe) {
				return m
			}
		case <-deadline:
			t.Fatal("timed out waiting for a message")
		}
	}
}

func TestSeqFrames(t *testing.T) {
	if got := EncodeSeq(0x0102030405060708); !bytes.Equal(got, []byte{1, 2, 3, 4, 5, 6, 7, 8}) {
		t.Fatalf("EncodeSeq = %x", got)
	}
	if got := EncodeSeq(EndSeq); !bytes.Equal(got, []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}) {
		t.Fatalf("EncodeSeq(EndSeq) = %x", got)
	}
	if s, ok := DecodeSeq([]byte{0, 0, 0, 0, 0, 0, 1, 0}); !ok || s != 256 {
		t.Fatalf("DecodeSeq = %d, %v", s, ok)
	}
	for _, n := range []int{0, 7, 9} {
		if _, ok := DecodeSeq(make([]byte, n)); ok {
			t.Fatalf("DecodeSeq accepted %d bytes", n)
		}
	}
}

// rawSub is a bare zmq4 SUB socket whose messages go to a channel.
func rawSub(t *testing.T, endpoint string) <-chan zmq4.Msg {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	sub := zmq4.NewSub(ctx)
	if err := sub.SetOption(zmq4.OptionSubscribe, ""); err != nil {
		t.Fatal(err)
	}
	if err := sub.Dial(endpoint); err != nil {
		t.Fatal(err)
	}
	ch := make(chan zmq4.Msg, 1024)
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer close(ch)
		for {
			m, err := sub.Recv()
			if err != nil {
				if ctx.Err() != nil {
					return
				}
				continue
			}
			select {
			case ch <- m:
			case <-ctx.Done():
				return
			}
		}
	}()
	t.Cleanup(func() { cancel(); sub.Close(); <-done })
	return ch
}

func TestPublishWireFormat(t *testing.T) {
	p := newPublisher(t, PublisherConfig{Topic: "kv"})
	if seq, err := p.Publish([]byte("nobody listens")); err != nil || seq != 0 {
		t.Fatalf("first Publish = %d, %v; want seq 0", seq, err)
	}
	raw := rawSub(t, p.Endpoint())
	got := make(chan Message, 1024)
	go func() {
		for m := range raw {
			if len(m.Frames) != 3 {
				t.Errorf("message of %d frames", len(m.Frames))
				continue
			}
			if string(m.Frames[2]) == "nobody listens" {
				// The socket may still be writing it out when this
				// subscriber joins; that it arrives is the transport's
				// business, not the format's.
				continue
			}
			s, _ := DecodeSeq(m.Frames[1])
			got <- Message{Topic: m.Frames[0], Seq: s, Payload: m.Frames[2]}
		}
	}()
	join(t, func(int) { p.Publish(probe) }, got)
	seq, err := p.Publish([]byte("hello"))
	if err != nil {
		t.Fatal(err)
	}
	if seq >= 256 {
		t.Fatalf("seq %d: too many probes", seq)
	}
	m := next(t, got)
	want := []byte{0, 0, 0, 0, 0, 0, 0, byte(seq)} // 8 bytes, big-endian
	if string(m.Topic) != "kv" || !bytes.Equal(EncodeSeq(m.Seq), want) || m.Seq != seq || string(m.Payload) != "hello" {
		t.Fatalf("got topic %q seq %d payload %q, want kv %x hello", m.Topic, m.Seq, m.Payload, want)
	}
	if next := p.NextSeq(); next != seq+1 {
		t.Fatalf("NextSeq = %d, want %d", next, seq+1)
	}
}

// rawPub is a bare zmq4 PUB socket bound to a free port.
func rawPub(t *testing.T) (zmq4.Socket, string) {
	t.Helper()
	pub := zmq4.NewPub(context.Background())
	if err := pub.Listen("tcp://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pub.Close() })
	return pub, endpointOf(pub.Addr(), "")
}

func send(t *testing.T, s zmq4.Socket, frames ...[]byte) {
	t.Helper()
	if err := s.SendMulti(zmq4.NewMsgFrom(frames...)); err != nil {
		t.Fatal(err)
	}
}

func TestSubscriberSkipsMalformed(t *testing.T) {
	pub, ep := rawPub(t)
	s := newSubscriber(t, SubscriberConfig{Endpoint: ep})
	n := join(t, func(i int) { send(t, pub, nil, EncodeSeq(uint64(i)), probe) }, s.Messages())
	send(t, pub, nil, EncodeSeq(uint64(n)))                           // 2 frames
	send(t, pub, nil, EncodeSeq(uint64(n)), []byte("x"), []byte("y")) // 4 frames
	send(t, pub, []byte("x"))                                         // 1 frame
	send(t, pub, nil, make([]byte, 7), []byte("x"))                   // short seq
	send(t, pub, nil, make([]byte, 9), []byte("x"))                   // long seq
	send(t, pub, nil, EncodeSeq(uint64(n)), []byte("after"))
	m := next(t, s.Messages())
	if string(m.Payload) != "after" || m.Seq != uint64(n) || m.Missed != 0 || m.Reset {
		t.Fatalf("got %+v", m)
	}
	st := s.Stats()
	if st.Malformed != 5 || st.Gaps != 0 || st.Resets != 0 {
		t.Fatalf("stats %+v, want 5 malformed and no gap", st)
	}
}

func TestSubscriberGapAndReset(t *testing.T) {
	pub, ep := rawPub(t)
	s := newSubscriber(t, SubscriberConfig{Endpoint: ep, Topic: "kv"})
	n := uint64(join(t, func(i int) { send(t, pub, []byte("kv"), EncodeSeq(uint64(i)), probe) }, s.Messages()))
	send(t, pub, []byte("other"), EncodeSeq(n+100), []byte("filtered by topic"))
	send(t, pub, []byte("kv"), EncodeSeq(n), []byte("a"))
	send(t, pub, []byte("kv"), EncodeSeq(n+3), []byte("b")) // n+1, n+2 lost
	send(t, pub, []byte("kv"), EncodeSeq(n+4), []byte("c"))
	send(t, pub, []byte("kv2"), EncodeSeq(0), []byte("d")) // prefix match; engine restart
	want := []Message{
		{Seq: n, Payload: []byte("a")},
		{Seq: n + 3, Payload: []byte("b"), Missed: 2},
		{Seq: n + 4, Payload: []byte("c")},
		{Seq: 0, Payload: []byte("d"), Reset: true},
	}
	for i, w := range want {
		m := next(t, s.Messages())
		if m.Seq != w.Seq || !bytes.Equal(m.Payload, w.Payload) || m.Missed != w.Missed || m.Reset != w.Reset {
			t.Fatalf("message %d = %+v, want %+v", i, m, w)
		}
	}
	st := s.Stats()
	if st.Gaps != 1 || st.Missed != 2 || st.Resets != 1 || st.Malformed != 0 {
		t.Fatalf("stats %+v", st)
	}
}

// The subscriber starts before the publisher binds, and uses a Handler.
func TestSubscriberBeforePublisherWithHandler(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ep := "tcp://" + l.Addr().String()
	l.Close()
	got := make(chan Message, 1024)
	s := newSubscriber(t, SubscriberConfig{Endpoint: ep, Handler: func(m Message) { got <- m }})
	if s.Messages() != nil {
		t.Fatal("Messages() not nil with a Handler")
	}
	p := newPublisher(t, PublisherConfig{Endpoint: ep})
	join(t, func(int) { p.Publish(probe) }, got)
	first, _ := p.Publish([]byte("0"))
	for i := 1; i < 100; i++ {
		p.Publish([]byte(fmt.Sprint(i)))
	}
	for i := 0; i < 100; i++ {
		m := next(t, got)
		if m.Seq != first+uint64(i) || string(m.Payload) != fmt.Sprint(i) || m.Missed != 0 {
			t.Fatalf("message %d = %+v", i, m)
		}
	}
}

func replayPublisher(t *testing.T, cfg PublisherConfig) *Publisher {
	t.Helper()
	cfg.ReplayEndpoint = "tcp://127.0.0.1:0"
	cfg.BufferSize = 5
	p := newPublisher(t, cfg)
	for i := 0; i < 8; i++ {
		if seq, err := p.Publish([]byte(fmt.Sprintf("p%d", i))); err != nil || seq != uint64(i) {
			t.Fatalf("Publish = %d, %v", seq, err)
		}
	}
	return p
}

func TestReplayRanges(t *testing.T) {
	p := replayPublisher(t, PublisherConfig{})
	if oldest, next := p.Buffered(); oldest != 3 || next != 8 {
		t.Fatalf("Buffered = [%d, %d), want [3, 8): ring not bounded", oldest, next)
	}
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	for _, tc := range []struct{ start, first, end uint64 }{
		{5, 5, 8},   // middle
		{0, 3, 8},   // before the oldest: what the ring still has
		{3, 3, 8},   // exactly the oldest
		{7, 7, 8},   // newest only
		{8, 8, 8},   // next: end marker only
		{100, 8, 8}, // beyond: end marker only
	} {
		msgs, err := Replay(ctx, p.ReplayEndpoint(), tc.start, ReplayConfig{})
		if err != nil {
			t.Fatalf("Replay(%d): %v", tc.start, err)
		}
		if uint64(len(msgs)) != tc.end-tc.first {
			t.Fatalf("Replay(%d) returned %d batches, want %d", tc.start, len(msgs), tc.end-tc.first)
		}
		for i, m := range msgs {
			s := tc.first + uint64(i)
			if m.Seq != s || string(m.Payload) != fmt.Sprintf("p%d", s) {
				t.Fatalf("Replay(%d)[%d] = %d %q", tc.start, i, m.Seq, m.Payload)
			}
		}
	}
	if st := p.Stats(); st.ReplayRequests != 6 || st.ReplaySent != 3+5+5+1 || st.Published != 8 {
		t.Fatalf("stats %+v", st)
	}
}

func TestReplayWithTopic(t *testing.T) {
	p := replayPublisher(t, PublisherConfig{Topic: "kv", ReplayWithTopic: true})
	ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
	defer cancel()
	msgs, err := Replay(ctx, p.ReplayEndpoint(), 6, ReplayConfig{})
	if err != nil || len(msgs) != 2 || string(msgs[0].Topic) != "kv" || msgs[0].Seq != 6 || string(msgs[1].Payload) != "p7" {
		t.Fatalf("Replay = %+v, %v", msgs, err)
	}
}

// rawDealer returns a DEALER connected to endpoint and a receive function.
func rawDealer(t *testing.T, endpoint string) (zmq4.Socket, func() [][]byte) {
	t.Helper()
	d := zmq4.NewDealer(context.Background())
	if err := d.Dial(endpoint); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	recv := func() [][]byte {
		t.Helper()
		ch := make(chan zmq4.Msg, 1)
		go func() { m, _ := d.Recv(); ch <- m }()
		select {
		case m := <-ch:
			return m.Frames
		case <-time.After(testTimeout):
			t.Fatal("no reply")
			return nil
		}
	}
	return d, recv
}

func framesEqual(a, b [][]byte) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if !bytes.Equal(a[i], b[i]) {
			return false
		}
	}
	return true
}

func TestReplayWireShapes(t *testing.T) {
	end := []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}
	for _, tc := range []struct {
		name      string
		withTopic bool
		request   [][]byte
		prefix    [][]byte
	}{
		{"dealer", false, [][]byte{{0, 0, 0, 0, 0, 0, 0, 6}}, nil},
		{"req-delimiter", false, [][]byte{{}, {0, 0, 0, 0, 0, 0, 0, 6}}, [][]byte{{}}},
		{"topic", true, [][]byte{{0, 0, 0, 0, 0, 0, 0, 6}}, [][]byte{[]byte("kv")}},
		{"topic-delimiter", true, [][]byte{{}, {0, 0, 0, 0, 0, 0, 0, 6}}, [][]byte{{}, []byte("kv")}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := replayPublisher(t, PublisherConfig{Topic: "kv", ReplayWithTopic: tc.withTopic})
			d, recv := rawDealer(t, p.ReplayEndpoint())
			send(t, d, []byte{0, 0, 0, 0, 0, 0, 6})    // 7-byte start: ignored
			send(t, d, []byte{}, []byte{1}, []byte{2}) // 3 frames: ignored
			send(t, d, tc.request...)
			want := [][][]byte{
				append(append([][]byte{}, tc.prefix...), []byte{0, 0, 0, 0, 0, 0, 0, 6}, []byte("p6")),
				append(append([][]byte{}, tc.prefix...), []byte{0, 0, 0, 0, 0, 0, 0, 7}, []byte("p7")),
				append(append([][]byte{}, tc.prefix...), end, []byte{}),
			}
			for i, w := range want {
				if got := recv(); !framesEqual(got, w) {
					t.Fatalf("reply %d = %q, want %q", i, got, w)
				}
			}
			if st := p.Stats(); st.ReplayInvalid != 2 || st.ReplayRequests != 1 {
				t.Fatalf("stats %+v", st)
			}
		})
	}
}

func TestReplayDeadline(t *testing.T) {
	// A ROUTER that never answers.
	r := zmq4.NewRouter(context.Background())
	if err := r.Listen("tcp://127.0.0.1:0"); err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	msgs, err := Replay(ctx, endpointOf(r.Addr(), ""), 0, ReplayConfig{})
	if !errors.Is(err, context.DeadlineExceeded) || len(msgs) != 0 {
		t.Fatalf("Replay = %v, %v; want DeadlineExceeded", msgs, err)
	}
}

func TestCloseStopsEverything(t *testing.T) {
	before := runtime.NumGoroutine()
	for i := 0; i < 3; i++ {
		p, err := NewPublisher(PublisherConfig{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0"})
		if err != nil {
			t.Fatal(err)
		}
		s, err := NewSubscriber(SubscriberConfig{Endpoint: p.Endpoint(), RetryInterval: 20 * time.Millisecond})
		if err != nil {
			t.Fatal(err)
		}
		join(t, func(int) { p.Publish(probe) }, s.Messages())
		ctx, cancel := context.WithTimeout(context.Background(), testTimeout)
		if _, err := Replay(ctx, p.ReplayEndpoint(), 0, ReplayConfig{}); err != nil {
			t.Fatal(err)
		}
		cancel()
		if err := s.Close(); err != nil {
			t.Fatal(err)
		}
		if err := s.Close(); err != nil {
			t.Fatal("second Close:", err)
		}
		for range s.Messages() { // closed after Close: drains and ends
		}
		if err := p.Close(); err != nil {
			t.Fatal(err)
		}
		if err := p.Close(); err != nil {
			t.Fatal("second Close:", err)
		}
		if _, err := p.Publish(nil); !errors.Is(err, ErrClosed) {
			t.Fatalf("Publish after Close: %v", err)
		}
	}
	// zmq4 v0.17 leaves one parked writer goroutine per closed PUB socket;
	// everything else must be gone. Connection goroutines exit
	// asynchronously, hence the bounded wait.
	const allowed = 3
	deadline := time.Now().Add(testTimeout)
	for {
		n := runtime.NumGoroutine()
		if n <= before+allowed {
			return
		}
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<20)
			t.Fatalf("%d goroutines, started with %d (+%d allowed)\n%s", n, before, allowed, buf[:runtime.Stack(buf, true)])
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// OnJoin is called once per connection, before anything is received on
// it, and again after a redial.
func TestSubscriberOnJoinPrecedesTheConnectionsMessages(t *testing.T) {
	p := newPublisher(t, PublisherConfig{})
	ep := p.Endpoint()
	joins := make(chan uint64, 16) // Received when each join was reported
	var s *Subscriber
	ready := make(chan struct{})
	s = newSubscriber(t, SubscriberConfig{Endpoint: ep, OnJoin: func() {
		<-ready
		joins <- s.Stats().Received
	}})
	close(ready)
	select {
	case n := <-joins:
		if n != 0 {
			t.Fatalf("join reported after %d messages", n)
		}
	case <-time.After(testTimeout):
		t.Fatal("no join reported")
	}
	join(t, func(int) { p.Publish(probe) }, s.Messages())
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
	p2 := newPublisher(t, PublisherConfig{Endpoint: ep})
	select {
	case <-joins:
	case <-time.After(testTimeout):
		t.Fatal("no join reported after the redial")
	}
	join(t, func(int) { p2.Publish(probe) }, s.Messages())
}
