// Package zmqevents is the ZeroMQ transport of engine KV events, wire-exact
// with vLLM's ZmqEventPublisher (SPEC §3.2): a PUB socket streams 3-frame
// messages [topic, seq, payload] where seq is an 8-byte big-endian counter
// from 0 and payload an opaque batch (see package vllmevents); an optional
// ROUTER socket replays the last N batches on request. It uses the pure-Go
// github.com/go-zeromq/zmq4 (no cgo, no libzmq).
//
// Publisher is the engine side (the mocker and tests use it); Subscriber and
// Replay are the router side.
//
// # Replay protocol
//
// A client sends one request to the ROUTER: the 8-byte big-endian start
// sequence, optionally preceded by an empty delimiter frame (REQ sockets and
// vLLM's own clients send it; vLLM's publisher requires it). The server
// answers, for every buffered batch with seq >= start in order, [seq,
// payload], then the end marker [0xffffffffffffffff, ""] (seq -1). A reply
// starts with an empty delimiter exactly when the request had one, so REQ,
// DEALER and vLLM-style clients all parse it. With ReplayWithTopic the
// replies are [topic, seq, payload] (the newer shape).
//
// # zmq4 behaviour worth knowing
//
//   - PUB drops messages no subscriber is connected for (the ZeroMQ slow
//     joiner): a subscriber misses what is published before its
//     subscription reaches the publisher; the sequence gap and Replay cover
//     that.
//   - The subscriber connects in the background and retries forever until
//     the publisher is up; after a disconnect it redials (250 ms between
//     attempts) and resends the subscription. Batches published meanwhile
//     are lost: they appear as a gap, or as a sequence reset if the engine
//     restarted.
//   - zmq4 allocates whatever size a frame header announces and panics on
//     some malformed handshakes. Every socket of this package therefore
//     runs on a guarded transport (registered with zmq4 for tcp:// and
//     ipc:// endpoints, which are mapped to it): a ZMTP 3.x parser on the
//     inbound bytes fails the read, and so drops the peer, when a frame
//     would take its message above the maximum (MaxMessageBytes, like
//     libzmq's ZMQ_MAXMSGSIZE; DefaultMaxMessageBytes), when a message has
//     more than 1,024 frames, or when the handshake does not start with a
//     single READY command of well-formed metadata and a known socket type.
//     zmq4 handshakes with one peer at a time and leaves the connection of
//     a failed handshake open: a connection whose handshake is not done
//     within 10 s is closed. Dropped peers are counted (Stats().Oversized,
//     Stats().BadHandshakes) and logged at most every 10 s per socket.
//     Replay bounds what it collects (ReplayConfig), a Subscriber what
//     waits for its reader (SubscriberConfig.MaxBufferedBytes).
//   - zmq4 v0.17 leaves one idle goroutine per closed PUB socket (its
//     writer loop is not stopped by Close); everything this package starts
//     itself stops in Close.
package zmqevents

import (
	"encoding/binary"
	"errors"
	"math"
)

// EndSeq is the sequence number of the replay end marker (-1 as int64).
const EndSeq uint64 = math.MaxUint64

// DefaultBufferSize is how many batches a Publisher keeps for replay,
// vLLM's buffer_steps.
const DefaultBufferSize = 10_000

// ErrClosed is returned by operations on a closed Publisher or Subscriber.
var ErrClosed = errors.New("zmqevents: closed")

// Message is one received batch.
type Message struct {
	Topic   []byte
	Seq     uint64
	Payload []byte
	// Missed is, on a Subscriber, how many sequence numbers were skipped
	// right before this message (Seq-(last+1)); 0 when in order. Replay
	// from Seq-Missed recovers them while the publisher still buffers them.
	Missed uint64
	// Reset is, on a Subscriber, true when Seq is not above the previous
	// sequence number: the publisher restarted (seq begins again at 0) or
	// repeated itself. Whatever the consumer knew of that engine is stale.
	Reset bool
}

// EncodeSeq returns seq as the 8-byte big-endian frame.
func EncodeSeq(seq uint64) []byte {
	var b [8]byte
	binary.BigEndian.PutUint64(b[:], seq)
	return b[:]
}

// DecodeSeq reads an 8-byte big-endian frame; ok is false for any other length.
func DecodeSeq(frame []byte) (seq uint64, ok bool) {
	if len(frame) != 8 {
		return 0, false
	}
	return binary.BigEndian.Uint64(frame), true
}
