package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"strconv"
	"time"
)

// LoadSpec is one phase of load as a clients' child process runs it (see
// ClientProcess): everything loadPhase takes, in a form that crosses a
// process boundary.
type LoadSpec struct {
	Targets []string `json:"targets"`
	Model   string   `json:"model"`
	// Prompts are TokenIDs random token ids, or, when Text is set, that
	// text as a completion prompt (Chat: a chat user message) headed by a
	// line naming the phase, client and request.
	TokenIDs    int           `json:"token_ids,omitempty"`
	Text        string        `json:"text,omitempty"`
	Chat        bool          `json:"chat,omitempty"`
	Phase       int           `json:"phase"`
	OSL         int           `json:"osl"`
	Concurrency int           `json:"concurrency"`
	Stream      bool          `json:"stream"`
	Timing      bool          `json:"timing"`
	Warmup      time.Duration `json:"warmup"`
	Duration    time.Duration `json:"duration"`
	Seed        uint64        `json:"seed"`
}

// RunLoad runs spec's load in this process: bench overhead's clients, in
// its own process or in a clients' child process, which prints the Phase.
func RunLoad(ctx context.Context, spec LoadSpec) (Phase, error) {
	var prompts promptMaker = tokenPrompts(spec.TokenIDs)
	if spec.Text != "" {
		prompts = textBody{text: spec.Text, chat: spec.Chat}
	}
	return loadPhase(ctx, spec.Targets, spec.Model, prompts.phase(spec.Phase), spec.OSL, spec.Concurrency, spec.Stream, spec.Timing, spec.Warmup, spec.Duration, spec.Seed)
}

// ClientProcess runs each phase's clients as `kvrouter bench
// overhead-clients` in a child process, as a router's clients run on
// machines of their own: the frontend's process then holds the frontend
// alone, and its latency is not its goroutines' wait behind the clients'.
type ClientProcess struct {
	Binary string // the kvrouter binary
	Nice   int    // the child's niceness (nice(1))
}

// run runs spec in a child and returns the Phase it printed.
func (p ClientProcess) run(ctx context.Context, spec LoadSpec) (Phase, error) {
	nice, err := exec.LookPath("nice")
	if err != nil {
		return Phase{}, fmt.Errorf("clients in a child process need nice(1): %w", err)
	}
	in, err := json.Marshal(spec)
	if err != nil {
		return Phase{}, err
	}
	cmd := exec.CommandContext(ctx, nice, "-n", strconv.Itoa(p.Nice), p.Binary, "bench", "overhead-clients")
	var out, errOut bytes.Buffer
	cmd.Stdin, cmd.Stdout, cmd.Stderr = bytes.NewReader(in), &out, &errOut
	if err := cmd.Run(); err != nil {
		return Phase{}, fmt.Errorf("clients' process: %w: %s", err, bytes.TrimSpace(errOut.Bytes()))
	}
	var ph Phase
	if err := json.Unmarshal(out.Bytes(), &ph); err != nil {
		return Phase{}, fmt.Errorf("clients' process printed no phase: %w: %.200q", err, out.Bytes())
	}
	return ph, nil
}

// loadSpec describes a phase's load, for RunLoad here or in a clients'
// child process.
func loadSpec(targets []string, model string, prompts promptMaker, phase, osl, conc int, stream, timing bool, warmup, duration time.Duration, seed uint64) (LoadSpec, error) {
	spec := LoadSpec{Targets: targets, Model: model, Phase: phase, OSL: osl, Concurrency: conc, Stream: stream, Timing: timing, Warmup: warmup, Duration: duration, Seed: seed}
	switch p := prompts.(type) {
	case tokenPrompts:
		spec.TokenIDs = int(p)
	case textBody:
		spec.Text, spec.Chat = p.text, p.chat
	default:
		return spec, fmt.Errorf("prompts of type %T cannot be sent to a clients' process", prompts)
	}
	return spec, nil
}
