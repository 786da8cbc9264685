package enginesource

import (
	"context"
	"fmt"
	"io"
	"log"
	"net"
	"sync"
	"testing"

	"github.com/go-zeromq/zmq4"

	"github.com/kvrouter/kvrouter/adapters/zmqevents"
)

// testPub is an engine under the test's full control: a PUB socket and,
// optionally, a replay ROUTER socket answering from its own ring, wire-exact
// with zmqevents.Publisher. Unlike it, a batch can be put into the ring
// without being sent (a message lost on the wire), the ring can be made
// short (replay too old), replay answers can be held back, and the sequence
// can restart at 0 (engine restart).
type testPub struct {
	pub, router zmq4.Socket
	cancel      context.CancelFunc
	wg          sync.WaitGroup
	keep        int
	hold        chan struct{} // non-nil: replay answers wait for it to close
	pubAt       string        // the PUB socket's endpoint

	mu   sync.Mutex
	next uint64
	ring []ringEntry // the last keep batches, oldest first
}

type ringEntry struct {
	seq     uint64
	payload []byte
}

type pubOpts struct {
	noReplay bool
	keep     int  // ring size; 0 = 10,000
	hold     bool // hold replay answers until release()
	late     bool // the PUB socket binds only at listen(): no subscriber can join before
}

func newTestPub(t testing.TB, o pubOpts) *testPub {
	t.Helper()
	if o.keep == 0 {
		o.keep = 10_000
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &testPub{cancel: cancel, keep: o.keep}
	if o.hold {
		p.hold = make(chan struct{})
	}
	quiet := zmq4.WithLogger(log.New(io.Discard, "", 0))
	p.pub = zmq4.NewPub(ctx, quiet)
	if err := p.pub.SetOption(zmq4.OptionHWM, 100_000); err != nil {
		t.Fatal(err)
	}
	if o.late {
		// A port free now; nothing listens on it until listen().
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		p.pubAt = endpoint(l.Addr())
		_ = l.Close()
	} else {
		p.listen(t)
	}
	if !o.noReplay {
		p.router = zmq4.NewRouter(ctx, quiet)
		if err := p.router.Listen("tcp://127.0.0.1:0"); err != nil {
			t.Fatal(err)
		}
		p.wg.Add(1)
		go p.serve(ctx)
	}
	t.Cleanup(p.close)
	return p
}

func endpoint(a net.Addr) string { return fmt.Sprintf("tcp://%s", a.String()) }

func (p *testPub) events() string { return p.pubAt }

// listen binds the PUB socket (of a late publisher: on its reserved port).
func (p *testPub) listen(t testing.TB) {
	t.Helper()
	at := p.pubAt
	if at == "" {
		at = "tcp://127.0.0.1:0"
	}
	if err := p.pub.Listen(at); err != nil {
		t.Fatal(err)
	}
	p.pubAt = endpoint(p.pub.Addr())
}

func (p *testPub) replay() string {
	if p.router == nil {
		return ""
	}
	return endpoint(p.router.Addr())
}

// publish appends a batch to the ring and, when send is set, sends it.
func (p *testPub) publish(t testing.TB, payload []byte, send bool) uint64 {
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	seq := p.next
	p.next++
	p.ring = append(p.ring, ringEntry{seq, payload})
	if len(p.ring) > p.keep {
		p.ring = p.ring[len(p.ring)-p.keep:]
	}
	if send {
		if err := p.pub.SendMulti(zmq4.NewMsgFrom(nil, zmqevents.EncodeSeq(seq), payload)); err != nil {
			t.Fatal(err)
		}
	}
	return seq
}

func (p *testPub) nextSeq() uint64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.next
}

// restart starts the sequence again at 0 with an empty ring, as a
// restarted engine would (the sockets stay, so subscribers stay connected).
func (p *testPub) restart() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.next, p.ring = 0, nil
}

func (p *testPub) release() { close(p.hold) }

func (p *testPub) serve(ctx context.Context) {
	defer p.wg.Done()
	for {
		msg, err := p.router.Recv()
		if ctx.Err() != nil {
			return
		}
		if err != nil || msg.Type == zmq4.CmdMsg || len(msg.Frames) != 3 {
			continue
		}
		id := msg.Frames[0]
		start, ok := zmqevents.DecodeSeq(msg.Frames[2])
		if !ok {
			continue
		}
		if p.hold != nil {
			select {
			case <-p.hold:
			case <-ctx.Done():
				return
			}
		}
		p.mu.Lock()
		var out []ringEntry
		for _, e := range p.ring {
			if e.seq >= start {
				out = append(out, e)
			}
		}
		p.mu.Unlock()
		for _, e := range out {
			_ = p.router.SendMulti(zmq4.NewMsgFrom(id, nil, zmqevents.EncodeSeq(e.seq), e.payload))
		}
		_ = p.router.SendMulti(zmq4.NewMsgFrom(id, nil, zmqevents.EncodeSeq(zmqevents.EndSeq), nil))
	}
}

func (p *testPub) close() {
	p.cancel()
	if p.router != nil {
		_ = p.router.Close()
	}
	_ = p.pub.Close()
	p.wg.Wait()
}
