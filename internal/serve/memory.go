package serve

import (
	"runtime"
	"runtime/debug"
	"sync"
	"time"
)

// reclaimer hands the memory of a burst of large requests back to the OS
// once the burst is over. Left alone, the Go runtime keeps a heap grown for
// a burst for minutes: the collector runs only as the program allocates
// (an idle router hardly does) and the scavenger returns pages slowly, so
// the process would hold its peak long after the load is gone. Forcing a
// collection costs a full mark of the heap, the index included, hence at
// most one reclaim every minGap.
type reclaimer struct {
	minGap time.Duration
	free   func() // debug.FreeOSMemory; replaced in tests

	mu      sync.Mutex // guards last and pending
	last    time.Time
	pending bool
}

func newReclaimer(minGap time.Duration) *reclaimer {
	return &reclaimer{minGap: minGap, free: freeOSMemory}
}

// freeOSMemory collects twice before releasing: what sync.Pools held when
// the burst ended survives one collection in their victim caches.
func freeOSMemory() {
	runtime.GC()
	debug.FreeOSMemory()
}

// request reclaims now, or at the end of the gap if one was just done; a
// request while one is pending joins it.
func (r *reclaimer) request() {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.pending {
		return
	}
	r.pending = true
	wait := max(r.minGap-time.Since(r.last), 0)
	time.AfterFunc(wait, func() {
		// A request from here on is a new burst's: it waits for the next
		// gap rather than joining this reclaim.
		r.mu.Lock()
		r.last, r.pending = time.Now(), false
		r.mu.Unlock()
		r.free()
	})
}
