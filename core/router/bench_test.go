package router

import (
	"fmt"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/kv"
)

// BenchmarkBestWorkerBooked books, completes and frees 32-block requests
// over 16 workers whose caches hold them: with every worker's events
// arriving, and with one worker silent and routed by prediction.
func BenchmarkBestWorkerBooked(b *testing.B) {
	for _, silent := range []bool{false, true} {
		b.Run(fmt.Sprintf("silent_worker=%v", silent), func(b *testing.B) {
			t := &testing.T{}
			r, c := newRouter(t, 16, nil)
			prompts := make([][]uint32, 64)
			for i := range prompts {
				prompts[i] = tokens(i%8, 24, i, 32)
				wk := uint64(i % 16)
				if silent && wk == 15 {
					id := fmt.Sprint("warm-", i)
					if _, err := r.BestWorker(ctx(), &Request{ID: id, Tokens: prompts[i], Target: &kv.Worker{ID: wk}}); err != nil {
						b.Fatal(err)
					}
					r.MarkPrefillCompleted(id)
					r.Free(id)
					continue
				}
				store(t, r, w(wk), prompts[i])
			}
			c.advance(time.Minute)
			if silent && len(r.Eventless()) != 1 {
				b.Fatal("the silent worker is not routed by prediction")
			}
			ids := make([]string, 1024)
			for i := range ids {
				ids[i] = fmt.Sprint("req-", i)
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				id := ids[i%len(ids)]
				if _, err := r.BestWorker(ctx(), &Request{ID: id, Tokens: prompts[i%len(prompts)]}); err != nil {
					b.Fatal(err)
				}
				r.MarkPrefillCompleted(id)
				r.Free(id)
			}
		})
	}
}
