package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"runtime/pprof"
	"slices"
	"strings"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	promModel "github.com/prometheus/common/model"

	"github.com/kvrouter/kvrouter/adapters/chattemplate"
	"github.com/kvrouter/kvrouter/adapters/metrics"
	"github.com/kvrouter/kvrouter/adapters/modeltok"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/internal/serve"
	"github.com/kvrouter/kvrouter/lab/workload"
	"github.com/kvrouter/kvrouter/mocker/fleet"
	"github.com/kvrouter/kvrouter/mocker/server"
)

// OverheadConfig sets up `kvrouter bench overhead`.
type OverheadConfig struct {
	Workers     int
	Speedup     float64
	Concurrency int // streams kept open
	ISL, OSL    int // prompt and output tokens of the streaming phase
	Duration    time.Duration
	Warmup      time.Duration
	// Short-completion throughput phase: ShortISL-token prompts, one output
	// token, not streamed, ShortConcurrency clients.
	ShortISL, ShortConcurrency int
	Seed                       uint64
	// Prompt is what requests carry: PromptTokens (ids: the frontend has
	// nothing to tokenize), PromptText (a completion prompt of about ISL
	// tokens) or PromptChat (the same text as a user message).
	Prompt string
	// Tokenizer is the Hugging Face tokenizer (directory or tokenizer.json)
	// of text and chat prompts: the engines tokenize with it, and so does
	// the frontend on its in-process run.
	Tokenizer string
	// ProfileRouted, when set, is called as the first routed streamed phase
	// starts and its result when it ends: a profile of that phase alone.
	// Goroutines carry the pprof label "part" (frontend, engines, clients)
	// so that a profile tells the frontend's own CPU from the load's.
	ProfileRouted func() (stop func()) `json:"-"`
	// EngineProcess, when set, runs the engines in a child process at a
	// lower CPU priority instead of in this one (see EngineProcess).
	EngineProcess *EngineProcess `json:",omitempty"`
	// ClientProcess, when set, runs each phase's clients in a child
	// process instead of in this one (see ClientProcess).
	ClientProcess *ClientProcess `json:",omitempty"`
	// EPP adds the routed loads through kvrouter's endpoint picker: a
	// gateway in front of the engines asks it over ext_proc (EPPResult).
	EPP bool `json:",omitempty"`
	// UIPage keeps a simulated dashboard open during the routed phases: a
	// client polling /ui/api/state once a second as the page does, so
	// that the router records decisions for it all along.
	UIPage bool
}

// What OverheadConfig.Prompt can be.
const (
	PromptTokens = "tokens"
	PromptText   = "text"
	PromptChat   = "chat"
)

// DefaultOverheadConfig is the reference load.
func DefaultOverheadConfig() OverheadConfig {
	return OverheadConfig{Workers: 4, Speedup: 1000, Concurrency: 200, ISL: 8192, OSL: 16, Duration: 15 * time.Second, Warmup: 3 * time.Second,
		ShortISL: 32, ShortConcurrency: 64, Seed: 1, Prompt: PromptTokens}
}

// Phase is one measured load.
type Phase struct {
	Requests   int     `json:"requests"`
	Errors     int     `json:"errors"`
	RequestsPS float64 `json:"requests_per_s"`
	TTFTp50ms  float64 `json:"ttft_p50_ms"`
	TTFTp99ms  float64 `json:"ttft_p99_ms"`
	TTFTmeanMs float64 `json:"ttft_mean_ms"`
	E2Ep50ms   float64 `json:"e2e_p50_ms"`
	E2Ep99ms   float64 `json:"e2e_p99_ms"`
	// Frontend* are what the kvrouter frontend reported holding each
	// request before the engine got it (routed phases only).
	FrontendP50ms float64 `json:"frontend_p50_ms,omitempty"`
	FrontendP99ms float64 `json:"frontend_p99_ms,omitempty"`
	// FrontendOwn* leave out the time a request waited in the router's
	// admission queue (Queue*) for an engine with room, which it would
	// otherwise have waited in that engine's own queue: the frontend's own
	// cost, parsing, tokenizing and routing.
	FrontendOwnP50ms float64 `json:"frontend_own_p50_ms,omitempty"`
	FrontendOwnP99ms float64 `json:"frontend_own_p99_ms,omitempty"`
	// FrontendSplit breaks the frontend's own time into its parts, each as
	// p50 and p99 over the requests (the parts' percentiles do not add up).
	FrontendSplit *FrontendSplit `json:"frontend_split,omitempty"`
	QueueP50ms    float64        `json:"queue_p50_ms,omitempty"`
	QueueP99ms    float64        `json:"queue_p99_ms,omitempty"`
	DurationSec   float64        `json:"duration_s"`
	// EngineDrift is how much longer the engines' steps took than the
	// model's pace over the phase, warmup included: (wall − model) / model.
	// Well above 0 the simulated engines could not keep up with the
	// speedup, and the cores were theirs rather than the frontend's.
	EngineDrift float64 `json:"engine_drift"`
}

// FrontendSplit is the frontend's own time by part, in ms: reading the
// body from the client, tokenizing (or reading the token ids), the routing
// decision, and the rest (parsing the JSON, building the engine's request).
type FrontendSplit struct {
	ReadP50ms     float64 `json:"read_p50_ms"`
	ReadP99ms     float64 `json:"read_p99_ms"`
	TokenizeP50ms float64 `json:"tokenize_p50_ms"`
	TokenizeP99ms float64 `json:"tokenize_p99_ms"`
	RoutingP50ms  float64 `json:"routing_p50_ms"`
	RoutingP99ms  float64 `json:"routing_p99_ms"`
	// Hash*, Find* and Schedule* are the routing decision's parts:
	// hashing the prompt's blocks, the index lookup (find_matches), and
	// scoring and booking the workers.
	HashP50ms     float64 `json:"hash_p50_ms"`
	HashP99ms     float64 `json:"hash_p99_ms"`
	FindP50ms     float64 `json:"find_matches_p50_ms"`
	FindP99ms     float64 `json:"find_matches_p99_ms"`
	ScheduleP50ms float64 `json:"scheduling_p50_ms"`
	ScheduleP99ms float64 `json:"scheduling_p99_ms"`
	OtherP50ms    float64 `json:"other_p50_ms"`
	OtherP99ms    float64 `json:"other_p99_ms"`
}

// OverheadResult compares the same load sent straight to the engines and
// through the router.
type OverheadResult struct {
	Direct Phase `json:"direct"`
	// Routed and ShortRouted went through a frontend that tokenizes text
	// and chat prompts in process.
	Routed      Phase   `json:"routed"`
	AddedP50ms  float64 `json:"added_ttft_p50_ms"`
	AddedP99ms  float64 `json:"added_ttft_p99_ms"`
	ShortDirect Phase   `json:"short_direct"`
	ShortRouted Phase   `json:"short_routed"`
	// RoutedEngine and ShortRoutedEngine (text and chat prompts only) are
	// the same loads through a frontend without a tokenizer, which asks an
	// engine's /tokenize for every prompt.
	RoutedEngine      *Phase `json:"routed_engine_tokenize,omitempty"`
	ShortRoutedEngine *Phase `json:"short_routed_engine_tokenize,omitempty"`
	// PromptTokens and ShortPromptTokens are the tokens of one text or chat
	// prompt of each load, as the engines count them.
	PromptTokens      int `json:"prompt_tokens,omitempty"`
	ShortPromptTokens int `json:"short_prompt_tokens,omitempty"`
	// Tokenized is kvrouter_frontend_tokenize_total of each routed run
	// ("in_process", "engine") by where the frontend tokenized, warm-ups
	// included: the proof that each run took the path it is named after.
	Tokenized map[string]map[string]int `json:"tokenized,omitempty"`
	// UIPolls counts the simulated dashboard's polls (UIPage), and
	// UIDecisions the decisions they were sent.
	UIPolls     int `json:"ui_polls,omitempty"`
	UIDecisions int `json:"ui_decisions,omitempty"`
	// EPP is the loads through the endpoint picker (OverheadConfig.EPP).
	EPP    *EPPResult `json:"epp,omitempty"`
	Config OverheadConfig
}

// RunOverhead measures what the frontend adds. All phases run in this
// process against the same engines, so they share the machine equally;
// prompts are unique (no prefix is ever cached), so routing choices cannot
// change the engines' work, and round-robin spreads the direct load the
// way an even router would. Text and chat prompts go through the router
// twice, once tokenized by the frontend and once by the engines'
// /tokenize, each on a fresh frontend whose tokenize counter must show
// only that path.
func RunOverhead(ctx context.Context, cfg OverheadConfig, progress io.Writer) (res OverheadResult, err error) {
	res.Config = cfg
	var tok *modeltok.Model
	switch cfg.Prompt {
	case PromptTokens:
	case PromptText, PromptChat:
		if cfg.Tokenizer == "" {
			return res, fmt.Errorf("%s prompts need a tokenizer", cfg.Prompt)
		}
		if tok, err = modeltok.Load(cfg.Tokenizer); err != nil {
			return res, err
		}
		if cfg.Prompt == PromptChat && !tok.HasChatTemplate() {
			return res, fmt.Errorf("chat prompts: %s has no chat template", cfg.Tokenizer)
		}
	default:
		return res, fmt.Errorf("prompt %q: want %s, %s or %s", cfg.Prompt, PromptTokens, PromptText, PromptChat)
	}
	fcfg := fleet.DefaultConfig()
	fcfg.NumWorkers, fcfg.SpeedupRatio = cfg.Workers, cfg.Speedup
	fcfg.HTTPPort, fcfg.KVEventsPort, fcfg.KVEventsReplayPort = 0, 0, 0
	fcfg.Server.MaxModelLen = 1 << 20
	if tok != nil {
		fcfg.Tokenizer = cfg.Tokenizer
	}
	var eng *simEngines
	if cfg.EngineProcess != nil {
		eng, err = cfg.EngineProcess.start(ctx, fcfg, progress)
	} else {
		eng, err = startFleet(ctx, fcfg)
	}
	if err != nil {
		return res, err
	}
	defer func() {
		if cerr := eng.close(); cerr != nil && err == nil {
			err = cerr
		}
	}()
	workers := eng.workers
	var direct []string
	for _, w := range workers {
		direct = append(direct, w.URL)
	}

	var long, short promptMaker = tokenPrompts(cfg.ISL), tokenPrompts(cfg.ShortISL)
	if tok != nil {
		if long, res.PromptTokens, err = textPrompts(tok, cfg.ISL, cfg.Prompt == PromptChat); err != nil {
			return res, err
		}
		if short, res.ShortPromptTokens, err = textPrompts(tok, cfg.ShortISL, cfg.Prompt == PromptChat); err != nil {
			return res, err
		}
	}
	phases := 0
	run := func(name string, targets []string, prompts promptMaker, osl, conc int, stream, timing bool) (Phase, error) {
		if progress != nil {
			fmt.Fprintf(progress, "overhead: %s, %d clients, %s prompts, %d output tokens...\n", name, conc, cfg.Prompt, osl)
		}
		phases++
		before, err := eng.timing(ctx)
		if err != nil {
			return Phase{}, err
		}
		spec, err := loadSpec(targets, eng.model, prompts, phases, osl, conc, stream, timing, cfg.Warmup, cfg.Duration, cfg.Seed)
		if err != nil {
			return Phase{}, err
		}
		var p Phase
		if cfg.ClientProcess != nil {
			p, err = cfg.ClientProcess.run(ctx, spec)
		} else {
			p, err = RunLoad(ctx, spec)
		}
		if err != nil {
			return p, err
		}
		after, err := eng.timing(ctx)
		p.EngineDrift = server.Timing{Model: after.Model - before.Model, Actual: after.Actual - before.Actual}.Drift()
		return p, err
	}
	if res.Direct, err = run("direct to the engines", direct, long, cfg.OSL, cfg.Concurrency, true, false); err != nil {
		return res, err
	}
	if res.ShortDirect, err = run("short completions, direct", direct, short, 1, cfg.ShortConcurrency, false, false); err != nil {
		return res, err
	}
	// routed runs both loads through a fresh frontend and checks, from its
	// metrics, that it tokenized where it should have.
	routed := func(where string, tokenizers map[string]*modeltok.Model, streamed, shortP *Phase) (err error) {
		rcfg := router.DefaultConfig()
		rcfg.QueueThreshold = nil // measure the path, not admission control
		specs := slices.Clone(workers)
		for i := range specs {
			// The engines' own tokenizer would otherwise be the frontend's
			// too: only the tokenizers given here may tokenize in process.
			specs[i].Tokenizer = ""
		}
		var s *serve.Server
		err = labelled(ctx, "frontend", func(ctx context.Context) (err error) {
			s, err = serve.Start(ctx, serve.Config{Router: rcfg, Workers: specs, Addr: "127.0.0.1:0", Tokenizers: tokenizers})
			return err
		})
		if err != nil {
			return err
		}
		defer s.Close()
		ready, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		if err := s.WaitReady(ready); err != nil {
			return err
		}
		label := "through the router"
		if tok != nil {
			label += map[string]string{"in_process": ", tokenized in process", "engine": ", tokenized by the engines' /tokenize"}[where]
		}
		target := []string{s.URL()}
		if cfg.UIPage {
			pageCtx, closePage := context.WithCancel(ctx)
			done := make(chan error, 1)
			go func() { done <- pollDashboard(pageCtx, s.URL(), &res.UIPolls, &res.UIDecisions) }()
			defer func() {
				closePage()
				if perr := <-done; perr != nil && err == nil {
					err = perr
				}
			}()
		}
		stopProfile := func() {}
		if cfg.ProfileRouted != nil && where == "in_process" {
			stopProfile = cfg.ProfileRouted()
		}
		*streamed, err = run(label, target, long, cfg.OSL, cfg.Concurrency, true, true)
		stopProfile()
		if err != nil {
			return err
		}
		if *shortP, err = run("short completions, "+label, target, short, 1, cfg.ShortConcurrency, false, true); err != nil {
			return err
		}
		if tok == nil {
			return nil
		}
		counts, err := tokenizeCounts(ctx, s.URL())
		if err != nil {
			return err
		}
		if res.Tokenized == nil {
			res.Tokenized = map[string]map[string]int{}
		}
		res.Tokenized[where] = counts
		return checkTokenized(where, counts, streamed.Requests+shortP.Requests)
	}
	var inProcess map[string]*modeltok.Model
	if tok != nil {
		inProcess = map[string]*modeltok.Model{"": tok}
	}
	if err := routed("in_process", inProcess, &res.Routed, &res.ShortRouted); err != nil {
		return res, err
	}
	res.AddedP50ms = res.Routed.TTFTp50ms - res.Direct.TTFTp50ms
	res.AddedP99ms = res.Routed.TTFTp99ms - res.Direct.TTFTp99ms
	if cfg.EPP {
		specs := slices.Clone(workers)
		for i := range specs {
			specs[i].Tokenizer = "" // as the routed run: only inProcess tokenizes in process
		}
		res.EPP, err = eppPhases(ctx, specs, inProcess, func(target []string, streamed bool) (Phase, error) {
			if streamed {
				return run("through a gateway asking the endpoint picker", target, long, cfg.OSL, cfg.Concurrency, true, false)
			}
			return run("short completions, through a gateway asking the endpoint picker", target, short, 1, cfg.ShortConcurrency, false, false)
		})
		if err != nil {
			return res, fmt.Errorf("endpoint picker: %w", err)
		}
		res.EPP.AddedP50ms = res.EPP.Streamed.TTFTp50ms - res.Direct.TTFTp50ms
		res.EPP.AddedP99ms = res.EPP.Streamed.TTFTp99ms - res.Direct.TTFTp99ms
	}
	if tok != nil {
		res.RoutedEngine, res.ShortRoutedEngine = new(Phase), new(Phase)
		if err := routed("engine", nil, res.RoutedEngine, res.ShortRoutedEngine); err != nil {
			return res, err
		}
	}
	return res, nil
}

// labelled runs start with the pprof label part=name, which the
// goroutines it starts (servers, their connections) inherit.
func labelled(ctx context.Context, name string, start func(context.Context) error) error {
	ctx = pprof.WithLabels(ctx, pprof.Labels("part", name))
	pprof.SetGoroutineLabels(ctx)
	defer pprof.SetGoroutineLabels(context.Background())
	return start(ctx)
}

// promptMaker makes the prompts of a phase: phase(n)(rng, client, i) is
// client's i-th prompt of the n-th phase.
type promptMaker interface {
	phase(n int) func(rng *rand.Rand, client, i int) prompt
}

// tokenPrompts are n random token ids, drawn from each client's seeded
// stream as before text prompts existed, so the figures stay comparable.
type tokenPrompts int

func (n tokenPrompts) phase(int) func(*rand.Rand, int, int) prompt {
	return func(rng *rand.Rand, _, _ int) prompt { return prompt{ids: randomTokens(rng, int(n))} }
}

// textBody is a text of about tokens tokens; each prompt starts with a
// line naming its phase, client and number, so no two share a KV block
// (the first block differs) and no phase hits the cache of another.
type textBody struct {
	text string
	chat bool
}

func (b textBody) phase(n int) func(*rand.Rand, int, int) prompt {
	return func(_ *rand.Rand, c, i int) prompt {
		return prompt{text: fmt.Sprintf("Phase %d, client %d, request %d.\n", n, c, i) + b.text, chat: b.chat}
	}
}

// textPrompts builds the text prompts of about tokens tokens with tok (the
// prose and code of bench tokenize, cut to length), and returns the tokens
// of one of them as the engines count them.
func textPrompts(tok *modeltok.Model, tokens int, chat bool) (textBody, int, error) {
	full := workload.ProseAndCode(tokens/100 + 1)
	ids, err := tok.EncodeText(full, false)
	if err != nil {
		return textBody{}, 0, err
	}
	body := textBody{text: full[:min(len(full), len(full)*tokens/max(1, len(ids)))], chat: chat}
	p := body.phase(1)(nil, 0, 0)
	if !chat {
		ids, err = tok.EncodeText(p.text, true)
		return body, len(ids), err
	}
	msg, _ := json.Marshal(map[string]string{"role": "user", "content": p.text})
	ids, _, err = tok.EncodeChat([]json.RawMessage{msg}, chattemplate.Options{AddGenerationPrompt: true}, false)
	return body, len(ids), err
}

// checkTokenized fails unless a frontend meant to tokenize where tokenized
// every measured request there and none elsewhere: a figure labelled
// in-process that came from /tokenize (a tokenizer that did not load, a
// request shape the frontend hands to the engine) would be worse than none.
func checkTokenized(where string, counts map[string]int, measured int) error {
	for w, n := range counts {
		if w != where && n > 0 {
			return fmt.Errorf("the frontend meant to tokenize %s tokenized %d prompts %s (kvrouter_frontend_tokenize_total %v)", where, n, w, counts)
		}
	}
	if counts[where] < measured {
		return fmt.Errorf("the frontend meant to tokenize %s counted %d prompts there for %d measured requests (kvrouter_frontend_tokenize_total %v)", where, counts[where], measured, counts)
	}
	return nil
}

// ScrapeMetrics reads the Prometheus text exposition of base's /metrics.
func ScrapeMetrics(ctx context.Context, base string) (map[string]*dto.MetricFamily, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimRight(base, "/")+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	p := expfmt.NewTextParser(promModel.UTF8Validation)
	return p.TextToMetricFamilies(resp.Body)
}

// tokenizeCounts reads kvrouter_frontend_tokenize_total from a frontend's
// /metrics, summed over models, by where.
func tokenizeCounts(ctx context.Context, base string) (map[string]int, error) {
	families, err := ScrapeMetrics(ctx, base)
	if err != nil {
		return nil, fmt.Errorf("frontend /metrics: %w", err)
	}
	counts := map[string]int{}
	for _, m := range families[metrics.Namespace+"_frontend_tokenize_total"].GetMetric() {
		for _, l := range m.GetLabel() {
			if l.GetName() == "where" {
				counts[l.GetValue()] += int(m.GetCounter().GetValue())
			}
		}
	}
	return counts, nil
}

// loadPhase keeps conc clients busy against targets (round-robin) and
// measures after warmup.
func loadPhase(ctx context.Context, targets []string, model string, mk func(rng *rand.Rand, client, i int) prompt, osl, conc int, stream, timing bool, warmup, duration time.Duration, seed uint64) (Phase, error) {
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: conc}}
	defer client.CloseIdleConnections()
	type sample struct {
		ttft, e2e float64
		sent
	}
	rngs := make([]*rand.Rand, conc)
	for c := range rngs {
		rngs[c] = rand.New(rand.NewPCG(seed, uint64(c)+7))
	}
	ctx = pprof.WithLabels(ctx, pprof.Labels("part", "clients"))
	pprof.SetGoroutineLabels(ctx)
	defer pprof.SetGoroutineLabels(context.Background())
	w, _ := ClosedLoop(ctx, conc, warmup, duration, func(ctx context.Context, c, i int) (sample, error) {
		p := mk(rngs[c], c, i)
		t0 := time.Now()
		res, err := send(ctx, client, targets[(c+i)%len(targets)], model, p, osl, stream, timing)
		return sample{float64(res.ttft.Microseconds()) / 1e3, float64(time.Since(t0).Microseconds()) / 1e3, res}, err
	})
	var ttfts, e2es, held, own, queued, read, tokenize, routing, hash, find, schedule, other []float64
	for _, s := range w.Samples {
		ttfts, e2es = append(ttfts, s.ttft), append(e2es, s.e2e)
		if t := s.timing; t != nil {
			held, queued = append(held, t.FrontendMS), append(queued, t.QueueMS)
			own = append(own, max(0, t.FrontendMS-t.QueueMS))
			read, tokenize, routing = append(read, t.ReadMS), append(tokenize, t.TokenizeMS), append(routing, t.RoutingMS)
			hash, find, schedule = append(hash, t.HashMS), append(find, t.FindMS), append(schedule, t.ScheduleMS)
			other = append(other, max(0, t.FrontendMS-t.ReadMS-t.TokenizeMS-t.RoutingMS)) // routing_ms holds queue_ms
		}
	}
	elapsed := w.Elapsed
	p := Phase{
		Requests: len(ttfts), Errors: w.Errors, RequestsPS: float64(len(ttfts)) / elapsed.Seconds(),
		TTFTmeanMs: Mean(ttfts), TTFTp50ms: Percentile(ttfts, 50), TTFTp99ms: Percentile(ttfts, 99),
		E2Ep50ms: Percentile(e2es, 50), E2Ep99ms: Percentile(e2es, 99), DurationSec: elapsed.Seconds(),
		FrontendP50ms: Percentile(held, 50), FrontendP99ms: Percentile(held, 99),
		FrontendOwnP50ms: Percentile(own, 50), FrontendOwnP99ms: Percentile(own, 99),
		QueueP50ms: Percentile(queued, 50), QueueP99ms: Percentile(queued, 99),
	}
	if len(held) > 0 {
		p.FrontendSplit = &FrontendSplit{
			ReadP50ms: Percentile(read, 50), ReadP99ms: Percentile(read, 99),
			TokenizeP50ms: Percentile(tokenize, 50), TokenizeP99ms: Percentile(tokenize, 99),
			RoutingP50ms: Percentile(routing, 50), RoutingP99ms: Percentile(routing, 99),
			HashP50ms: Percentile(hash, 50), HashP99ms: Percentile(hash, 99),
			FindP50ms: Percentile(find, 50), FindP99ms: Percentile(find, 99),
			ScheduleP50ms: Percentile(schedule, 50), ScheduleP99ms: Percentile(schedule, 99),
			OtherP50ms: Percentile(other, 50), OtherP99ms: Percentile(other, 99),
		}
	}
	if p.Requests == 0 && w.FirstErr != nil {
		return p, fmt.Errorf("no request succeeded: %w", w.FirstErr)
	}
	return p, nil
}

// pollDashboard does what an open /ui page does, once a second until ctx
// ends: fetch the state with the decisions since the last poll. A poll
// that fails or answers anything but 200 ends the run with an error.
func pollDashboard(ctx context.Context, base string, polls, decisions *int) error {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	var next uint64
	for {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, fmt.Sprintf("%s/ui/api/state?since=%d", base, next), nil)
		if err != nil {
			return err
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("dashboard poll: %w", err)
		}
		var st struct {
			Next      uint64            `json:"next"`
			Decisions []json.RawMessage `json:"decisions"`
		}
		err = json.NewDecoder(resp.Body).Decode(&st)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("dashboard poll: status %d, %v", resp.StatusCode, err)
		}
		*polls++
		*decisions += len(st.Decisions)
		next = st.Next
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}
