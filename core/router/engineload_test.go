package router

import (
	"fmt"
	"maps"
	"sync"
	"testing"

	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/sched"
)

func engineLoadsOf(r *Router) map[kv.Worker]sched.EngineLoad {
	if p := r.engineLoads.Load(); p != nil {
		return *p
	}
	return nil
}

func reportsFor(workers, round int) []EngineReport {
	out := make([]EngineReport, workers)
	for i := range out {
		out[i] = EngineReport{Worker: kv.Worker{ID: uint64(i / 2), DPRank: uint32(i % 2)},
			Load: sched.EngineLoad{Waiting: (i + round) % 5, Running: round % 3, KVUsage: float64((i*round)%7) / 7}}
	}
	return out
}

// A batch leaves the table as the same reports one at a time would, and a
// report that changes nothing leaves the published table untouched.
func TestEngineLoadsBatchMatchesOneAtATime(t *testing.T) {
	batched, single := &Router{}, &Router{}
	for round := range 6 {
		reps := reportsFor(7, round)
		if round == 3 {
			reps = append(reps, EngineReport{Worker: kv.Worker{ID: 1}, Load: sched.EngineLoad{Waiting: 99}})
		}
		if round == 4 {
			reps = reps[:0]
		}
		batched.SetEngineLoads(reps)
		for _, rep := range reps {
			single.SetEngineLoad(rep.Worker, rep.Load)
		}
		got, want := engineLoadsOf(batched), engineLoadsOf(single)
		if !maps.Equal(got, want) {
			t.Fatalf("round %d: batched %v, one at a time %v", round, got, want)
		}
		for w, l := range got {
			if !l.Known {
				t.Fatalf("round %d: %v recorded as never scraped", round, w)
			}
		}
	}
	before := batched.engineLoads.Load()
	batched.SetEngineLoads(reportsFor(7, 5))
	if batched.engineLoads.Load() != before {
		t.Fatal("reports that change nothing published a new table")
	}
}

// A poll of a fleet whose loads did not change costs nothing, and one that
// changed them all costs one copy of the table, not one per rank.
func TestEngineLoadsAllocations(t *testing.T) {
	r := &Router{}
	reps := reportsFor(1000, 1)
	r.SetEngineLoads(reps)
	if a := testing.AllocsPerRun(100, func() {
		for _, rep := range reps {
			r.SetEngineLoad(rep.Worker, rep.Load)
		}
	}); a != 0 {
		t.Fatalf("unchanged reports allocated %.0f times, want 0", a)
	}
	round := 1
	if a := testing.AllocsPerRun(20, func() {
		round++
		for i := range reps {
			reps[i].Load.Waiting = round
		}
		r.SetEngineLoads(reps)
	}); a > 20 {
		// A copy of a 1000-entry map is a few tables, one per rank is 1000s.
		t.Fatalf("a changed fleet of 1000 ranks allocated %.0f times, want one copy of the table", a)
	}
}

// Decisions read the table while reports arrive; run under -race.
func TestEngineLoadsReadWhileWritten(t *testing.T) {
	r := &Router{}
	var wg sync.WaitGroup
	for g := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for round := range 200 {
				r.SetEngineLoads(reportsFor(16, round+g))
			}
		}()
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for range 200 {
			m := engineLoadsOf(r)
			n := 0
			for _, l := range m {
				if l.Known {
					n++
				}
			}
			if n != len(m) {
				t.Errorf("a published table holds %d unknown reports", len(m)-n)
				return
			}
		}
	}()
	wg.Wait()
	if n := len(engineLoadsOf(r)); n != 16 {
		t.Fatalf("%d ranks recorded, want 16", n)
	}
}

// BenchmarkEngineLoads is one poll of the fleet: every rank's report, one
// call per rank or one batch, with every load changed since the last poll.
func BenchmarkEngineLoads(b *testing.B) {
	for _, workers := range []int{8, 1000} {
		for _, batch := range []bool{false, true} {
			b.Run(fmt.Sprintf("workers=%d/batch=%v", workers, batch), func(b *testing.B) {
				r := &Router{}
				reps := reportsFor(workers, 0)
				b.ReportAllocs()
				for i := range b.N {
					for j := range reps {
						reps[j].Load.Waiting = i
					}
					if batch {
						r.SetEngineLoads(reps)
						continue
					}
					for _, rep := range reps {
						r.SetEngineLoad(rep.Worker, rep.Load)
					}
				}
			})
		}
	}
}
