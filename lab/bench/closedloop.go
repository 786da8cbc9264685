package bench

import (
	"context"
	"sync"
	"sync/atomic"
	"time"
)

// Window is what a closed-loop run measured.
type Window[T any] struct {
	Samples  []T // one per call that succeeded inside the window
	Errors   int // calls that failed inside the window
	FirstErr error
	Elapsed  time.Duration // the window's length
}

// ClosedLoop keeps conc clients calling call back to back: a warmup first,
// whose calls are not counted, then a window of the given duration. A call
// counts only if it ended inside the window; call(ctx, client, i) is the
// client's i-th call. It returns when every client has stopped, or with
// ctx's error when ctx ended first.
func ClosedLoop[T any](ctx context.Context, conc int, warmup, duration time.Duration, call func(ctx context.Context, client, i int) (T, error)) (Window[T], error) {
	var (
		measuring atomic.Bool
		mu        sync.Mutex
		w         Window[T]
		wg        sync.WaitGroup
	)
	lctx, cancel := context.WithCancel(ctx)
	defer cancel()
	for c := range conc {
		wg.Go(func() {
			var mine []T
			for i := 0; lctx.Err() == nil; i++ {
				s, err := call(lctx, c, i)
				if lctx.Err() != nil || !measuring.Load() {
					continue
				}
				if err != nil {
					mu.Lock()
					if w.Errors++; w.FirstErr == nil {
						w.FirstErr = err
					}
					mu.Unlock()
					continue
				}
				mine = append(mine, s)
			}
			mu.Lock()
			w.Samples = append(w.Samples, mine...)
			mu.Unlock()
		})
	}
	sleep := func(d time.Duration) {
		select {
		case <-ctx.Done():
		case <-time.After(d):
		}
	}
	sleep(warmup)
	measuring.Store(true)
	start := time.Now()
	sleep(duration)
	measuring.Store(false)
	w.Elapsed = time.Since(start)
	cancel()
	wg.Wait()
	return w, ctx.Err()
}
