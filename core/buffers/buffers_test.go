package buffers

import (
	"math/rand/v2"
	"slices"
	"testing"
)

// TestLongestAgainstModel keeps and takes buffers of random sizes and
// checks every answer against a plain model: the multiset of kept
// capacities.
func TestLongestAgainstModel(t *testing.T) {
	const most = 5
	rng := rand.New(rand.NewPCG(1, 2))
	var l Longest[int32]
	var model []int // kept capacities
	for step := range 20000 {
		if rng.IntN(2) == 0 {
			c := rng.IntN(40)
			l.Keep(make([]int32, rng.IntN(c+1), c), most)
			switch {
			case c == 0:
			case len(model) < most:
				model = append(model, c)
			default:
				i := slices.Index(model, slices.Min(model))
				if c > model[i] {
					model[i] = c
				}
			}
		} else {
			n := rng.IntN(45)
			got := l.Take(n)
			want := -1
			for i, c := range model {
				if c >= n && (want < 0 || c < model[want]) {
					want = i
				}
			}
			if want < 0 {
				if got != nil {
					t.Fatalf("step %d: Take(%d) = cap %d, want nil", step, n, cap(got))
				}
			} else {
				if got == nil || cap(got) != model[want] || len(got) != 0 {
					t.Fatalf("step %d: Take(%d) = len %d cap %d, want an empty one of cap %d", step, n, len(got), cap(got), model[want])
				}
				model = slices.Delete(model, want, want+1)
			}
		}
		caps := make([]int, 0, len(l))
		for _, x := range l {
			caps = append(caps, cap(x))
		}
		slices.Sort(caps)
		m := slices.Sorted(slices.Values(model))
		if !slices.Equal(caps, m) {
			t.Fatalf("step %d: kept %v, want %v", step, caps, m)
		}
	}
}

func BenchmarkLongestTakeKeep(b *testing.B) {
	var l Longest[uint64]
	for i := range 16 {
		l.Keep(make([]uint64, 0, 1024+64*i), 16)
	}
	i := 0
	for b.Loop() {
		x := l.Take(1024 + 64*(i%16))
		l.Keep(x, 16)
		i++
	}
}
