// Package replay measures routing quality: it replays a workload open-loop
// through kvrouter's frontend in one routing mode after another, each time
// on a fresh fleet of simulated engines (or against any OpenAI-compatible
// endpoint), over real HTTP and real KV events, and records what every
// request experienced.
//
// Time: the engines run --speedup times faster than the timing model, and
// the workload's arrival times are divided by --arrival-speedup (more load)
// and by the speedup (same load, less wall time). Every latency is reported
// in model time (wall time × speedup), so a run at speedup 4 reads like one
// at speedup 1, only the router's and the harness's own CPU time is
// inflated by the speedup.
package replay

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/adapters/frontend"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/core/sched"
	"github.com/kvrouter/kvrouter/internal/serve"
	"github.com/kvrouter/kvrouter/lab/workload"
	"github.com/kvrouter/kvrouter/mocker/fleet"
	"github.com/kvrouter/kvrouter/mocker/server"
)

// Config is one replay; the comments name the flags of `kvrouter bench
// replay`.
type Config struct {
	Modes          []string // --modes: router modes, or DynamoKV
	Workers        int      // --workers: engines of each fleet
	Speedup        float64  // --speedup: engines' speedup ratio
	ArrivalSpeedup float64  // --arrival-speedup: divides the workload's arrival times
	Seed           uint64   // --seed: the router's tie-breaks
	// Target drives this OpenAI-compatible endpoint (--target) instead of
	// spawned fleets; Modes is then ignored and the run is named "target".
	// Several endpoints, comma-separated, take the requests in turn.
	Target string
	// SessionHeader (--session-header) names each request's session in
	// Dynamo's X-Dynamo-Session-ID header, which binds the session to the
	// engine of its first turn. With several routers (--target a,b, a
	// setup's +replicas=N) a session's turns then take the routers in turn,
	// so that every turn after the first comes through another router than
	// the turn before it, and the results count the sessions whose turns
	// went to more than one engine.
	SessionHeader bool
	Model         string // --model; "" = the fleet's, or the target's first model
	// Fleet configures the engines (block size, KV blocks, ...); its
	// worker count, speedup and ports are set by the replay.
	Fleet fleet.Config
	// Router is the router configuration of every mode; its Mode is set per
	// run, and the peer policies run without kvrouter's admission queue.
	Router router.Config
	// EngineMetricsInterval is the model-time interval at which modes that
	// score by engine-reported load read the engines' /metrics (50 ms).
	EngineMetricsInterval time.Duration
	// Progress receives a progress bar; nil = silent.
	Progress io.Writer
	// Prefill and Decode lay out a disaggregated fleet for the modes that
	// name no layout (--prefill-workers, --decode-workers); see Setup.
	Prefill, Decode int
	// Disagg is the frontend's disaggregation (--disagg-min-uncached-tokens,
	// ...), which a Setup's options adjust.
	Disagg frontend.Disagg
}

// DefaultKVBlocks is the engines' KV capacity in a replay: 131,072 blocks
// of 16 tokens, 2M tokens, what an 8B model with an FP8 KV cache holds on
// a 141 GB GPU. It matters: the Mooncake conversation trace returns to a
// conversation about 100 s later (median), and with vLLM's default-sized
// cache (16,384 blocks) every engine has evicted it by then, whatever the
// router did; the comparison would measure the cache size, not routing.
const DefaultKVBlocks = 131072

// DefaultConfig replays on 8 engines at speedup 1.
func DefaultConfig() Config {
	f := fleet.DefaultConfig()
	f.Engine.NumGPUBlocks = DefaultKVBlocks
	return Config{
		Modes:                 []string{string(sched.ModeKV), string(sched.ModeRoundRobin)},
		Workers:               8,
		Speedup:               1,
		ArrivalSpeedup:        1,
		Seed:                  1,
		Fleet:                 f,
		Router:                router.DefaultConfig(),
		EngineMetricsInterval: 50 * time.Millisecond,
	}
}

// DynamoKV names kv mode with Dynamo's cost function (no cache affinity,
// prefill load scale 1), so that kvrouter's kv mode is compared with the
// router it reimplements.
const DynamoKV = "dynamo-kv"

// ParseMode reads a mode of --modes: a router mode, or DynamoKV. Direct
// mode needs requests that name their worker, which a replay cannot give.
func ParseMode(s string) (sched.Mode, error) {
	if strings.TrimSpace(s) == DynamoKV {
		return sched.ModeKV, nil
	}
	m, err := sched.ParseMode(s)
	if err != nil {
		return "", fmt.Errorf("%w, or %s", err, DynamoKV)
	}
	if m == sched.ModeDirect {
		return "", errors.New("mode direct needs requests that name their worker; a replay cannot use it")
	}
	return m, nil
}

// ModeConfig is the router configuration of mode name (a mode of
// --modes) over base, for engines of blockSize tokens per block: what
// every harness comparing modes (bench replay, sim) runs, so that they
// compare the same policies.
func ModeConfig(base router.Config, name string, blockSize int) (router.Config, error) {
	mode, err := ParseMode(name)
	if err != nil {
		return router.Config{}, err
	}
	rcfg := base
	rcfg.Mode, rcfg.BlockSize = mode, blockSize
	if strings.TrimSpace(name) == DynamoKV {
		d := sched.DynamoDefaults()
		rcfg.Routing.CacheAffinity, rcfg.Routing.PrefillLoadScale = d.CacheAffinity, d.PrefillLoadScale
	}
	if mode != sched.ModeKV || strings.TrimSpace(name) == DynamoKV {
		// Predict-on-route and the learned prefill model are kvrouter's;
		// the policies compared with it see what the routers they stand
		// for see.
		rcfg.PredictedTTL = 0
		rcfg.PrefillLoadModel = ""
	}
	if mode != sched.ModeKV {
		// The admission queue is kvrouter's; the policies compared with it
		// dispatch at once, as the routers they stand for do.
		rcfg.QueueThreshold = nil
	}
	return rcfg, nil
}

// Record is what one request experienced, times in model milliseconds.
type Record struct {
	Index        int     `json:"index"`
	SentMS       float64 `json:"sent_ms"` // from the start of the run
	TTFTMS       float64 `json:"ttft_ms"`
	E2EMS        float64 `json:"e2e_ms"`
	PromptTokens int     `json:"prompt_tokens"`
	OutputTokens int     `json:"output_tokens"`
	CachedTokens int     `json:"cached_tokens"` // as the engine reported it
	Worker       string  `json:"worker,omitempty"`
	Err          string  `json:"error,omitempty"`
	// itl are the gaps between consecutive streamed chunks.
	itl []float64
}

// Run replays reqs in every mode of cfg (or once against cfg.Target) and
// returns the results in mode order.
func Run(ctx context.Context, cfg Config, reqs []workload.Request) (*Results, error) {
	if err := cfg.validate(len(reqs)); err != nil {
		return nil, err
	}
	res := &Results{Modes: map[string]*ModeResult{}, Config: cfg.describe(len(reqs))}
	res.Config.CeilingHitRate = CeilingHitRate(reqs, cfg.Fleet.Engine.BlockSize)
	if cfg.Target != "" {
		for _, t := range targets(cfg.Target) {
			model, err := probeTarget(ctx, t, cfg.Model)
			if err != nil {
				return nil, err
			}
			cfg.Model = model
		}
		res.Config.Model = cfg.Model
		recs, dur, err := drive(ctx, &cfg, "target", 1, 1, targets(cfg.Target), reqs)
		if err != nil {
			return nil, err
		}
		m := summarise(recs, dur, res.Config.CeilingHitRate, nil)
		if cfg.SessionHeader {
			m.Sessions, m.SplitSessions = splitSessions(recs, reqs)
		}
		res.add("target", m, recs)
		return res, nil
	}
	for i, mode := range cfg.Modes {
		recs, dur, names, pace, pd, err := runMode(ctx, &cfg, mode, i+1, len(cfg.Modes), reqs)
		if err != nil {
			return nil, fmt.Errorf("mode %s: %w", mode, err)
		}
		m := summarise(recs, dur, res.Config.CeilingHitRate, names)
		m.EngineDrift, m.EngineLagResets = pace.Drift(), pace.LagResets
		if cfg.SessionHeader {
			m.Sessions, m.SplitSessions = splitSessions(recs, reqs)
		}
		if pd != nil {
			// Decode engines report pulled blocks as cached: the prefill
			// engines' hits are the reuse that spared work.
			m.Disagg, m.PrefixHitRate = pd, pd.PrefillHitRate
		}
		res.add(mode, m, recs)
	}
	return res, nil
}

func (c *Config) validate(n int) error {
	switch {
	case n == 0:
		return errors.New("replay: the workload has no requests")
	case c.Target != "" && len(targets(c.Target)) == 0:
		return fmt.Errorf("replay: --target %q names no endpoint", c.Target)
	case c.Target == "" && len(c.Modes) == 0:
		return errors.New("replay: no modes to run")
	case c.Target == "" && c.Workers < 1:
		return fmt.Errorf("replay: need at least one worker, got %d", c.Workers)
	case c.Speedup <= 0 || c.ArrivalSpeedup <= 0:
		return fmt.Errorf("replay: speedups must be positive, got %g and %g", c.Speedup, c.ArrivalSpeedup)
	case c.Fleet.Engine.BlockSize <= 0:
		return fmt.Errorf("replay: block size must be positive, got %d", c.Fleet.Engine.BlockSize)
	}
	if c.Target != "" {
		c.Speedup = 1 // a real endpoint runs in real time
	}
	return nil
}

// probeTarget checks that the endpoint answers /v1/models before any load
// is sent, and picks its first model when none was named.
func probeTarget(ctx context.Context, target, model string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, strings.TrimRight(target, "/")+"/v1/models", nil)
	if err != nil {
		return "", fmt.Errorf("replay: target %q: %w", target, err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", fmt.Errorf("replay: target %s is unreachable: %w", target, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return "", fmt.Errorf("replay: target %s answered GET /v1/models with status %d", target, resp.StatusCode)
	}
	var list struct {
		Data []struct {
			ID string `json:"id"`
		} `json:"data"`
	}
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&list); err != nil {
		return "", fmt.Errorf("replay: target %s: GET /v1/models: %w", target, err)
	}
	if model != "" {
		return model, nil
	}
	if len(list.Data) == 0 {
		return "", fmt.Errorf("replay: target %s serves no model; name one with --model", target)
	}
	return list.Data[0].ID, nil
}

// runMode starts a fresh fleet and a frontend in mode, replays reqs
// through it and stops both.
//
// It also returns the engines' pacing: how far their steps ran behind the
// timing model (a machine too busy for the speedup makes them slower than
// the model, and every latency longer).
func runMode(ctx context.Context, cfg *Config, name string, nth, of int, reqs []workload.Request) ([]Record, time.Duration, map[uint64]string, server.Timing, *DisaggResult, error) {
	setup, err := ParseSetup(name, cfg.Workers, cfg.Prefill, cfg.Decode)
	if err != nil {
		return nil, 0, nil, server.Timing{}, nil, err
	}
	fcfg := cfg.Fleet
	fcfg.NumWorkers, fcfg.Roles, fcfg.SpeedupRatio = setup.Engines(), setup.roles(), cfg.Speedup
	fcfg.Host, fcfg.HTTPPort, fcfg.KVEventsPort, fcfg.KVEventsReplayPort = "127.0.0.1", 0, 0, 0
	if cfg.Model != "" {
		fcfg.Server.Model = cfg.Model
	}
	engines, err := fleet.Start(ctx, fcfg)
	if err != nil {
		return nil, 0, nil, server.Timing{}, nil, err
	}
	defer engines.Close()
	workers := serve.FleetWorkers(engines, fcfg)
	names := map[uint64]string{}
	for _, w := range workers {
		names[w.ID] = w.Name
	}
	rcfg, err := ModeConfig(cfg.Router, setup.Mode, fcfg.Engine.BlockSize)
	if err != nil {
		return nil, 0, nil, server.Timing{}, nil, err
	}
	rcfg.Rand = newLockedRand(cfg.Seed)
	disagg := cfg.Disagg
	if setup.MinUncached >= 0 {
		disagg.MinUncachedTokens = setup.MinUncached
	}
	if setup.NoReuse {
		off := false
		rcfg.Routing.AssumeKVReuse, disagg.NoAssumeKVReuse = &off, true
	}
	metricsEvery := max(time.Duration(float64(cfg.EngineMetricsInterval)/cfg.Speedup), 5*time.Millisecond)
	scfg := serve.Config{
		Router: rcfg, Workers: workers, Addr: "127.0.0.1:0",
		HealthInterval: time.Second, EngineMetricsInterval: metricsEvery,
		// The replay compares routing: a request the router's overload
		// guard refused would leave its slow tail out of a policy's
		// figures, and an overloaded policy would look better for it.
		HTTP:   serve.HTTPLimits{MaxConcurrentRequests: -1, MaxConnections: -1},
		Disagg: disagg,
	}
	var urls []string
	if setup.Replicas > 0 {
		var stop func()
		urls, stop, err = startReplicas(ctx, setup.Replicas, scfg, workers, fcfg.Engine.BlockSize, cfg.Seed)
		if err != nil {
			return nil, 0, nil, server.Timing{}, nil, err
		}
		defer stop()
	} else {
		s, err := serve.Start(ctx, scfg)
		if err != nil {
			return nil, 0, nil, server.Timing{}, nil, err
		}
		defer s.Close()
		ready, cancel := context.WithTimeout(ctx, 15*time.Second)
		defer cancel()
		if err := s.WaitReady(ready); err != nil {
			return nil, 0, nil, server.Timing{}, nil, fmt.Errorf("engines did not join routing: %w", err)
		}
		urls = []string{"http://" + s.Addr()}
	}
	run := *cfg
	run.Model = fcfg.Server.Model
	recs, dur, err := drive(ctx, &run, name, nth, of, urls, reqs)
	for i := range recs {
		if id, err := strconv.ParseUint(recs[i].Worker, 10, 64); err == nil && names[id] != "" {
			recs[i].Worker = names[id]
		}
	}
	if err != nil || !setup.Disaggregated() {
		return recs, dur, names, engines.Timing(), nil, err
	}
	pd, err := disaggStats(ctx, setup, engines, urls[0], len(recs))
	return recs, dur, names, engines.Timing(), pd, err
}

// targets splits --target into its endpoints.
func targets(target string) []string {
	var urls []string
	for _, u := range strings.Split(target, ",") {
		if u = strings.TrimRight(strings.TrimSpace(u), "/"); u != "" {
			urls = append(urls, u)
		}
	}
	return urls
}

// drive sends every request at its scaled arrival time and waits for all
// of them, the n-th request sent to urls[n mod len(urls)]: a client that
// alternates between router replicas, as a round-robin load balancer in
// front of them would. It returns the records and the model-time span
// from the first send to the last completion.
func drive(ctx context.Context, cfg *Config, name string, nth, of int, urls []string, reqs []workload.Request) ([]Record, time.Duration, error) {
	scale := cfg.ArrivalSpeedup * cfg.Speedup
	client := &http.Client{Transport: &http.Transport{
		MaxIdleConns: 4096, MaxIdleConnsPerHost: 4096, IdleConnTimeout: time.Minute,
		DialContext: (&net.Dialer{Timeout: 5 * time.Second}).DialContext,
	}}
	defer client.CloseIdleConnections()
	recs := make([]Record, len(reqs))
	var (
		wg              sync.WaitGroup
		sent, done, bad atomic.Int64
	)
	prog := newProgress(cfg.Progress, name, nth, of, len(reqs), &sent, &done, &bad)
	defer prog.stop()
	start := time.Now().Add(50 * time.Millisecond)
	order := make([]int, len(reqs))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(reqs[a].At, reqs[b].At) })
	turns := map[string][2]int{} // a session's first-seen rank and turns sent
	for n, i := range order {
		k := n
		if sess := reqs[i].Session; cfg.SessionHeader && sess != "" {
			t, ok := turns[sess]
			if !ok {
				t[0] = len(turns)
			}
			k = t[0] + t[1]
			t[1]++
			turns[sess] = t
		}
		url := urls[k%len(urls)]
		at := start.Add(time.Duration(float64(reqs[i].At) / scale))
		if d := time.Until(at); d > 0 {
			t := time.NewTimer(d)
			select {
			case <-ctx.Done():
				t.Stop()
				wg.Wait()
				return nil, 0, ctx.Err()
			case <-t.C:
			}
		}
		sent.Add(1)
		wg.Add(1)
		go func() {
			defer wg.Done()
			session := ""
			if cfg.SessionHeader {
				session = reqs[i].Session
			}
			recs[i] = send(ctx, client, url, cfg.Model, &reqs[i], cfg.Speedup, session)
			recs[i].Index = i
			recs[i].SentMS = float64(at.Sub(start)) / 1e6 * cfg.Speedup
			if recs[i].Err != "" {
				bad.Add(1)
			}
			done.Add(1)
		}()
	}
	wg.Wait()
	if ctx.Err() != nil {
		return nil, 0, ctx.Err()
	}
	var end float64
	for i := range recs {
		end = max(end, recs[i].SentMS+recs[i].E2EMS)
	}
	return recs, time.Duration(end * 1e6), nil
}

// RequestBody is a streamed token-id completion asking kvrouter's frontend
// to name the worker it chose (other endpoints ignore nvext).
func RequestBody(model string, r *workload.Request) []byte {
	b := make([]byte, 0, 64+len(r.Tokens)*7)
	b = append(b, `{"model":`...)
	b = strconv.AppendQuote(b, model)
	b = append(b, `,"prompt":[`...)
	for i, t := range r.Tokens {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendUint(b, uint64(t), 10)
	}
	b = append(b, `],"max_tokens":`...)
	b = strconv.AppendInt(b, int64(r.OSL), 10)
	if r.CacheSalt != "" {
		b = append(b, `,"cache_salt":`...)
		b = strconv.AppendQuote(b, r.CacheSalt)
	}
	b = append(b, `,"ignore_eos":true,"stream":true,"stream_options":{"include_usage":true},"nvext":{"extra_fields":["worker_id"]}}`...)
	return b
}

// chunk is the part of a streamed completion chunk the replay reads.
type chunk struct {
	Choices []json.RawMessage `json:"choices"`
	Usage   *struct {
		PromptTokens        int `json:"prompt_tokens"`
		CompletionTokens    int `json:"completion_tokens"`
		PromptTokensDetails *struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
	} `json:"usage"`
	NVExt *struct {
		WorkerID *uint64 `json:"worker_id"`
	} `json:"nvext"`
	Error *struct {
		Message string `json:"message"`
	} `json:"error"`
}

// send streams one request and measures it in model time; a session
// other than "" is named in X-Dynamo-Session-ID.
func send(ctx context.Context, client *http.Client, url, model string, r *workload.Request, speedup float64, session string) Record {
	rec := Record{PromptTokens: len(r.Tokens)}
	modelMS := func(d time.Duration) float64 { return float64(d) / 1e6 * speedup }
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/completions", bytes.NewReader(RequestBody(model, r)))
	if err != nil {
		rec.Err = err.Error()
		return rec
	}
	req.Header.Set("Content-Type", "application/json")
	if session != "" {
		req.Header.Set("X-Dynamo-Session-ID", session)
	}
	t0 := time.Now()
	resp, err := client.Do(req)
	if err != nil {
		rec.Err = err.Error()
		return rec
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		rec.Err = fmt.Sprintf("status %d: %s", resp.StatusCode, bytes.TrimSpace(b))
		return rec
	}
	br := bufio.NewReaderSize(resp.Body, 64<<10)
	var last time.Time
	chunks := 0
	for {
		line, err := br.ReadSlice('\n')
		if len(line) > 0 && bytes.HasPrefix(line, []byte("data: ")) {
			data := bytes.TrimSpace(line[len("data: "):])
			if bytes.Equal(data, []byte("[DONE]")) {
				break
			}
			now := time.Now()
			// Only the first chunk, the usage chunk and errors need
			// decoding; the rest are counted and timed.
			if chunks == 0 || bytes.Contains(data, []byte(`"prompt_tokens"`)) || bytes.Contains(data, []byte(`"error"`)) {
				var c chunk
				if json.Unmarshal(data, &c) != nil {
					rec.Err = "malformed stream chunk"
					return rec
				}
				if c.Error != nil {
					rec.Err = "stream error: " + c.Error.Message
					return rec
				}
				if c.NVExt != nil && c.NVExt.WorkerID != nil {
					rec.Worker = strconv.FormatUint(*c.NVExt.WorkerID, 10)
				}
				if c.Usage != nil {
					rec.OutputTokens = c.Usage.CompletionTokens
					if c.Usage.PromptTokensDetails != nil {
						rec.CachedTokens = c.Usage.PromptTokensDetails.CachedTokens
					}
				}
				if len(c.Choices) == 0 {
					continue
				}
			}
			if chunks == 0 {
				rec.TTFTMS = modelMS(now.Sub(t0))
			} else {
				rec.itl = append(rec.itl, modelMS(now.Sub(last)))
			}
			last = now
			chunks++
		}
		if err == bufio.ErrBufferFull {
			// A line longer than the buffer is no SSE chunk of ours; skip it.
			for err == bufio.ErrBufferFull {
				_, err = br.ReadSlice('\n')
			}
		}
		if err != nil {
			if err != io.EOF || chunks == 0 {
				rec.Err = "stream ended early"
				if err != io.EOF {
					rec.Err += ": " + err.Error()
				}
				return rec
			}
			break
		}
	}
	if chunks == 0 {
		rec.Err = "no tokens streamed"
		return rec
	}
	if rec.OutputTokens == 0 {
		rec.OutputTokens = chunks
	}
	rec.E2EMS = modelMS(time.Since(t0))
	return rec
}

// lockedRand is a seeded source safe for the frontend's concurrent
// decisions.
type lockedRand struct {
	mu sync.Mutex
	r  *rand.Rand
}

func newLockedRand(seed uint64) *lockedRand {
	return &lockedRand{r: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))}
}

func (l *lockedRand) IntN(n int) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.r.IntN(n)
}

func (l *lockedRand) Float64() float64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.r.Float64()
}
