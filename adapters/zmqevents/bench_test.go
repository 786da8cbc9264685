package zmqevents

import (
	"bytes"
	"encoding/binary"
	"testing"
	"time"
)

// BenchmarkZMTPGuard checks a stream of 3-frame event messages read the way
// zmq4 reads them: frame header, long size, body.
func BenchmarkZMTPGuard(b *testing.B) {
	var stream [][]byte // the reads of one message
	frame := func(flags byte, body []byte) {
		if len(body) > 255 {
			long := make([]byte, 8)
			binary.BigEndian.PutUint64(long, uint64(len(body)))
			stream = append(stream, []byte{flags | flagLong, long[0]}, long[1:])
		} else {
			stream = append(stream, []byte{flags, byte(len(body))})
		}
		stream = append(stream, body)
	}
	frame(flagMore, nil)
	frame(flagMore, EncodeSeq(1))
	frame(0, bytes.Repeat([]byte{1}, 1024))
	var size int64
	for _, r := range stream {
		size += int64(len(r))
	}
	g := newZMTPGuard(DefaultMaxMessageBytes)
	g.greeting = 0
	g.firstDone = true
	b.SetBytes(size)
	b.ReportAllocs()
	for b.Loop() {
		for _, r := range stream {
			if _, err := g.check(r); err != nil {
				b.Fatal(err)
			}
		}
	}
}

// BenchmarkPublishToSubscriber is the end-to-end event stream over TCP:
// 1 KiB batches from a Publisher to a Subscriber.
func BenchmarkPublishToSubscriber(b *testing.B) {
	p, err := NewPublisher(PublisherConfig{Endpoint: "tcp://127.0.0.1:0"})
	if err != nil {
		b.Fatal(err)
	}
	defer p.Close()
	s, err := NewSubscriber(SubscriberConfig{Endpoint: p.Endpoint(), RetryInterval: 20 * time.Millisecond})
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	join(b, func(int) { _, _ = p.Publish(probe) }, s.Messages())
	payload := bytes.Repeat([]byte{1}, 1024)
	b.SetBytes(int64(len(payload)))
	b.ResetTimer()
	const window = 256 // in flight at most, below any high-water mark
	received := 0
	for i := 0; i < b.N; i++ {
		if i-received >= window {
			<-s.Messages()
			received++
		}
		if _, err := p.Publish(payload); err != nil {
			b.Fatal(err)
		}
	}
	for ; received < b.N; received++ {
		<-s.Messages()
	}
}
