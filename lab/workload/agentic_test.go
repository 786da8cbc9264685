package workload

import (
	"slices"
	"testing"
	"time"
)

func smallAgentic() AgenticConfig {
	c := DefaultAgenticConfig()
	c.Requests, c.SystemTokens, c.TaskTokens, c.ToolResultTokens = 300, 256, 32, 64
	return c
}

func TestAgenticDeterministic(t *testing.T) {
	a, err := Agentic(smallAgentic())
	if err != nil {
		t.Fatal(err)
	}
	b, _ := Agentic(smallAgentic())
	if !equalRequests(a, b) {
		t.Fatal("same seed, different workloads")
	}
	c := smallAgentic()
	c.Seed++
	if d, _ := Agentic(c); equalRequests(a, d) {
		t.Fatal("another seed, the same workload")
	}
}

// Every turn extends the one before by the tool call and a tool result;
// sessions of one kind share exactly the system prompt; contexts grow.
func TestAgenticTurnsGrowTheContext(t *testing.T) {
	c := smallAgentic()
	reqs, err := Agentic(c)
	if err != nil {
		t.Fatal(err)
	}
	if len(reqs) != c.Requests {
		t.Fatalf("%d requests, want %d", len(reqs), c.Requests)
	}
	if !slices.IsSortedFunc(reqs, func(a, b Request) int { return int(a.At - b.At) }) {
		t.Fatal("not sorted by arrival")
	}
	sessions := bySession(reqs)
	var firsts [][]uint32
	for name, turns := range sessions {
		if len(turns) > c.MaxTurns {
			t.Fatalf("%s: %d turns", name, len(turns))
		}
		if len(turns[0].Tokens) != c.SystemTokens+c.TaskTokens {
			t.Fatalf("%s: first prompt of %d tokens", name, len(turns[0].Tokens))
		}
		firsts = append(firsts, turns[0].Tokens)
		for k := 1; k < len(turns); k++ {
			prev, cur := turns[k-1].Tokens, turns[k].Tokens
			grew := len(cur) - len(prev)
			if commonPrefix(prev, cur) != len(prev) || grew <= c.ToolCallTokens || grew > c.ToolCallTokens+maxResultFactor*c.ToolResultTokens {
				t.Fatalf("%s turn %d: grew by %d tokens from a prefix of %d/%d", name, k, grew, commonPrefix(prev, cur), len(prev))
			}
			if turns[k].At < turns[k-1].At || turns[k].OSL != c.ToolCallTokens {
				t.Fatalf("%s turn %d: %v after %v, OSL %d", name, k, turns[k].At, turns[k-1].At, turns[k].OSL)
			}
		}
	}
	kinds := map[uint32]bool{}
	for _, f := range firsts {
		kinds[f[0]] = true
		for _, g := range firsts {
			if f[0] == g[0] && commonPrefix(f, g) != len(f) && commonPrefix(f, g) != c.SystemTokens {
				t.Fatalf("two sessions of one kind share %d tokens, want the %d of the system prompt", commonPrefix(f, g), c.SystemTokens)
			}
		}
	}
	if len(kinds) != c.Agents {
		t.Fatalf("%d agent kinds, want %d", len(kinds), c.Agents)
	}
}

func TestAgenticValidate(t *testing.T) {
	for _, edit := range []func(*AgenticConfig){
		func(c *AgenticConfig) { c.Requests = 0 },
		func(c *AgenticConfig) { c.MaxTurns = c.MinTurns - 1 },
		func(c *AgenticConfig) { c.Rate = 0 },
		func(c *AgenticConfig) { c.ThinkTime = 0 },
		func(c *AgenticConfig) { c.ToolResultTokens = 1 << 30 },
		func(c *AgenticConfig) { c.Rate, c.ThinkTime = 1e-12, time.Hour },
	} {
		c := DefaultAgenticConfig()
		edit(&c)
		if _, err := Agentic(c); err == nil {
			t.Errorf("accepted %+v", c)
		}
	}
}

// Every turn but a session's first waits for the one before (Think > 0);
// first turns are open-loop.
func TestAgenticTurnsAfterTheFirstWait(t *testing.T) {
	reqs, err := Agentic(smallAgentic())
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for i, r := range reqs {
		if first := !seen[r.Session]; first != (r.Think == 0) {
			t.Fatalf("request %d (session %s, first turn %v) has Think %v", i, r.Session, first, r.Think)
		}
		seen[r.Session] = true
	}
}
