package workload

import (
	"cmp"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/lab/trace"
)

// small is a quick workload with every feature on: several groups and
// turns, and a request count that cuts the last session short.
func small() SyntheticConfig {
	return SyntheticConfig{
		Requests:       301,
		Groups:         3,
		SystemTokens:   37,
		QuestionTokens: 11,
		OutputTokens:   5,
		Rate:           20,
		Turns:          4,
		ThinkTime:      2 * time.Second,
		Seed:           7,
	}
}

func mustSynthetic(t testing.TB, c SyntheticConfig) []Request {
	t.Helper()
	reqs, err := Synthetic(c)
	if err != nil {
		t.Fatalf("Synthetic(%+v): %v", c, err)
	}
	return reqs
}

func equalRequests(a, b []Request) bool {
	return slices.EqualFunc(a, b, func(x, y Request) bool {
		return x.At == y.At && x.OSL == y.OSL && x.Session == y.Session && slices.Equal(x.Tokens, y.Tokens)
	})
}

// bySession returns each session's requests in arrival order; a stable sort
// keeps turns with equal At in turn order, so this is also turn order.
func bySession(reqs []Request) map[string][]Request {
	m := map[string][]Request{}
	for _, r := range reqs {
		m[r.Session] = append(m[r.Session], r)
	}
	return m
}

func commonPrefix(a, b []uint32) int {
	n := 0
	for n < len(a) && n < len(b) && a[n] == b[n] {
		n++
	}
	return n
}

func TestSyntheticDeterministic(t *testing.T) {
	c := small()
	a, b := mustSynthetic(t, c), mustSynthetic(t, c)
	if !equalRequests(a, b) {
		t.Fatal("same config, different workloads")
	}
	c.Seed++
	d := mustSynthetic(t, c)
	if equalRequests(a, d) {
		t.Fatal("different seeds, same workload")
	}
	if slices.Equal(a[0].Tokens, d[0].Tokens) || a[0].At == d[0].At {
		t.Error("a different seed should change both tokens and arrivals")
	}
}

// Changing only prompt lengths keeps the arrival pattern, so that runs of
// different prompt sizes can be compared request for request.
func TestSyntheticArrivalsIndependentOfLengths(t *testing.T) {
	c := small()
	a := mustSynthetic(t, c)
	c.SystemTokens, c.QuestionTokens, c.OutputTokens = 100, 3, 40
	b := mustSynthetic(t, c)
	for i := range a {
		if a[i].At != b[i].At || a[i].Session != b[i].Session {
			t.Fatalf("request %d: %v %s vs %v %s", i, a[i].At, a[i].Session, b[i].At, b[i].Session)
		}
	}
}

func TestSyntheticCountAndShape(t *testing.T) {
	for _, tc := range []struct {
		name            string
		requests, turns int
	}{
		{"exact multiple", 400, 4},
		{"last session cut", 301, 4},
		{"fewer requests than turns", 2, 5},
		{"single request", 1, 3},
		{"independent", 97, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := small()
			c.Requests, c.Turns = tc.requests, tc.turns
			reqs := mustSynthetic(t, c)
			if len(reqs) != c.Requests {
				t.Fatalf("%d requests, want %d", len(reqs), c.Requests)
			}
			if !slices.IsSortedFunc(reqs, func(a, b Request) int { return cmp.Compare(a.At, b.At) }) {
				t.Error("not sorted by At")
			}
			for i, r := range reqs {
				if r.OSL != c.OutputTokens {
					t.Fatalf("request %d: OSL %d, want %d", i, r.OSL, c.OutputTokens)
				}
				if r.At < 0 {
					t.Fatalf("request %d: At %v", i, r.At)
				}
				for _, tk := range r.Tokens {
					if tk >= trace.Vocab {
						t.Fatalf("request %d: token %d out of range", i, tk)
					}
				}
				if c.Turns == 1 && r.Session != "" {
					t.Fatalf("independent request %d has session %q", i, r.Session)
				}
				if c.Turns > 1 && !strings.HasPrefix(r.Session, "s") {
					t.Fatalf("request %d: session %q", i, r.Session)
				}
			}
			if c.Turns == 1 {
				return
			}
			// Only the last session (the highest index) may be short.
			sessions := bySession(reqs)
			want := (c.Requests + c.Turns - 1) / c.Turns
			if len(sessions) != want {
				t.Errorf("%d sessions, want %d", len(sessions), want)
			}
			last := "s" + strconv.Itoa(want-1)
			for name, turns := range sessions {
				n := c.Turns
				if name == last {
					n = c.Requests - (want-1)*c.Turns
				}
				if len(turns) != n {
					t.Errorf("session %s: %d turns, want %d", name, len(turns), n)
				}
			}
		})
	}
}

func TestSyntheticTurnsExtendEachOther(t *testing.T) {
	c := small()
	sessions := bySession(mustSynthetic(t, c))
	for name, turns := range sessions {
		for k, r := range turns {
			turn := k + 1
			if want := c.SystemTokens + turn*c.QuestionTokens + (turn-1)*c.OutputTokens; len(r.Tokens) != want {
				t.Fatalf("session %s turn %d: %d tokens, want %d", name, turn, len(r.Tokens), want)
			}
			if k == 0 {
				continue
			}
			prev := turns[k-1]
			if r.At < prev.At {
				t.Fatalf("session %s turn %d arrives before turn %d", name, turn, k)
			}
			if len(r.Tokens) <= len(prev.Tokens) || !slices.Equal(r.Tokens[:len(prev.Tokens)], prev.Tokens) {
				t.Fatalf("session %s turn %d does not extend turn %d", name, turn, k)
			}
		}
	}
}

// Tokens of a session's turns share storage; appending to one turn must not
// change the next.
func TestSyntheticTokensCapped(t *testing.T) {
	c := small()
	for _, turns := range bySession(mustSynthetic(t, c)) {
		if len(turns) < 2 {
			continue
		}
		first, second := turns[0].Tokens, slices.Clone(turns[1].Tokens)
		if cap(first) != len(first) {
			t.Fatalf("cap %d, len %d", cap(first), len(first))
		}
		_ = append(first, 1, 2, 3)
		if !slices.Equal(turns[1].Tokens, second) {
			t.Fatal("appending to turn 1 changed turn 2")
		}
		return
	}
	t.Fatal("no multi-turn session")
}

func TestSyntheticGroupsShareExactlySystemPrompt(t *testing.T) {
	for seed := range uint64(5) {
		c := small()
		c.Seed = seed
		c.Requests = 2000
		var firsts [][]uint32
		for _, turns := range bySession(mustSynthetic(t, c)) {
			firsts = append(firsts, turns[0].Tokens)
		}
		systems := map[string]bool{}
		for i, a := range firsts {
			systems[fmt.Sprint(a[:c.SystemTokens])] = true
			for _, b := range firsts[i+1:] {
				// Same group: the whole system prompt and nothing more;
				// different groups: nothing at all.
				if n := commonPrefix(a, b); n != c.SystemTokens && n != 0 {
					t.Fatalf("seed %d: two sessions share a %d-token prefix, want %d or 0", seed, n, c.SystemTokens)
				}
			}
		}
		if len(systems) != c.Groups {
			t.Errorf("seed %d: %d distinct system prompts, want %d", seed, len(systems), c.Groups)
		}
	}
}

// Answers and questions of different sessions differ too, not only the
// first question token.
func TestSyntheticContentDiffersAcrossSessions(t *testing.T) {
	c := small()
	var seconds [][]uint32
	for _, turns := range bySession(mustSynthetic(t, c)) {
		if len(turns) >= 2 {
			seconds = append(seconds, turns[1].Tokens[len(turns[0].Tokens):])
		}
	}
	for i, a := range seconds {
		for _, b := range seconds[i+1:] {
			if slices.Equal(a, b) {
				t.Fatal("two sessions with the same answer and second question")
			}
		}
	}
}

func TestSyntheticRate(t *testing.T) {
	t.Run("independent", func(t *testing.T) {
		c := small()
		c.Requests, c.Turns, c.Rate = 20000, 1, 50
		reqs := mustSynthetic(t, c)
		gap := Span(reqs).Seconds() / float64(len(reqs)-1)
		if want := 1 / c.Rate; math.Abs(gap-want)/want > 0.03 {
			t.Errorf("mean inter-arrival %.5f s, want %.5f ± 3%%", gap, want)
		}
	})
	t.Run("sessions", func(t *testing.T) {
		// Ramp-up and the tail of the last sessions distort the ends, so
		// count the steady middle half.
		c := small()
		c.Requests, c.Turns, c.Rate, c.ThinkTime = 40000, 4, 50, 3*time.Second
		reqs := mustSynthetic(t, c)
		total := float64(c.Requests) / c.Rate
		lo, hi := time.Duration(total/4*float64(time.Second)), time.Duration(3*total/4*float64(time.Second))
		n := 0
		for _, r := range reqs {
			if r.At >= lo && r.At < hi {
				n++
			}
		}
		got := float64(n) / (hi - lo).Seconds()
		if math.Abs(got-c.Rate)/c.Rate > 0.08 {
			t.Errorf("steady rate %.2f/s, want %.2f ± 8%%", got, c.Rate)
		}
		// And the gaps between turns average ThinkTime.
		var sum time.Duration
		gaps := 0
		for _, turns := range bySession(reqs) {
			for k := 1; k < len(turns); k++ {
				sum += turns[k].At - turns[k-1].At
				gaps++
			}
		}
		mean := sum.Seconds() / float64(gaps)
		if want := c.ThinkTime.Seconds(); math.Abs(mean-want)/want > 0.05 {
			t.Errorf("mean think time %.3f s, want %.3f ± 5%%", mean, want)
		}
	})
}

func TestSyntheticValidate(t *testing.T) {
	if err := DefaultSyntheticConfig().Validate(); err != nil {
		t.Fatalf("default config: %v", err)
	}
	one := small()
	one.Turns, one.ThinkTime = 1, 0
	if err := one.Validate(); err != nil {
		t.Errorf("one turn without think time: %v", err)
	}
	for _, tc := range []struct {
		field string
		set   func(*SyntheticConfig)
	}{
		{"Requests", func(c *SyntheticConfig) { c.Requests = 0 }},
		{"Requests", func(c *SyntheticConfig) { c.Requests = -1 }},
		{"Groups", func(c *SyntheticConfig) { c.Groups = 0 }},
		{"Groups", func(c *SyntheticConfig) { c.Groups = -3 }},
		{"SystemTokens", func(c *SyntheticConfig) { c.SystemTokens = 0 }},
		{"SystemTokens", func(c *SyntheticConfig) { c.SystemTokens = -1 }},
		{"QuestionTokens", func(c *SyntheticConfig) { c.QuestionTokens = 0 }},
		{"QuestionTokens", func(c *SyntheticConfig) { c.QuestionTokens = -1 }},
		{"OutputTokens", func(c *SyntheticConfig) { c.OutputTokens = 0 }},
		{"OutputTokens", func(c *SyntheticConfig) { c.OutputTokens = -1 }},
		{"Rate", func(c *SyntheticConfig) { c.Rate = 0 }},
		{"Rate", func(c *SyntheticConfig) { c.Rate = -2 }},
		{"Rate", func(c *SyntheticConfig) { c.Rate = math.NaN() }},
		{"Rate", func(c *SyntheticConfig) { c.Rate = math.Inf(1) }},
		{"Rate", func(c *SyntheticConfig) { c.Rate = 1e-12 }},
		{"Turns", func(c *SyntheticConfig) { c.Turns = 0 }},
		{"Turns", func(c *SyntheticConfig) { c.Turns = -1 }},
		{"ThinkTime", func(c *SyntheticConfig) { c.ThinkTime = 0 }},
		{"ThinkTime", func(c *SyntheticConfig) { c.ThinkTime = -time.Second }},
		{"SystemTokens", func(c *SyntheticConfig) { c.SystemTokens = math.MaxInt }},
		{"QuestionTokens", func(c *SyntheticConfig) { c.Turns, c.QuestionTokens = 1000, math.MaxInt/2 }},
	} {
		c := small()
		tc.set(&c)
		err := c.Validate()
		if err == nil {
			t.Errorf("%+v: no error, want one naming %s", c, tc.field)
			continue
		}
		if !strings.Contains(err.Error(), tc.field) {
			t.Errorf("%+v: %q does not name %s", c, err, tc.field)
		}
		if reqs, gerr := Synthetic(c); gerr == nil || reqs != nil {
			t.Errorf("%+v: Synthetic accepted an invalid config", c)
		}
	}
}

func BenchmarkSynthetic(b *testing.B) {
	c := DefaultSyntheticConfig()
	c.Requests = 2000
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Synthetic(c); err != nil {
			b.Fatal(err)
		}
	}
}

// With tenants, every turn of a session carries its tenant's salt, the
// tenants split the sessions, and the arrivals and prompts are those of the
// same workload without tenants.
func TestSyntheticTenantsSaltSessions(t *testing.T) {
	c := DefaultSyntheticConfig()
	c.Requests = 400
	plain, err := Synthetic(c)
	if err != nil {
		t.Fatal(err)
	}
	c.Tenants = 4
	salted, err := Synthetic(c)
	if err != nil {
		t.Fatal(err)
	}
	bySession := map[string]string{}
	tenants := map[string]int{}
	for i, r := range salted {
		if r.At != plain[i].At || len(r.Tokens) != len(plain[i].Tokens) || plain[i].CacheSalt != "" {
			t.Fatalf("request %d differs from the workload without tenants", i)
		}
		if s, ok := bySession[r.Session]; ok && s != r.CacheSalt {
			t.Fatalf("session %s has salts %q and %q", r.Session, s, r.CacheSalt)
		}
		bySession[r.Session] = r.CacheSalt
		tenants[r.CacheSalt]++
	}
	if len(tenants) != 4 || tenants[""] != 0 {
		t.Fatalf("requests per salt: %v", tenants)
	}
	c.Tenants = -1
	if err := c.Validate(); err == nil {
		t.Fatal("negative tenants accepted")
	}
}
