package sched

import (
	"math"
	"math/rand/v2"
	"testing"
)

func tokens(seed uint64, n int) []uint32 {
	r := rand.New(rand.NewPCG(seed, 7))
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(r.IntN(128000))
	}
	return out
}

func concat(parts ...[]uint32) []uint32 {
	var out []uint32
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

func engineLoad(waiting int, usage float64) EngineLoad {
	return EngineLoad{Known: true, Waiting: waiting, KVUsage: usage}
}

func TestLLMDPreciseScores(t *testing.T) {
	const bs, isl = 16, 160 // 10 prompt blocks
	tests := []struct {
		name  string
		cands []Candidate
		want  int
	}{
		{
			name: "equal load: the longest cached prefix wins",
			cands: []Candidate{
				{Worker: worker(1), OverlapBlocks: 2, Engine: engineLoad(1, 0.5)},
				{Worker: worker(2), OverlapBlocks: 9, Engine: engineLoad(1, 0.5)},
				{Worker: worker(3), OverlapBlocks: 5, Engine: engineLoad(1, 0.5)},
			},
			want: 1,
		},
		{
			// 1 + 0 + 0.1 = 1.1; 0 + 1 + 0.9 = 1.9; 0.5 + 0.6 + 0.5 = 1.6.
			name: "a full cache hit loses to an idle engine with free KV",
			cands: []Candidate{
				{Worker: worker(1), OverlapBlocks: 10, Engine: engineLoad(5, 0.9)},
				{Worker: worker(2), OverlapBlocks: 0, Engine: engineLoad(0, 0.1)},
				{Worker: worker(3), OverlapBlocks: 5, Engine: engineLoad(2, 0.5)},
			},
			want: 1,
		},
		{
			// 1 + 0 + 0.5 = 1.5 against 0.2 + 1 + 0.2 = 1.4.
			name: "queue depth is min-max normalised",
			cands: []Candidate{
				{Worker: worker(1), OverlapBlocks: 10, Engine: engineLoad(100, 0.5)},
				{Worker: worker(2), OverlapBlocks: 2, Engine: engineLoad(99, 0.8)},
			},
			want: 0,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := mustNew(t, ModeLLMDPrecise, nil)
			c, err := s.Select(&Request{ISL: isl, BlockSize: bs}, tc.cands, rand.New(rand.NewPCG(1, 2)))
			if err != nil {
				t.Fatal(err)
			}
			if c.Index != tc.want {
				t.Fatalf("picked %d, want %d", c.Index, tc.want)
			}
		})
	}
}

func TestPeerModesUseEngineLoad(t *testing.T) {
	for _, m := range Modes() {
		want := m == ModeLLMDPrecise || m == ModeGIEApproxPrefix
		if m.UsesEngineLoad() != want {
			t.Errorf("%s.UsesEngineLoad() = %v", m, !want)
		}
	}
}

// equalCands are n idle workers: only what a policy learnt separates them.
func equalCands(n int) []Candidate {
	out := make([]Candidate, n)
	for i := range out {
		out[i] = Candidate{Worker: worker(uint64(i + 1)), Engine: engineLoad(0, 0)}
	}
	return out
}

func TestLearningPoliciesFollowTheirOwnDecisions(t *testing.T) {
	for _, mode := range []Mode{ModeGIEApproxPrefix, ModeSGLangCacheAware} {
		t.Run(string(mode), func(t *testing.T) {
			s := mustNew(t, mode, nil)
			rng := rand.New(rand.NewPCG(5, 6))
			cands := equalCands(8)
			system := tokens(1, 1024)
			first, err := s.Select(&Request{ISL: 2048, BlockSize: 16, Tokens: concat(system, tokens(2, 1024)), Commit: true}, cands, rng)
			if err != nil {
				t.Fatal(err)
			}
			// The same conversation, one turn later: it must follow.
			for turn := range 20 {
				prompt := concat(system, tokens(2, 1024), tokens(uint64(100+turn), 64))
				c, err := s.Select(&Request{ISL: len(prompt), BlockSize: 16, Tokens: prompt, Commit: true}, cands, rng)
				if err != nil {
					t.Fatal(err)
				}
				if c.Index != first.Index {
					t.Fatalf("turn %d went to %d, the conversation is on %d", turn, c.Index, first.Index)
				}
			}
		})
	}
}

func TestLearningPoliciesIgnoreQueries(t *testing.T) {
	for _, mode := range []Mode{ModeGIEApproxPrefix, ModeSGLangCacheAware} {
		t.Run(string(mode), func(t *testing.T) {
			s := mustNew(t, mode, nil)
			rng := rand.New(rand.NewPCG(5, 6))
			cands := equalCands(8)
			prompt := tokens(3, 4096)
			seen := map[int]bool{}
			// Queries never teach the policy, so an idle fleet keeps
			// answering at random.
			for range 200 {
				c, err := s.Select(&Request{ISL: len(prompt), BlockSize: 16, Tokens: prompt}, cands, rng)
				if err != nil {
					t.Fatal(err)
				}
				seen[c.Index] = true
			}
			if len(seen) < 6 {
				t.Fatalf("queries went to only %d of 8 workers: a query taught the policy", len(seen))
			}
		})
	}
}

func TestSGLangBalancing(t *testing.T) {
	prompt := tokens(9, 1000)
	warm := func(t *testing.T) (*Scheduler, []Candidate) {
		s := mustNew(t, ModeSGLangCacheAware, nil)
		cands := equalCands(3)
		// Teach worker 0 the prompt and worker 2 a short other one by
		// pinning each there (the only candidate), then route among all
		// three: worker 1's tree is the smallest.
		if _, err := s.Select(&Request{ISL: len(prompt), BlockSize: 16, Tokens: prompt, Commit: true}, cands[:1], rand.New(rand.NewPCG(1, 1))); err != nil {
			t.Fatal(err)
		}
		other := tokens(11, 100)
		if _, err := s.Select(&Request{ISL: len(other), BlockSize: 16, Tokens: other, Commit: true}, cands[2:], rand.New(rand.NewPCG(1, 1))); err != nil {
			t.Fatal(err)
		}
		return s, cands
	}
	tests := []struct {
		name   string
		active []int
		tokens []uint32
		want   int
	}{
		{"balanced, cached: the match wins", []int{10, 0, 5}, prompt, 0},
		{"imbalanced beyond both thresholds: the least loaded", []int{100, 30, 20}, prompt, 2},
		{"absolute gap within 64: still cache", []int{60, 0, 30}, prompt, 0},
		{"relative gap within 1.5: still cache", []int{200, 134, 150}, prompt, 0},
		{"match below 0.3 of the prompt: the smallest tree, not the least loaded", []int{10, 9, 3}, concat(prompt[:250], tokens(10, 750)), 1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s, cands := warm(t)
			for i, a := range tc.active {
				cands[i].ActiveRequests = a
			}
			c, err := s.Select(&Request{ISL: len(tc.tokens), BlockSize: 16, Tokens: tc.tokens}, cands, rand.New(rand.NewPCG(2, 2)))
			if err != nil {
				t.Fatal(err)
			}
			if c.Index != tc.want {
				t.Fatalf("picked %d, want %d", c.Index, tc.want)
			}
		})
	}
}

func TestGIEPrefixScore(t *testing.T) {
	s := mustNew(t, ModeGIEApproxPrefix, nil)
	cands := equalCands(2)
	prompt := tokens(11, 64*10)
	if _, err := s.Select(&Request{ISL: len(prompt), BlockSize: 16, Tokens: prompt, Commit: true}, cands[:1], rand.New(rand.NewPCG(1, 1))); err != nil {
		t.Fatal(err)
	}
	// Worker 0 holds all 10 chunks: prefix score 1 against 0, which
	// outweighs a queue-depth disadvantage (score 0 against 1) only
	// together with its free KV: 1 + 0 + 1 > 0 + 1 + 0.5.
	cands[0].Engine = engineLoad(4, 0)
	cands[1].Engine = engineLoad(0, 0.5)
	c, err := s.Select(&Request{ISL: len(prompt), BlockSize: 16, Tokens: prompt}, cands, rand.New(rand.NewPCG(3, 3)))
	if err != nil {
		t.Fatal(err)
	}
	if c.Index != 0 {
		t.Fatalf("picked %d, want the worker holding the prefix", c.Index)
	}
	// Half the chunks: 0.5 + 0 + 1 < 0 + 1 + 1 against an idle worker.
	cands[1].Engine = engineLoad(0, 0)
	half := concat(prompt[:64*5], tokens(12, 64*5))
	c, err = s.Select(&Request{ISL: len(half), BlockSize: 16, Tokens: half}, cands, rand.New(rand.NewPCG(3, 3)))
	if err != nil {
		t.Fatal(err)
	}
	if c.Index != 1 {
		t.Fatalf("picked %d, want the idle worker", c.Index)
	}
}

func TestChunkLRUEvictsOldest(t *testing.T) {
	l := newChunkLRU(3)
	for _, h := range []uint64{1, 2, 3} {
		l.add(h)
	}
	l.add(1) // refresh: 2 is now the oldest
	l.add(4)
	if got := l.leadingRun([]uint64{1, 3, 4}); got != 3 {
		t.Fatalf("leading run %d, want 3", got)
	}
	if got := l.leadingRun([]uint64{2}); got != 0 {
		t.Fatalf("2 should have been evicted")
	}
	if len(l.at) != 3 || len(l.slots) != 3 {
		t.Fatalf("size %d/%d, want 3", len(l.at), len(l.slots))
	}
}

// llm-d weighs each block of the consecutive prefix by its fastest tier:
// GPU 1, CPU 0.8, a medium it has no weight for (disk) 1.
func TestLLMDPrefixBlocksTierWeights(t *testing.T) {
	tests := []struct {
		name            string
		dev, host, disk int
		want            float64
	}{
		{"device only", 6, 0, 0, 6},
		{"host tier absent reports 0 below the device run", 6, 0, 0, 6},
		{"host continues the device run", 4, 10, 0, 4 + 0.8*6},
		{"host only", 0, 5, 0, 0.8 * 5},
		{"host equal to device adds nothing", 7, 7, 0, 7},
		{"disk continues the host run at the default weight", 2, 4, 9, 2 + 0.8*2 + 5},
		{"disk right after the device run", 3, 0, 5, 3 + 2},
		{"nothing", 0, 0, 0, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c := Candidate{OverlapBlocks: tc.dev, HostBlocks: tc.host, DiskBlocks: tc.disk, SharedBlocks: 50}
			if got := llmdPrefixBlocks(&c); math.Abs(got-tc.want) > 1e-9 {
				t.Fatalf("device %d host %d disk %d: score %v, want %v", tc.dev, tc.host, tc.disk, got, tc.want)
			}
		})
	}
}

// A host hit scores below the same hit on the GPU, above none.
func TestLLMDPreciseHostBelowDevice(t *testing.T) {
	const bs, isl = 16, 160
	s := mustNew(t, ModeLLMDPrecise, nil)
	cands := []Candidate{
		{Worker: worker(1), HostBlocks: 10, Engine: engineLoad(1, 0.5)},
		{Worker: worker(2), OverlapBlocks: 9, Engine: engineLoad(1, 0.5)},
		{Worker: worker(3), Engine: engineLoad(1, 0.5)},
	}
	c, err := s.Select(&Request{ISL: isl, BlockSize: bs}, cands, rand.New(rand.NewPCG(1, 2)))
	if err != nil || c.Worker != worker(2) {
		t.Fatalf("picked %v (%v), want the device hit of 9 (0.9) over the host hit of 10 (0.8)", c.Worker, err)
	}
	cands[1].OverlapBlocks = 7
	c, err = s.Select(&Request{ISL: isl, BlockSize: bs}, cands, rand.New(rand.NewPCG(1, 2)))
	if err != nil || c.Worker != worker(1) {
		t.Fatalf("picked %v (%v), want the host hit of 10 (0.8) over the device hit of 7 (0.7)", c.Worker, err)
	}
}
