package serve

import (
	"testing"
	"time"
)

// TestReclaimerSpacesCollections: requests within the gap join one pending
// reclaim, which runs at the end of the gap, not once per request.
func TestReclaimerSpacesCollections(t *testing.T) {
	freed := make(chan time.Time, 10)
	r := newReclaimer(200 * time.Millisecond)
	r.free = func() { freed <- time.Now() }
	r.request()
	first := <-freed
	for range 5 {
		r.request()
	}
	second := <-freed
	if gap := second.Sub(first); gap < 190*time.Millisecond {
		t.Fatalf("second reclaim %v after the first, want ≥ 200ms", gap)
	}
	select {
	case <-freed:
		t.Fatal("the requests within the gap were not joined into one reclaim")
	case <-time.After(400 * time.Millisecond):
	}
}
