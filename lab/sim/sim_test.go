package sim

import (
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/lab/bench"
	"github.com/kvrouter/kvrouter/lab/replay"
	"github.com/kvrouter/kvrouter/lab/workload"
)

// synthetic is a small shared-prefix workload: 8 system prompts, sessions
// of 4 turns, enough load on 4 engines that queues form.
func synthetic(t testing.TB, requests int) Requests {
	t.Helper()
	reqs, err := workload.Synthetic(workload.SyntheticConfig{
		Requests: requests, Groups: 32, SystemTokens: 1024, QuestionTokens: 128, OutputTokens: 24,
		Rate: 40, Turns: 4, ThinkTime: 2 * time.Second, Seed: 3,
	})
	if err != nil {
		t.Fatal(err)
	}
	return FromRequests(reqs)
}

func smallConfig() Config {
	cfg := DefaultConfig()
	cfg.Workers = 4
	// Small caches: evictions, and Removed events, happen.
	cfg.Engine.NumGPUBlocks = 2048
	return cfg
}

func TestConservation(t *testing.T) {
	tight := 0.01
	cases := []struct {
		name    string
		mode    string
		speedup float64
		edit    func(*Config)
		agentic bool // closed-loop agent sessions instead of the synthetic workload
	}{
		{"kv, events at once", "kv", 1, func(c *Config) { c.KVEventDelay = 0 }, false},
		{"kv, delayed events", "kv", 2, nil, false},
		{"kv, admission queue", "kv", 16, func(c *Config) { c.Router.QueueThreshold = &tight }, false},
		{"dynamo-kv", "dynamo-kv", 2, nil, false},
		{"llm-d-precise reads engine load", "llm-d-precise", 2, nil, false},
		{"round-robin", "round-robin", 2, nil, false},
		{"approximate mode", "kv", 2, func(c *Config) { c.Router.KVEvents = false }, false},
		{"data-parallel ranks", "kv", 2, func(c *Config) { c.Workers, c.DPSize = 2, 2 }, false},
		{"closed-loop agent sessions", "kv", 8, nil, true},
		{"closed-loop sessions through the queue", "kv", 1024, func(c *Config) { c.Router.QueueThreshold = &tight }, true},
		{"speculative prefill", "kv", 8, func(c *Config) { c.SpeculativePrefill = true }, true},
		{"speculative prefill through the queue", "kv", 1024, func(c *Config) { c.SpeculativePrefill, c.Router.QueueThreshold = true, &tight }, true},
	}
	syn := synthetic(t, 240)
	ac := workload.DefaultAgenticConfig()
	ac.Requests, ac.SystemTokens, ac.ToolResultTokens = 240, 1024, 256
	reqs, err := workload.Agentic(ac)
	if err != nil {
		t.Fatal(err)
	}
	agent := FromRequests(reqs)
	for _, tc := range cases {
		w := syn
		if tc.agentic {
			w = agent
		}
		t.Run(tc.name, func(t *testing.T) {
			cfg := smallConfig()
			cfg.listsBlocks = true
			if tc.edit != nil {
				tc.edit(&cfg)
			}
			s, err := newSim(cfg, tc.mode, w, tc.speedup)
			if err != nil {
				t.Fatal(err)
			}
			if err := s.run(); err != nil {
				t.Fatal(err)
			}
			for i, rs := range s.reqs {
				if !rs.finished || rs.failed || rs.first < rs.arrival || rs.done < rs.first {
					t.Fatalf("request %d: %+v", i, rs)
				}
			}
			if s.errors != 0 || len(s.held) != 0 {
				t.Fatalf("%d errors (%v), %d still queued", s.errors, s.firstErr, len(s.held))
			}
			if cfg.SpeculativePrefill && (s.specSent == 0 || len(s.specHeld) != 0) {
				t.Fatalf("%d speculative prefills sent, %d still queued", s.specSent, len(s.specHeld))
			}
			for _, l := range s.r.Loads() {
				if l.ActiveRequests != 0 || l.ActiveDecodeBlocks != 0 || l.ActivePrefillTokens != 0 {
					t.Fatalf("load left on %v: %+v", l.Worker, l)
				}
			}
			st := s.r.Stats()
			if tc.agentic && s.after == nil {
				t.Fatal("no request waited for its session")
			}
			if strings.Contains(tc.name, "queue") && st.Queued == 0 {
				t.Fatal("the queue was never used")
			}
			if st.QueuePending != 0 {
				t.Fatalf("%d requests left in the queue", st.QueuePending)
			}
			// Every prompt token an engine did not find cached was
			// prefilled exactly once (no preemption here), and each
			// request decoded all but its first token.
			p := s.point()
			missed, decoded := s.specMissed, int64(0) // speculative prefills decode nothing after their first token
			for i := range s.reqs {
				missed += int64(s.reqs[i].prompt - s.reqs[i].cached)
				decoded += int64(w.Request(i).OSL - 1)
			}
			e := p.Engines
			if p.Preemptions == 0 && (int64(e.PrefillTokensPerStep*float64(e.Steps)+0.5) != missed || int64(e.DecodeSeqsPerStep*float64(e.Steps)+0.5) != decoded) {
				t.Fatalf("engines prefilled %.0f and decoded %.0f tokens; requests missed %d and decoded %d",
					e.PrefillTokensPerStep*float64(e.Steps), e.DecodeSeqsPerStep*float64(e.Steps), missed, decoded)
			}
			if !(e.Busy > 0 && e.Busy <= 1 && e.KVUsageMean > 0 && e.KVUsageMean <= e.KVUsageMax && e.KVUsageMax <= 1 && e.PrefillShare > 0 && e.PrefillShare < 1) {
				t.Fatalf("engine stats out of range: %+v", e)
			}
			if !cfg.Router.KVEvents {
				return
			}
			for i := range s.engines {
				se := &s.engines[i]
				want := bench.EngineSeqs(blockhash.New(cfg.Engine.BlockSize, ""), se.eng.CachedBlocks())
				got := map[uint64]bool{}
				for _, h := range s.r.HeldBlocks(se.w) {
					got[h] = true
				}
				if len(want) == 0 {
					t.Fatalf("engine %d caches nothing", i)
				}
				if len(got) != len(want) {
					t.Fatalf("engine %d: index holds %d blocks, engine %d", i, len(got), len(want))
				}
				for h := range want {
					if !got[h] {
						t.Fatalf("engine %d: block %x missing from the index", i, h)
					}
				}
			}
		})
	}
}

func TestDeterministicPoint(t *testing.T) {
	w := synthetic(t, 200)
	a, err := Run(smallConfig(), "kv", w, 3)
	if err != nil {
		t.Fatal(err)
	}
	b, err := Run(smallConfig(), "kv", w, 3)
	if err != nil {
		t.Fatal(err)
	}
	if a != b {
		t.Fatalf("two runs differ:\n%+v\n%+v", a, b)
	}
}

// On shared-prefix sessions, routing by cached prefix finds far more of
// the prompts cached than ignoring caches does.
func TestKVHitsMoreThanRoundRobin(t *testing.T) {
	w := synthetic(t, 400)
	cfg := smallConfig()
	kvp, err := Run(cfg, "kv", w, 1)
	if err != nil {
		t.Fatal(err)
	}
	rr, err := Run(cfg, "round-robin", w, 1)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("hit rate: kv %.3f, round-robin %.3f; TTFT p90 kv %.0f ms, round-robin %.0f ms", kvp.HitRate, rr.HitRate, kvp.TTFT.P90, rr.TTFT.P90)
	if kvp.HitRate < rr.HitRate+0.2 {
		t.Fatalf("kv's hit rate %.3f is not clearly above round-robin's %.3f", kvp.HitRate, rr.HitRate)
	}
}

func TestGapDistCountsEveryGap(t *testing.T) {
	ms := int64(time.Millisecond)
	// 10 gaps: 1 ms ×5, 2 ms ×3, 10 ms ×2.
	d := gapDist([]gapRun{{2 * ms, 3}, {ms, 5}, {10 * ms, 2}})
	if d.P50 != 1 || d.P90 != 10 || d.P99 != 10 || d.Mean != 3.1 {
		t.Fatalf("%+v", d)
	}
}

func TestEventQueueOrdersByTimeThenFIFO(t *testing.T) {
	var q eventQueue
	for i, at := range []int64{5, 1, 5, 3, 1, 9, 0} {
		q.push(event{at: at, seq: uint64(i), n: int32(i)})
	}
	want := []int32{6, 1, 4, 3, 0, 2, 5}
	for _, n := range want {
		if e, ok := q.next(); !ok || e.n != n {
			t.Fatalf("popped %d (%v), want %d", e.n, ok, n)
		}
	}
	if e, ok := q.next(); ok {
		t.Fatalf("popped %d from an empty queue", e.n)
	}
}

// The queue hands out events as a sorted list would, whatever is
// scheduled while an event is handled (the first such event takes the
// handled one's place in the heap): none, one or several, earlier than
// others, tied with them, or at the handled event's own time.
func TestEventQueueMatchesASortedList(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 11))
	for round := range 200 {
		var q eventQueue
		var ref []event
		var seq uint64
		now := int64(-10) // the order holds across zero
		schedule := func() {
			seq++
			e := event{at: now + rng.Int64N(8), seq: seq, n: int32(seq)}
			q.push(e)
			ref = append(ref, e)
		}
		for range 1 + rng.IntN(20) {
			schedule()
		}
		for handled := 0; ; handled++ {
			e, ok := q.next()
			if len(ref) == 0 {
				if ok {
					t.Fatalf("round %d: handed out %+v, the list is empty", round, e)
				}
				break
			}
			best := 0
			for k, r := range ref {
				if b := ref[best]; r.at < b.at || r.at == b.at && r.seq < b.seq {
					best = k
				}
			}
			if !ok || e != ref[best] {
				t.Fatalf("round %d, event %d: handed out %+v (%v), want %+v", round, handled, e, ok, ref[best])
			}
			ref = append(ref[:best], ref[best+1:]...)
			now = e.at
			if handled < 300 {
				for range rng.IntN(4) {
					schedule()
				}
			}
		}
	}
}

// BenchmarkRun is one run of the loop; speed is model time over wall time.
func BenchmarkRun(b *testing.B) {
	w := synthetic(b, 1000)
	cfg := DefaultConfig()
	var model float64
	b.ResetTimer()
	for range b.N {
		p, err := Run(cfg, "kv", w, 2)
		if err != nil {
			b.Fatal(err)
		}
		model += p.ModelS
	}
	b.ReportMetric(model/b.Elapsed().Seconds(), "model-s/s")
	b.ReportMetric(float64(b.N*w.Len())/b.Elapsed().Seconds(), "requests/s")
}

// A request no engine can hold fails once, leaves no load behind and does
// not stop the others.
func TestEngineRefusalIsCountedOnce(t *testing.T) {
	long := make([]uint32, 2000)
	for i := range long {
		long[i] = uint32(i)
	}
	reqs := Requests{
		{At: 0, Tokens: long[:100], OSL: 4},
		{At: time.Millisecond, Tokens: long, OSL: 4}, // 126 blocks of 16 > 64
		{At: 2 * time.Millisecond, Tokens: long[:200], OSL: 4},
	}
	cfg := smallConfig()
	cfg.Engine.NumGPUBlocks = 64
	s, err := newSim(cfg, "kv", reqs, 1)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.run(); err != nil {
		t.Fatal(err)
	}
	p := s.point()
	if p.Errors != 1 || p.FirstError == "" || !s.reqs[1].failed || !s.reqs[0].finished || !s.reqs[2].finished {
		t.Fatalf("%+v", p)
	}
	for _, l := range s.r.Loads() {
		if l.ActiveRequests != 0 {
			t.Fatalf("load left on %v", l.Worker)
		}
	}
}

// A turn that waits for its session's previous one arrives its think time
// after that one's last token, whatever its open-loop At says and whatever
// the arrival speedup; requests on their own keep their (sped-up) At.
func TestClosedLoopTurnsWaitForTheirAnswer(t *testing.T) {
	prompt := func(n int) []uint32 { return seqTokens(7, n) }
	w := FromRequests([]workload.Request{
		{At: 0, Tokens: prompt(500), OSL: 20, Session: "a"},
		{At: 10 * time.Millisecond, Tokens: prompt(600), OSL: 20, Session: "a", Think: time.Second},
		{At: 20 * time.Millisecond, Tokens: prompt(700), OSL: 20, Session: "a", Think: 300 * time.Millisecond},
		{At: 8 * time.Millisecond, Tokens: prompt(300), OSL: 5, Session: "b"},
	})
	for _, scale := range []float64{1, 4} {
		s, err := newSim(smallConfig(), "kv", w, scale)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.run(); err != nil {
			t.Fatal(err)
		}
		// FromRequests orders by At: a0, b, a1, a2.
		a0, b, a1, a2 := &s.reqs[0], &s.reqs[1], &s.reqs[2], &s.reqs[3]
		for i, rs := range []*reqState{a0, b, a1, a2} {
			if !rs.finished {
				t.Fatalf("×%g: request %d never finished", scale, i)
			}
		}
		if want := int64(float64(8*time.Millisecond) / scale); b.arrival != want {
			t.Errorf("×%g: the independent request arrived at %d ns, want %d", scale, b.arrival, want)
		}
		if a1.arrival != a0.done+int64(time.Second) {
			t.Errorf("×%g: turn 2 arrived at %d ns, want turn 1's end %d + 1 s", scale, a1.arrival, a0.done)
		}
		if a2.arrival != a1.done+int64(300*time.Millisecond) {
			t.Errorf("×%g: turn 3 arrived at %d ns, want turn 2's end %d + 300 ms", scale, a2.arrival, a1.done)
		}
	}
}

// A closed-loop run is measured between its sessions' build-up and the
// last session's start: from a quarter of the way through the starts.
func TestSteadyWindowMeasuresClosedLoopRunsBetweenBuildUpAndDrain(t *testing.T) {
	prompt := func(session, n int) []uint32 { return seqTokens(uint32(session*100000+7), n) }
	var reqs []workload.Request
	for k := range 9 { // sessions start at 0, 1, …, 8 s
		name := strconv.Itoa(k)
		at := time.Duration(k) * time.Second
		reqs = append(reqs,
			workload.Request{At: at, Tokens: prompt(k, 400), OSL: 10, Session: name},
			workload.Request{At: at, Tokens: prompt(k, 600), OSL: 30, Session: name, Think: 1500 * time.Millisecond},
			workload.Request{At: at, Tokens: prompt(k, 800), OSL: 20, Session: name, Think: 300 * time.Millisecond})
	}
	for _, scale := range []float64{1, 2} {
		s, err := newSim(smallConfig(), "kv", FromRequests(reqs), scale)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.run(); err != nil {
			t.Fatal(err)
		}
		from, to := 2*float64(time.Second)/scale, 8*float64(time.Second)/scale
		var ttft []float64
		gaps := 0
		for i := range s.reqs {
			rs := &s.reqs[i]
			if !rs.finished {
				t.Fatalf("×%g: request %d never finished", scale, i)
			}
			if a := float64(rs.arrival); a >= from && a <= to {
				ttft = append(ttft, float64(rs.first-rs.arrival)/1e6)
				gaps += s.w.Request(i).OSL - 1
			}
		}
		if len(ttft) == 0 || len(ttft) == len(s.reqs) {
			t.Fatalf("×%g: %d of %d requests arrived in the window; the case should measure some but not all", scale, len(ttft), len(s.reqs))
		}
		p := s.point()
		if p.Steady == nil || p.Steady.FromS != from/1e9 || p.Steady.ToS != to/1e9 || p.Steady.Requests != len(ttft) {
			t.Fatalf("×%g: window %+v, want %g–%g s holding %d requests", scale, p.Steady, from/1e9, to/1e9, len(ttft))
		}
		if want := float64(len(ttft)) / ((to - from) / 1e9); math.Abs(p.ArrivalRPS-want) > 1e-9 {
			t.Errorf("×%g: arrival rate %g req/s, want %g: the window's arrivals over its length", scale, p.ArrivalRPS, want)
		}
		if want := replay.DistOf(ttft); p.TTFT != want {
			t.Errorf("×%g: TTFT %+v, want the window's %+v", scale, p.TTFT, want)
		}
		counted := 0
		for _, r := range s.gaps.runs() {
			counted += r.n
		}
		if counted != gaps {
			t.Errorf("×%g: %d inter-token gaps counted, want the window's requests' %d", scale, counted, gaps)
		}
	}
}

// Sessions that all start at once have no steady state to single out:
// their run is measured whole.
func TestSessionsStartingTogetherAreMeasuredWhole(t *testing.T) {
	toks := func(n int) []uint32 { return seqTokens(11, n) }
	s, err := newSim(smallConfig(), "kv", FromRequests([]workload.Request{
		{At: 0, Tokens: toks(300), OSL: 8, Session: "a"},
		{At: 0, Tokens: toks(500), OSL: 8, Session: "a", Think: 200 * time.Millisecond},
	}), 1)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.run(); err != nil {
		t.Fatal(err)
	}
	if p := s.point(); p.Steady != nil || p.TTFT.P90 == 0 || p.E2E.Mean == 0 {
		t.Fatalf("one session: window %+v, TTFT %+v, E2E %+v; want no window and both turns measured", p.Steady, p.TTFT, p.E2E)
	}
}

// Open-loop arrivals are measured whole.
func TestOpenLoopRunsHaveNoWindow(t *testing.T) {
	s, err := newSim(smallConfig(), "kv", synthetic(t, 40), 1)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.run(); err != nil {
		t.Fatal(err)
	}
	if p := s.point(); p.Steady != nil || p.TTFT.Mean == 0 {
		t.Fatalf("open-loop run: window %+v, TTFT %+v; want no window and every request measured", p.Steady, p.TTFT)
	}
}

// seqTokens is the n token ids from, from+1, …: prompts built from one
// from share their leading blocks.
func seqTokens(from uint32, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = from + uint32(i)
	}
	return out
}

// BenchmarkGapCounts: counting one run of gaps per step, the lengths a
// conversation trace's steps take (about 10–60 ms, by the microsecond),
// in gapCounts against a map.
func BenchmarkGapCounts(b *testing.B) {
	rng := rand.New(rand.NewPCG(1, 2))
	qs := make([]int64, 4096)
	for i := range qs {
		qs[i] = 10_000 + rng.Int64N(50_000)
	}
	b.Run("gapCounts", func(b *testing.B) {
		var g gapCounts
		i := 0
		for b.Loop() {
			g.add(qs[i%len(qs)], 7)
			i++
		}
	})
	b.Run("map", func(b *testing.B) {
		m := map[int64]int{}
		i := 0
		for b.Loop() {
			m[qs[i%len(qs)]] += 7
			i++
		}
	})
}

// BenchmarkEventQueue: the loop's pattern at 512-token blocks, 8 engines
// each rescheduling its step end when it is handled (steps of 6 to 40 ms)
// and a KV delivery 5 ms after one step in eight.
func BenchmarkEventQueue(b *testing.B) {
	rng := rand.New(rand.NewPCG(1, 2))
	durs := make([]int64, 4096)
	for i := range durs {
		durs[i] = 6e6 + rng.Int64N(34e6)
	}
	var q eventQueue
	var seq uint64
	for e := range 8 {
		seq++
		q.push(event{at: durs[e], seq: seq, kind: evStepDone, n: int32(e)})
	}
	k := 0
	for b.Loop() {
		ev, _ := q.next()
		if ev.kind != evStepDone {
			continue
		}
		k++
		if k%8 == 0 {
			seq++
			q.push(event{at: ev.at + 5e6, seq: seq, kind: evKV, n: ev.n})
		}
		seq++
		q.push(event{at: ev.at + durs[k%len(durs)], seq: seq, kind: evStepDone, n: ev.n})
	}
}
