// Package abuse runs the router against misbehaving engines and hostile
// clients, one scenario at a time, and gives each a verdict with the
// figure it was judged by. It is what `kvrouter bench abuse` runs.
//
// Every scenario starts its own router (internal/serve, in this process,
// on 127.0.0.1) in front of simulated engines (mocker/fleet) and, where
// the scenario wants one, a misbehaving engine made of a plain HTTP
// server and a ZMQ publisher. Memory figures are the Go heap of this
// process, sampled every 10 ms: the engines' share of it is small and
// steady, and what a scenario adds is the router's.
package abuse

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"runtime"
	"slices"
	"strings"
	"sync"
	"text/tabwriter"
	"time"
)

// Config is one run; the comments name the flags of `kvrouter bench
// abuse`.
type Config struct {
	// Scenarios to run, by name (--scenarios); nil runs them all.
	Scenarios []string
	// Requests per misbehaving-engine scenario (--requests).
	Requests int
	// HeaderTimeout is the router's --engine-header-timeout, and also its
	// --engine-response-timeout, for the run (--engine-header-timeout).
	HeaderTimeout time.Duration
	// ChainBlocks is the length of the hostile engine's chain of KV
	// blocks (--chain-blocks); the probe used 10,000,000.
	ChainBlocks int
	// DumpBlocks is the size of the index the dump flood reads
	// (--dump-blocks); the probe used 1,000,000 and 10,000,000.
	DumpBlocks int
	// LabelModels is how many distinct model names the label flood sends
	// (--label-models); the probe used 50,000.
	LabelModels int
	// DumpClients call /router/dump_events at once (--dump-clients).
	DumpClients int
	// CancelClients start a stream each and cancel it (--cancel-clients).
	CancelClients int
	// Progress, when set, gets a line per scenario.
	Progress io.Writer
}

// DefaultConfig runs every scenario in well under a minute.
func DefaultConfig() Config {
	return Config{
		Requests: 100, HeaderTimeout: time.Second, ChainBlocks: 200_000, DumpBlocks: 50_000, LabelModels: 5_000,
		DumpClients: 8, CancelClients: 200,
	}
}

// Verdict is one scenario's outcome.
type Verdict struct {
	Scenario string `json:"scenario"`
	Pass     bool   `json:"pass"`
	// Measured is the figure the verdict rests on, in words; Want what
	// passes.
	Measured string             `json:"measured"`
	Want     string             `json:"want"`
	Figures  map[string]float64 `json:"figures"`
	Seconds  float64            `json:"seconds"`
	Error    string             `json:"error,omitempty"` // the scenario could not run
}

// Results is a run's outcome.
type Results struct {
	Config struct {
		Command         string   `json:"command,omitempty"`
		Scenarios       []string `json:"scenarios"`
		Requests        int      `json:"requests"`
		HeaderTimeoutS  float64  `json:"header_timeout_s"`
		ChainBlocks     int      `json:"chain_blocks"`
		DumpBlocks      int      `json:"dump_blocks"`
		LabelModels     int      `json:"label_models"`
		DumpClients     int      `json:"dump_clients"`
		CancelClients   int      `json:"cancel_clients"`
		GoMaxProcs      int      `json:"gomaxprocs"`
		DurationSeconds float64  `json:"duration_s"`
	} `json:"config"`
	Verdicts []Verdict `json:"verdicts"`
	Pass     bool      `json:"pass"`
}

// scenario runs once against a fresh router and fills v.
type scenario struct {
	name, what string
	run        func(ctx context.Context, cfg Config, v *Verdict) error
}

var scenarios = []scenario{
	{"engine-hang", "an engine that answers /health, accepts requests and never answers them", runHang},
	{"engine-drip", "an engine that sends a first chunk, then one byte every 100 ms, to clients that give up", runDrip},
	{"engine-huge-line", "an engine that streams one 64 MiB line", runHugeLine},
	{"engine-non-sse", "an engine that answers a stream with a JSON body", runNonSSE},
	{"engine-short-body", "an engine that closes a non-streamed answer before its Content-Length", runShortBody},
	{"event-chain", "an engine that publishes one chain of blocks far beyond its declared capacity", runChain},
	{"label-flood", "requests naming distinct models to engines serving any model", runLabels},
	{"dump-flood", "concurrent /router/dump_events without a token", runDumps},
	{"cancel-storm", "clients that start streams and cancel them at the first chunk", runCancels},
}

// Names lists the scenarios in the order they run.
func Names() []string {
	out := make([]string, len(scenarios))
	for i, s := range scenarios {
		out[i] = s.name
	}
	return out
}

// Describe is one line per scenario.
func Describe() string {
	var b strings.Builder
	for _, s := range scenarios {
		fmt.Fprintf(&b, "  %-18s %s\n", s.name, s.what)
	}
	return b.String()
}

// Run runs the scenarios of cfg one after the other.
func Run(ctx context.Context, cfg Config) (*Results, error) {
	def := DefaultConfig()
	if cfg.Requests <= 0 {
		cfg.Requests = def.Requests
	}
	if cfg.HeaderTimeout <= 0 {
		cfg.HeaderTimeout = def.HeaderTimeout
	}
	if cfg.ChainBlocks <= 0 {
		cfg.ChainBlocks = def.ChainBlocks
	}
	if cfg.DumpBlocks <= 0 {
		cfg.DumpBlocks = def.DumpBlocks
	}
	if cfg.LabelModels <= 0 {
		cfg.LabelModels = def.LabelModels
	}
	if cfg.DumpClients <= 0 {
		cfg.DumpClients = def.DumpClients
	}
	if cfg.CancelClients <= 0 {
		cfg.CancelClients = def.CancelClients
	}
	for _, name := range cfg.Scenarios {
		if !slices.Contains(Names(), name) {
			return nil, fmt.Errorf("abuse: no scenario %q (have %s)", name, strings.Join(Names(), ", "))
		}
	}
	res := &Results{Pass: true}
	c := &res.Config
	c.Requests, c.HeaderTimeoutS, c.ChainBlocks, c.DumpBlocks, c.LabelModels = cfg.Requests, cfg.HeaderTimeout.Seconds(), cfg.ChainBlocks, cfg.DumpBlocks, cfg.LabelModels
	c.DumpClients, c.CancelClients, c.GoMaxProcs = cfg.DumpClients, cfg.CancelClients, runtime.GOMAXPROCS(0)
	start := time.Now()
	for _, s := range scenarios {
		if cfg.Scenarios != nil && !slices.Contains(cfg.Scenarios, s.name) {
			continue
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		c.Scenarios = append(c.Scenarios, s.name)
		v := Verdict{Scenario: s.name, Figures: map[string]float64{}}
		t0 := time.Now()
		if err := s.run(ctx, cfg, &v); err != nil {
			v.Pass, v.Error = false, err.Error()
		}
		v.Seconds = time.Since(t0).Seconds()
		res.Verdicts = append(res.Verdicts, v)
		res.Pass = res.Pass && v.Pass
		if cfg.Progress != nil {
			fmt.Fprintf(cfg.Progress, "%-18s %s  %s (%.1f s)\n", s.name, verdictWord(v), v.Measured, v.Seconds)
		}
		runtime.GC() // one scenario's garbage does not weigh on the next
	}
	c.DurationSeconds = time.Since(start).Seconds()
	return res, nil
}

func verdictWord(v Verdict) string {
	switch {
	case v.Error != "":
		return "ERROR"
	case v.Pass:
		return "pass"
	}
	return "FAIL"
}

// Table is the verdicts as a text table.
func Table(res *Results) string {
	var b strings.Builder
	tw := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "SCENARIO\tVERDICT\tMEASURED\tPASSES WHEN\tTIME")
	for _, v := range res.Verdicts {
		measured := v.Measured
		if v.Error != "" {
			measured = v.Error
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%.1f s\n", v.Scenario, verdictWord(v), measured, v.Want, v.Seconds)
	}
	tw.Flush()
	if res.Pass {
		b.WriteString("\nverdict: pass\n")
	} else {
		b.WriteString("\nverdict: FAIL\n")
	}
	return b.String()
}

// JSON is the results as indented JSON.
func JSON(res *Results) ([]byte, error) { return json.MarshalIndent(res, "", "  ") }

// heapPeak samples the Go heap until stopped and reports its peak above
// where it stood at the start.
type heapPeak struct {
	base, peak uint64
	stop       chan struct{}
	done       sync.WaitGroup
}

func watchHeap() *heapPeak {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	h := &heapPeak{base: ms.HeapInuse, peak: ms.HeapInuse, stop: make(chan struct{})}
	h.done.Go(func() {
		t := time.NewTicker(10 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-h.stop:
				return
			case <-t.C:
			}
			runtime.ReadMemStats(&ms)
			h.peak = max(h.peak, ms.HeapInuse)
		}
	})
	return h
}

// end stops sampling and returns the peak growth in MiB.
func (h *heapPeak) end() float64 {
	close(h.stop)
	h.done.Wait()
	return float64(h.peak-h.base) / (1 << 20)
}
