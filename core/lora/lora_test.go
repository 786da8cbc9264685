package lora

import (
	"fmt"
	"slices"
	"testing"
)

func adapters(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("adapter-%d", i)
	}
	return out
}

func placement(names []string, engines []uint64) map[string]uint64 {
	out := map[string]uint64{}
	for _, a := range names {
		e, ok := Choose(a, engines)
		if !ok {
			panic("no engine")
		}
		out[a] = e
	}
	return out
}

func without(engines []uint64, gone uint64) []uint64 {
	return slices.DeleteFunc(slices.Clone(engines), func(e uint64) bool { return e == gone })
}

func TestChoiceMovesOnlyTheAdaptersOfAChangedEngine(t *testing.T) {
	names := adapters(400)
	engines := []uint64{1, 2, 3, 4, 5, 6, 7, 8}
	before := placement(names, engines)
	for _, tc := range []struct {
		name  string
		after []uint64
		// moved reports whether an adapter placed on from may move.
		moved func(from uint64) bool
	}{
		{"engine 3 removed", without(engines, 3), func(from uint64) bool { return from == 3 }},
		{"engine 8 removed", without(engines, 8), func(from uint64) bool { return from == 8 }},
		{"engine 9 added", append(slices.Clone(engines), 9), func(uint64) bool { return true }},
		{"engines reordered", []uint64{8, 7, 6, 5, 4, 3, 2, 1}, func(uint64) bool { return false }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			after := placement(names, tc.after)
			moved := 0
			for _, a := range names {
				if after[a] == before[a] {
					continue
				}
				moved++
				if !tc.moved(before[a]) {
					t.Fatalf("%s moved from engine %d to %d", a, before[a], after[a])
				}
				if slices.Contains(tc.after, before[a]) && after[a] != 9 {
					t.Fatalf("%s left engine %d, still present, for old engine %d", a, before[a], after[a])
				}
			}
			if tc.name == "engine 3 removed" && moved == 0 {
				t.Fatal("removing an engine moved no adapter: the placement ignores it")
			}
		})
	}
}

func TestChoiceSpreadsAdapters(t *testing.T) {
	engines := []uint64{1, 2, 3, 4}
	count := map[uint64]int{}
	for _, e := range placement(adapters(400), engines) {
		count[e]++
	}
	for _, e := range engines {
		if count[e] < 60 || count[e] > 140 {
			t.Fatalf("engine %d got %d of 400 adapters: %v", e, count[e], count)
		}
	}
}

func TestChooseWithoutEngines(t *testing.T) {
	if _, ok := Choose("a", nil); ok {
		t.Fatal("an adapter was placed on no engine")
	}
}

func TestScoreKeysNameAndEngine(t *testing.T) {
	if Score("ab", 1) == Score("ab", 2) || Score("ab", 1) == Score("ac", 1) {
		t.Fatal("the score ignores the adapter or the engine")
	}
	// Every router replica must compute the same placement: the score is
	// pinned, not only stable within a process.
	if got := Score("adapter-a", 7); got != scoreAdapterA7 {
		t.Fatalf("Score(adapter-a, 7) = %#x, want %#x", got, scoreAdapterA7)
	}
}

// scoreAdapterA7 is XXH3-64 of "adapter-a" followed by 7 as 8
// little-endian bytes.
const scoreAdapterA7 uint64 = 0x916f02c1bd88d307
