package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/mocker/fleet"
)

// MockerConfig sets up `kvrouter bench mocker`: a fleet of simulated
// engines in this process under a closed-loop load of streaming requests.
type MockerConfig struct {
	Workers       int
	Speedup       float64
	Concurrency   int           // streams kept open at once
	Duration      time.Duration // measured time, after Warmup
	Warmup        time.Duration
	SystemPrompts int // distinct shared system prompts
	SystemTokens  int
	MinUser       int // unique prompt tokens per request, uniform in [MinUser, MaxUser]
	MaxUser       int
	MinOutput     int // max_tokens, uniform in [MinOutput, MaxOutput]
	MaxOutput     int
	Stream        bool
	Seed          uint64
}

// DefaultMockerConfig is the reference load: 16 engines at speedup
// 10 under 200 concurrent streams.
func DefaultMockerConfig() MockerConfig {
	return MockerConfig{Workers: 16, Speedup: 10, Concurrency: 200, Duration: 30 * time.Second, Warmup: 5 * time.Second,
		SystemPrompts: 8, SystemTokens: 1024, MinUser: 256, MaxUser: 2048, MinOutput: 64, MaxOutput: 256, Stream: true, Seed: 1}
}

// MockerResult reports how closely the simulation kept the model's pace.
type MockerResult struct {
	Drift          float64 `json:"drift"`          // (wall − model) / model over the measured window, all engines
	Steps          uint64  `json:"steps"`          // scheduler steps in the window
	ModelSeconds   float64 `json:"model_seconds"`  // Σ model step time / speedup
	ActualSeconds  float64 `json:"actual_seconds"` // Σ wall time of those steps
	LagResets      uint64  `json:"lag_resets"`     // times an engine fell more than 50 ms behind
	Requests       int     `json:"requests"`       // completed in the window
	Errors         int     `json:"errors"`         // failed requests
	TokensPerSec   float64 `json:"tokens_per_sec"` // streamed tokens received per wall second
	ClientTTFTp50  float64 `json:"client_ttft_p50_ms"`
	Workers        int     `json:"workers"`
	Speedup        float64 `json:"speedup"`
	Concurrency    int     `json:"concurrency"`
	DurationSecond float64 `json:"duration_s"`
}

// RunMocker starts the fleet, loads it, and measures the drift over the
// window after warm-up. Progress goes to progress once per second.
func RunMocker(ctx context.Context, cfg MockerConfig, progress io.Writer) (MockerResult, error) {
	fcfg := fleet.DefaultConfig()
	fcfg.NumWorkers, fcfg.SpeedupRatio = cfg.Workers, cfg.Speedup
	fcfg.HTTPPort, fcfg.KVEventsPort, fcfg.KVEventsReplayPort = 0, 0, 0
	f, err := fleet.Start(ctx, fcfg)
	if err != nil {
		return MockerResult{}, err
	}
	defer f.Close()

	rng := rand.New(rand.NewPCG(cfg.Seed, 5))
	systems := make([][]uint32, cfg.SystemPrompts)
	for i := range systems {
		systems[i] = randomTokens(rng, cfg.SystemTokens)
	}
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: cfg.Concurrency, MaxConnsPerHost: 0}}
	var (
		measuring atomic.Bool
		requests  atomic.Int64
		failures  atomic.Int64
		tokens    atomic.Int64
		ttftMu    sync.Mutex
		ttfts     []float64
	)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	engines := f.Engines()
	for c := range cfg.Concurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(cfg.Seed, uint64(c)+100))
			for i := 0; ctx.Err() == nil; i++ {
				prompt := append(append([]uint32(nil), systems[r.IntN(len(systems))]...), randomTokens(r, cfg.MinUser+r.IntN(cfg.MaxUser-cfg.MinUser+1))...)
				maxTokens := cfg.MinOutput + r.IntN(cfg.MaxOutput-cfg.MinOutput+1)
				url := engines[(c+i)%len(engines)].HTTPURL
				ttft, n, err := streamOnce(ctx, client, url, fcfg.Server.Model, prompt, maxTokens, cfg.Stream)
				if ctx.Err() != nil {
					return
				}
				if !measuring.Load() {
					continue
				}
				if err != nil {
					failures.Add(1)
					continue
				}
				requests.Add(1)
				tokens.Add(int64(n))
				ttftMu.Lock()
				ttfts = append(ttfts, float64(ttft.Microseconds())/1e3)
				ttftMu.Unlock()
			}
		}()
	}

	wait := func(d time.Duration, phase string) error {
		end := time.Now().Add(d)
		for time.Now().Before(end) {
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(min(time.Second, time.Until(end))):
			}
			if progress != nil {
				tm := f.Timing()
				fmt.Fprintf(progress, "mocker %s: %d steps, drift so far %+.2f%%, %d requests done\n", phase, tm.Steps, 100*tm.Drift(), requests.Load())
			}
		}
		return nil
	}
	if err := wait(cfg.Warmup, "warm-up"); err != nil {
		return MockerResult{}, err
	}
	before := f.Timing()
	measuring.Store(true)
	start := time.Now()
	if err := wait(cfg.Duration, "measuring"); err != nil {
		return MockerResult{}, err
	}
	after := f.Timing()
	elapsed := time.Since(start)
	measuring.Store(false)
	cancel()
	wg.Wait()

	model := after.Model - before.Model
	actual := after.Actual - before.Actual
	res := MockerResult{
		Steps: after.Steps - before.Steps, ModelSeconds: model.Seconds(), ActualSeconds: actual.Seconds(),
		LagResets: after.LagResets - before.LagResets,
		Requests:  int(requests.Load()), Errors: int(failures.Load()),
		TokensPerSec:  float64(tokens.Load()) / elapsed.Seconds(),
		ClientTTFTp50: Percentile(ttfts, 50),
		Workers:       cfg.Workers, Speedup: cfg.Speedup, Concurrency: cfg.Concurrency, DurationSecond: elapsed.Seconds(),
	}
	if model > 0 {
		res.Drift = float64(actual-model) / float64(model)
	}
	return res, f.PublishErr()
}

// streamOnce sends one completion and reads it to the end; it returns the
// time to the first token and the number of tokens received.
func streamOnce(ctx context.Context, client *http.Client, url, model string, ids []uint32, maxTokens int, stream bool) (time.Duration, int, error) {
	r, err := send(ctx, client, url, model, prompt{ids: ids}, maxTokens, stream, false)
	return r.ttft, r.tokens, err
}

// prompt is one request's input: token ids, or text sent as a completion
// prompt or, with chat, as the user message of a chat completion.
type prompt struct {
	ids  []uint32
	text string
	chat bool
}

type sent struct {
	ttft   time.Duration
	tokens int
	// timing is what a kvrouter frontend reported of the request (nvext
	// timing); nil when not asked or absent.
	timing *frontendTiming
}

// frontendTiming is the part of a kvrouter frontend's nvext timing the
// benches read, in ms: the time the frontend held the request before the
// engine got it, and the parts of it spent waiting in the admission queue,
// reading the body, tokenizing (or reading the token ids), routing (the
// queue's wait included) and, within routing, hashing the prompt, looking
// up the index and scheduling (scoring and booking).
type frontendTiming struct {
	FrontendMS float64 `json:"frontend_ms"`
	QueueMS    float64 `json:"queue_ms"`
	ReadMS     float64 `json:"read_ms"`
	TokenizeMS float64 `json:"tokenize_ms"`
	RoutingMS  float64 `json:"routing_ms"`
	HashMS     float64 `json:"hash_ms"`
	FindMS     float64 `json:"find_matches_ms"`
	ScheduleMS float64 `json:"scheduling_ms"`
}

// send posts one completion; with timing it asks a kvrouter frontend for
// its nvext timing and reads frontend_ms from the first chunk (or the
// whole response).
func send(ctx context.Context, client *http.Client, url, model string, p prompt, maxTokens int, stream, timing bool) (sent, error) {
	var res sent
	req := map[string]any{"model": model, "max_tokens": maxTokens, "stream": stream}
	path := "/v1/completions"
	switch {
	case p.chat:
		path = "/v1/chat/completions"
		req["messages"] = []map[string]string{{"role": "user", "content": p.text}}
	case p.ids != nil:
		req["prompt"] = p.ids
	default:
		req["prompt"] = p.text
	}
	if timing {
		req["nvext"] = map[string]any{"extra_fields": []string{"timing"}}
	}
	body, _ := json.Marshal(req)
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, url+path, bytes.NewReader(body))
	if err != nil {
		return res, err
	}
	hreq.Header.Set("Content-Type", "application/json")
	t0 := time.Now()
	resp, err := client.Do(hreq)
	if err != nil {
		return res, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		return res, fmt.Errorf("status %d: %s", resp.StatusCode, b)
	}
	var nv struct {
		NVExt struct {
			Timing *frontendTiming `json:"timing"`
		} `json:"nvext"`
	}
	if !stream {
		b, err := io.ReadAll(resp.Body)
		res.ttft, res.tokens = time.Since(t0), maxTokens
		if timing && json.Unmarshal(b, &nv) == nil {
			res.timing = nv.NVExt.Timing
		}
		return res, err
	}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, "data: {") {
			continue
		}
		if res.tokens == 0 {
			res.ttft = time.Since(t0)
			if timing && json.Unmarshal([]byte(line[len("data: "):]), &nv) == nil {
				res.timing = nv.NVExt.Timing
			}
		}
		res.tokens++
	}
	if res.tokens != maxTokens {
		return res, fmt.Errorf("received %d of %d tokens", res.tokens, maxTokens)
	}
	return res, sc.Err()
}
