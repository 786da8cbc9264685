package workload

import (
	"cmp"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"time"
)

// AgenticConfig describes multi-turn agent sessions: an agent of one of a
// few kinds (a system prompt with its tool definitions) works on a task in
// many short steps, each a model call whose answer is a tool call and
// whose next prompt adds that call and the tool's result. Contexts grow
// long, turns follow each other within seconds, and every turn's prompt
// extends the previous one: the workload where a request's engine matters
// most. The comments name the flags of `kvrouter sim --workload agentic`.
type AgenticConfig struct {
	Requests     int // --agentic-requests: total requests (all turns of all sessions)
	Agents       int // --agents: agent kinds, each with its own system prompt; a session uses one, chosen uniformly
	SystemTokens int // --agent-system-tokens: system prompt and tool definitions of each kind
	TaskTokens   int // --task-tokens: the user's task, in the first turn
	// MinTurns and MaxTurns bound a session's model calls, drawn uniformly.
	MinTurns, MaxTurns int // --min-turns, --max-turns
	ToolCallTokens     int // --tool-call-tokens: tokens generated per turn (the tool call)
	// ToolResultTokens is the mean length of a tool's result (exponential,
	// at least 1 and at most 8× the mean: a file read, a search, a test
	// run's output).
	ToolResultTokens int           // --tool-result-tokens
	Rate             float64       // --agentic-rate: mean requests per second
	ThinkTime        time.Duration // --tool-time: mean gap between a session's turns (exponential): the answer's generation and the tool's run
	Seed             uint64        // --seed
}

// DefaultAgenticConfig is coding-agent-like: 4 kinds of agents with 4,096
// tokens of system prompt and tools, tasks of 4 to 20 steps whose context
// grows by about 860 tokens a step to 10–21 K tokens, a step 1.5 s after
// the answer before. 100,000 requests are about 8,300 sessions: closed-loop
// sessions carry only the load that is running at once, and a run is
// measured between their build-up and the last start, so enough of them
// that at the rates an 8-engine fleet carries the sessions keep starting
// for several times as long as one lasts.
func DefaultAgenticConfig() AgenticConfig {
	return AgenticConfig{
		Requests: 100000, Agents: 4, SystemTokens: 4096, TaskTokens: 512,
		MinTurns: 4, MaxTurns: 20, ToolCallTokens: 96, ToolResultTokens: 768,
		Rate: 4, ThinkTime: 1500 * time.Millisecond, Seed: 1,
	}
}

// maxResultFactor caps a tool result at this many times the mean, so the
// exponential's tail cannot make one prompt absurd.
const maxResultFactor = 8

// Validate reports the first out-of-range field.
func (c AgenticConfig) Validate() error {
	for _, f := range []struct {
		name string
		v    int
	}{
		{"Requests", c.Requests}, {"Agents", c.Agents}, {"SystemTokens", c.SystemTokens}, {"TaskTokens", c.TaskTokens},
		{"MinTurns", c.MinTurns}, {"ToolCallTokens", c.ToolCallTokens}, {"ToolResultTokens", c.ToolResultTokens},
	} {
		if f.v <= 0 {
			return fmt.Errorf("agentic workload: %s must be positive, got %d", f.name, f.v)
		}
	}
	if c.MaxTurns < c.MinTurns {
		return fmt.Errorf("agentic workload: MaxTurns %d is below MinTurns %d", c.MaxTurns, c.MinTurns)
	}
	if !(c.Rate > 0) || math.IsInf(c.Rate, 0) {
		return fmt.Errorf("agentic workload: Rate must be a positive finite number of requests per second, got %g", c.Rate)
	}
	if c.ThinkTime <= 0 {
		return fmt.Errorf("agentic workload: ThinkTime must be positive, got %v", c.ThinkTime)
	}
	turns := float64(c.MaxTurns)
	if longest := float64(c.SystemTokens+c.TaskTokens) + (turns-1)*float64(c.ToolCallTokens+maxResultFactor*c.ToolResultTokens); longest > maxPromptTokens {
		return fmt.Errorf("agentic workload: the last turn's prompt could have %.0f tokens, more than %d", longest, maxPromptTokens)
	}
	if span := float64(c.Requests)/c.Rate*float64(time.Second) + turns*float64(c.ThinkTime); span > float64(maxSpan) {
		return fmt.Errorf("agentic workload: %d requests at %g/s would span more than 100 years", c.Requests, c.Rate)
	}
	return nil
}

// thinkOf is turn k's Think: none for a session's first turn, at least 1 ns
// for the others, so that each of them waits for the turn before.
func thinkOf(k int, gap float64) time.Duration {
	if k == 0 {
		return 0
	}
	return max(duration(gap), 1)
}

// Agentic generates the workload, sorted by At (stable for equal At).
//
// Sessions start as a Poisson process at Rate / mean turns per second;
// each turn after the first follows the one before by an exponential
// ThinkTime: after its answer when the driver is closed-loop (Think is
// set; kvrouter sim), after its arrival otherwise (At). Turn k's prompt is
// turn k-1's, the tool call the model generated (ToolCallTokens, its output length)
// and the tool's result; the first turn's is the agent's system prompt
// and the task. Sessions are generated until Requests requests exist: the
// last one may be cut short. As in Synthetic, a session's turns share one
// backing array, system prompts of different kinds share no prefix, and
// sessions of one kind share exactly the system prompt.
func Agentic(c AgenticConfig) ([]Request, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	arrivals := rand.New(rand.NewPCG(c.Seed, arrivalStream))
	content := rand.New(rand.NewPCG(c.Seed, contentStream))
	systems, sessionOffset := systemPrompts(content, c.Agents, c.SystemTokens)
	meanTurns := float64(c.MinTurns+c.MaxTurns) / 2
	sessionGap := float64(time.Second) * meanTurns / c.Rate
	think := float64(c.ThinkTime)
	out := make([]Request, 0, c.Requests)
	var start float64
	results := make([]int, 0, c.MaxTurns)
	for i := 0; len(out) < c.Requests; i++ {
		start += arrivals.ExpFloat64() * sessionGap
		system := systems[arrivals.IntN(c.Agents)]
		turns := min(c.MinTurns+arrivals.IntN(c.MaxTurns-c.MinTurns+1), c.Requests-len(out))
		results = results[:0]
		total := c.SystemTokens + c.TaskTokens
		for range turns - 1 {
			r := min(max(1, int(arrivals.ExpFloat64()*float64(c.ToolResultTokens))), maxResultFactor*c.ToolResultTokens)
			results = append(results, r)
			total += c.ToolCallTokens + r
		}
		buf := make([]uint32, total)
		n := copy(buf, system)
		task := buf[n : n+c.TaskTokens]
		task[0] = distinctToken(uint64(i), sessionOffset)
		n += 1 + fillTokens(content, task[1:])
		at := start
		name := "a" + strconv.Itoa(i)
		for k := range turns {
			var gap float64
			if k > 0 {
				n += fillTokens(content, buf[n:n+c.ToolCallTokens])
				n += fillTokens(content, buf[n:n+results[k-1]])
				gap = arrivals.ExpFloat64() * think
				at += gap
			}
			out = append(out, Request{At: duration(at), Tokens: buf[:n:n], OSL: c.ToolCallTokens, Session: name, Think: thinkOf(k, gap)})
		}
	}
	slices.SortStableFunc(out, func(a, b Request) int { return cmp.Compare(a.At, b.At) })
	return out, nil
}
