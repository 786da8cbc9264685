package enginesource

import (
	"testing"

	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
)

// BenchmarkLiveBatches measures a rank's live path end to end: ZMQ
// delivery, decoding and applying a one-block batch.
func BenchmarkLiveBatches(b *testing.B) {
	p := newTestPub(b, pubOpts{})
	r, err := router.New(router.DefaultConfig())
	if err != nil {
		b.Fatal(err)
	}
	r.AddWorker(router.WorkerInfo{ID: 1})
	s, err := Start(b.Context(), Config{Worker: kv.Worker{ID: 1}, Events: p.events(), Replay: p.replay()}, r)
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	warmUp(b, p, s)
	a := toks(b.N+1, 16)
	b.ResetTimer()
	var last uint64
	for i := range b.N {
		last = p.publish(b, stored(b, nil, a, 1600, i, i+1), true)
	}
	wait(b, s, last)
}
