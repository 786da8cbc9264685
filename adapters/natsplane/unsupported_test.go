package natsplane

import (
	"strconv"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/core/kv"
)

// The fields an agent reports become metric labels: however many it
// sends, and however long, the router keeps a bounded set of short ones,
// sums a worker's ranks, and forgets a rank that reports none.
func TestAgentsUnsupportedFieldsAreBounded(t *testing.T) {
	s := &Subscriber{unsupported: map[kv.Worker]map[string]uint64{}}
	flood := map[string]uint64{strings.Repeat("x", maxUnsupportedFieldLen+1): 5, "zero": 0}
	for i := range 10 * maxUnsupportedFields {
		flood["field"+strconv.Itoa(i)] = 1
	}
	s.noteUnsupported(kv.Worker{ID: 1}, flood)
	got := s.Unsupported(1)
	if len(got) != maxUnsupportedFields {
		t.Fatalf("%d fields kept, want %d", len(got), maxUnsupportedFields)
	}
	for field := range got {
		if !strings.HasPrefix(field, "field") {
			t.Fatalf("kept %q", field)
		}
	}
	s.noteUnsupported(kv.Worker{ID: 2}, map[string]uint64{"medium=unknown": 2})
	s.noteUnsupported(kv.Worker{ID: 2, DPRank: 1}, map[string]uint64{"medium=unknown": 3})
	if n := s.Unsupported(2)["medium=unknown"]; n != 5 {
		t.Fatalf("ranks summed to %d, want 5", n)
	}
	s.noteUnsupported(kv.Worker{ID: 2, DPRank: 1}, nil)
	if n := s.Unsupported(2)["medium=unknown"]; n != 2 {
		t.Fatalf("after rank 1 reported none: %d, want 2", n)
	}
	if s.Unsupported(3) != nil {
		t.Fatal("an unknown worker has fields")
	}
}
