package router

import (
	"testing"

	"github.com/kvrouter/kvrouter/core/kv"
)

// A salted request stored over three events (its first block salted, the
// next ones naming their parent), a second request continuing a shared
// salted prefix, an unsalted chain beside them, removals and a clear.
func TestSaltChainsInheritTheParentsSalt(t *testing.T) {
	c := NewSaltChains(100)
	steps := []struct {
		parent *uint64
		hashes []uint64
		own    string
		want   string
	}{
		{nil, []uint64{1, 2}, "a", "a"},
		{kv.Ptr(uint64(2)), []uint64{3}, "", "a"},
		{kv.Ptr(uint64(3)), []uint64{4, 5}, "", "a"},
		{kv.Ptr(uint64(1)), []uint64{6}, "", "a"}, // another turn branching off block 1
		{nil, []uint64{10, 11}, "", ""},
		{kv.Ptr(uint64(11)), []uint64{12}, "", ""},
		{kv.Ptr(uint64(99)), []uint64{13}, "", ""}, // parent never seen
		{nil, []uint64{20}, "b", "b"},
		{kv.Ptr(uint64(20)), []uint64{21}, "", "b"},
	}
	for i, s := range steps {
		if got := c.Stored(s.parent, s.hashes, s.own); got != s.want {
			t.Fatalf("event %d: salt %q, want %q", i, got, s.want)
		}
	}
	if c.Len() != 8 {
		t.Fatalf("%d salted blocks remembered, want 8 (unsalted ones are not)", c.Len())
	}
	c.Removed([]uint64{5, 10})
	if got := c.Stored(kv.Ptr(uint64(5)), []uint64{30}, ""); got != "" {
		t.Fatalf("continuation of a removed block: salt %q", got)
	}
	if got := c.Stored(kv.Ptr(uint64(4)), []uint64{31}, ""); got != "a" {
		t.Fatalf("continuation after a sibling's removal: salt %q", got)
	}
	c.Clear()
	if got := c.Stored(kv.Ptr(uint64(4)), []uint64{32}, ""); got != "" || c.Len() != 0 {
		t.Fatalf("after a clear: salt %q, %d remembered", got, c.Len())
	}
}

func TestSaltChainsAreBounded(t *testing.T) {
	c := NewSaltChains(3)
	c.Stored(nil, []uint64{1, 2, 3, 4, 5}, "a")
	if c.Len() != 3 || c.Full != 2 {
		t.Fatalf("len %d full %d, want 3 and 2", c.Len(), c.Full)
	}
	if got := c.Stored(kv.Ptr(uint64(5)), []uint64{6}, ""); got != "" {
		t.Fatalf("a block not remembered passed its salt on: %q", got)
	}
}
