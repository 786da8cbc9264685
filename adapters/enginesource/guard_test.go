package enginesource

import (
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/internal/testwait"
	"github.com/kvrouter/kvrouter/internal/zmtptest"
)

// TestHostileEnginePeersAreDroppedAndTheSourceGoesOn: the events and the
// replay endpoint first answer with a frame header claiming 2^50 bytes
// (zmq4 alone panics on it); the source drops both connections, counts
// them, and follows the engine once it behaves.
func TestHostileEnginePeersAreDroppedAndTheSourceGoesOn(t *testing.T) {
	p := newTestPub(t, pubOpts{})
	r := newRouter(t, router.WorkerInfo{ID: 1})
	w := kv.Worker{ID: 1}
	a := toks(3, 9)
	p.publish(t, stored(t, nil, a, 500, 0, 1), false) // only replay has it
	s := start(t, Config{Worker: w, Events: zmtptest.FirstThenProxy(t, zmtptest.Hostile(), p.events()), Replay: zmtptest.FirstThenProxy(t, zmtptest.Hostile(), p.replay())}, r)
	// The live subscriber's counter moves without the source handling a
	// message, which is what WaitFor waits on.
	testwait.Until(t, 10*time.Second, "both hostile peers dropped", func() bool {
		st := s.Stats()
		return st.Oversized == 2 && st.ReplayErrors == 1
	})
	warmUp(t, p, s) // the live gap is filled by a second, well-behaved replay
	seq := p.publish(t, stored(t, nil, a, 500, 1, 3), true)
	wait(t, s, seq)
	if got := overlap(t, r, w, a); got != 3 {
		t.Fatalf("overlap %d, want 3 (stats %+v)", got, s.Stats())
	}
}
