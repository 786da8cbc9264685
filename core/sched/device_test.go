package sched

import (
	"math"
	"math/rand/v2"
	"testing"
)

// fleet builds candidates from in-flight request counts; cpu marks the
// CPU workers. Their block loads rank them the other way round, which the
// mode must not read.
func fleet(inflight []int, cpu []bool) []Candidate {
	out := make([]Candidate, len(inflight))
	for i, n := range inflight {
		out[i] = Candidate{Worker: worker(uint64(i + 1)), ActiveRequests: n, CPU: cpu[i], ActiveDecodeBlocks: float64(-n)}
	}
	return out
}

func TestDeviceAwareWeightedPicks(t *testing.T) {
	const C, G = true, false
	for _, tc := range []struct {
		name     string
		ratio    int
		inflight []int
		cpu      []bool
		want     []int // acceptable indexes
	}{
		{"accelerators only: fewest in flight", 8, []int{3, 1, 2}, []bool{G, G, G}, []int{1}},
		{"CPUs only: fewest in flight", 8, []int{3, 1, 2}, []bool{C, C, C}, []int{1}},
		{"idle mixed fleet starts on the accelerator", 8, []int{0, 0}, []bool{C, G}, []int{1}},
		{"accelerator below the ratio keeps the request", 8, []int{0, 7}, []bool{C, G}, []int{1}},
		{"accelerator at the ratio sends it to the CPU", 8, []int{0, 8}, []bool{C, G}, []int{0}},
		{"CPU under its budget of 2", 8, []int{1, 16}, []bool{C, G}, []int{0}},
		{"CPU at its budget of 2", 8, []int{2, 16}, []bool{C, G}, []int{1}},
		{"request counts, not blocks, and the budget scales with the CPUs", 2, []int{1, 0, 2, 2, 2}, []bool{C, C, G, G, G}, []int{1}},
		{"the accelerator side picks its least loaded", 2, []int{2, 2, 5, 3, 4}, []bool{C, C, G, G, G}, []int{3}},
		{"ratio 1 is least-loaded across kinds", 1, []int{2, 2, 3}, []bool{C, G, G}, []int{1}},
		{"ties within a side are either", 1, []int{0, 4, 4}, []bool{G, C, C}, []int{0}},
		{"ties on the accelerator side", 4, []int{0, 1, 1}, []bool{C, G, G}, []int{1, 2}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := mustNew(t, ModeDeviceAwareWeighted, nil)
			if err := s.SetNonCPUToCPURatio(tc.ratio); err != nil {
				t.Fatal(err)
			}
			cands := fleet(tc.inflight, tc.cpu)
			seen := map[int]bool{}
			rng := rand.New(rand.NewPCG(3, 4))
			for range 64 {
				c, err := s.Select(&Request{BlockSize: 16, Commit: true}, cands, rng)
				if err != nil {
					t.Fatal(err)
				}
				seen[c.Index] = true
			}
			for i := range seen {
				ok := false
				for _, w := range tc.want {
					ok = ok || i == w
				}
				if !ok {
					t.Errorf("picked %d, want one of %v", i, tc.want)
				}
			}
			if len(seen) != len(tc.want) {
				t.Errorf("picked %v over 64 tries, want each of %v", seen, tc.want)
			}
		})
	}
}

// TestDeviceAwareWeightedShareFollowsRatio is the reference model: one
// request arrives per step and each stays in flight a fixed number of
// steps on whichever worker it went to. In flight counts are then the
// arrival shares, so a CPU worker must receive 1/ratio of what an
// accelerator worker receives: the CPU side's share of all requests is
// cpus / (cpus + ratio × accelerators).
func TestDeviceAwareWeightedShareFollowsRatio(t *testing.T) {
	for _, tc := range []struct {
		cpus, accels, ratio int
		lifetime            int // steps a request stays; 0 = forever
	}{
		{1, 1, 8, 0}, {1, 1, 8, 200}, {4, 2, 8, 0}, {4, 2, 8, 300},
		{3, 5, 2, 0}, {2, 2, 1, 100}, {1, 4, 3, 500},
	} {
		s := mustNew(t, ModeDeviceAwareWeighted, nil)
		if err := s.SetNonCPUToCPURatio(tc.ratio); err != nil {
			t.Fatal(err)
		}
		cpu := make([]bool, tc.cpus+tc.accels)
		for i := range tc.cpus {
			cpu[i] = true
		}
		cands := fleet(make([]int, len(cpu)), cpu)
		const steps, warmup = 20000, 2000
		rng := rand.New(rand.NewPCG(5, 6))
		var ends [][2]int // (step, worker) of requests in flight, in end order
		got := make([]int, len(cands))
		for step := range steps {
			for len(ends) > 0 && ends[0][0] == step {
				cands[ends[0][1]].ActiveRequests--
				ends = ends[1:]
			}
			c, err := s.Select(&Request{BlockSize: 16, Commit: true}, cands, rng)
			if err != nil {
				t.Fatal(err)
			}
			cands[c.Index].ActiveRequests++
			if tc.lifetime > 0 {
				ends = append(ends, [2]int{step + tc.lifetime, c.Index})
			}
			if step >= warmup || tc.lifetime == 0 {
				got[c.Index]++
			}
		}
		var onCPU, total int
		for i, n := range got {
			total += n
			if cpu[i] {
				onCPU += n
			}
		}
		want := float64(tc.cpus) / float64(tc.cpus+tc.ratio*tc.accels)
		if share := float64(onCPU) / float64(total); math.Abs(share-want) > 0.01 {
			t.Errorf("%+v: CPU share %.4f, want %.4f", tc, share, want)
		}
		// Within a side, least-loaded keeps the workers level.
		for i := range got {
			for j := range got {
				if cpu[i] == cpu[j] && math.Abs(float64(got[i]-got[j])) > 0.02*float64(total)/float64(len(got)) {
					t.Errorf("%+v: workers %d and %d of one kind got %d and %d", tc, i, j, got[i], got[j])
				}
			}
		}
	}
}

func TestNonCPUToCPURatioMustBePositive(t *testing.T) {
	s := mustNew(t, ModeDeviceAwareWeighted, nil)
	for _, r := range []int{0, -3} {
		if err := s.SetNonCPUToCPURatio(r); err == nil {
			t.Errorf("ratio %d accepted", r)
		}
	}
	// Other modes take the setting and ignore it.
	if err := mustNew(t, ModeKV, nil).SetNonCPUToCPURatio(4); err != nil {
		t.Error(err)
	}
}
