package router

import (
	"fmt"
	"testing"
)

// BenchmarkBestWorker times one booked decision (hash, match, score, book)
// and the release of the oldest in flight, on 64 workers, eight of which
// cache one of eight 64-block conversations; 128 requests stay in flight,
// half of them still waiting for prefill so the cost's queue terms are live.
func BenchmarkBestWorker(b *testing.B) {
	r, _ := newRouter(b, 64, nil)
	for c := range 8 {
		store(b, r, w(uint64(c*8)), tokens(c+1, 64, c+1, 64))
	}
	prompts := make([][]uint32, 512)
	ids := make([]string, len(prompts))
	for i := range prompts {
		prompts[i] = tokens(i%8+1, 64, 100+i, 80)
		ids[i] = fmt.Sprint("b", i)
	}
	ring := make([]string, 128)
	n := 0
	book := func() {
		slot := n % len(ring)
		if ring[slot] != "" {
			r.Free(ring[slot])
		}
		id := ids[n%len(ids)]
		if _, err := route(r, id, prompts[n%len(prompts)]); err != nil {
			b.Fatal(err)
		}
		if n%2 == 0 {
			r.MarkPrefillCompleted(id)
		}
		ring[slot] = id
		n++
	}
	for range len(ring) {
		book()
	}
	b.ReportAllocs()
	for b.Loop() {
		book()
	}
}
