package replay

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strconv"
	"time"

	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/internal/serve"
	"github.com/kvrouter/kvrouter/lab/bench"
	"github.com/kvrouter/kvrouter/lab/workload"
	"github.com/kvrouter/kvrouter/mocker/fleet"
)

// HotSetConfig sets up `kvrouter bench hotset`: a hot set of conversations
// cached on the first of two engines, continued by closed-loop clients.
// The load it makes is decode (every client's request reads its
// conversation's KV at each step) rather than prefill (each adds a few
// tokens), the case a router must not answer by keeping everything where
// the cache is.
type HotSetConfig struct {
	Clients       []int    // one run per client count and mode
	Modes         []string // ParseMode's names: kv, dynamo-kv, ...
	Speedup       float64  // the engines' --speedup-ratio
	Conversations int
	HistoryTokens int // each conversation's cached history
	TurnTokens    int // new tokens per request
	OutputTokens  int
	Duration      time.Duration // measured, after Warmup
	Warmup        time.Duration
	Fleet         fleet.Config // the two engines (NumWorkers is set to 2)
	Router        router.Config
	Seed          uint64
}

// DefaultHotSetConfig is the reference scenario: 8 conversations of 4,000
// tokens, requests of 16 new and 32 output tokens, 15 s per run at 12 and
// 48 clients, kv against Dynamo's cost, on two engines of vLLM's default
// size at speedup 1.
func DefaultHotSetConfig() HotSetConfig {
	return HotSetConfig{
		Clients: []int{12, 48}, Modes: []string{"kv", DynamoKV}, Speedup: 1,
		Conversations: 8, HistoryTokens: 4000, TurnTokens: 16, OutputTokens: 32,
		Duration: 15 * time.Second, Warmup: time.Second,
		Fleet: fleet.DefaultConfig(), Router: router.DefaultConfig(), Seed: 1,
	}
}

// HotSetRow is one run of the hot set.
type HotSetRow struct {
	Clients int    `json:"clients"`
	Mode    string `json:"mode"`
	// Served is the requests each engine served in the measured window,
	// the first engine (which cached the conversations) first.
	Served   []int   `json:"served"`
	TTFTP50  float64 `json:"ttft_p50_ms"` // model ms
	TTFTP90  float64 `json:"ttft_p90_ms"`
	RPS      float64 `json:"requests_per_s"` // per model second
	HitRate  float64 `json:"hit_rate"`       // cached / prompt tokens, as the engines counted
	Errors   int     `json:"errors"`
	FirstErr string  `json:"first_error,omitempty"`
}

// RunHotSet runs every client count in every mode, each on a new fleet and
// router. Progress goes to progress.
func RunHotSet(ctx context.Context, cfg HotSetConfig, progress io.Writer) ([]HotSetRow, error) {
	switch {
	case len(cfg.Clients) == 0 || len(cfg.Modes) == 0:
		return nil, errors.New("bench hotset: name at least one client count and one mode")
	case cfg.Conversations < 1 || cfg.HistoryTokens < 1 || cfg.TurnTokens < 1 || cfg.OutputTokens < 1:
		return nil, errors.New("bench hotset: conversations, history, turn and output tokens must be ≥ 1")
	case cfg.Speedup <= 0 || cfg.Duration <= 0 || cfg.Warmup < 0:
		return nil, errors.New("bench hotset: speedup and duration must be positive, warmup ≥ 0")
	}
	for _, c := range cfg.Clients {
		if c < 1 {
			return nil, fmt.Errorf("bench hotset: %d clients: want at least 1", c)
		}
	}
	for _, m := range cfg.Modes {
		if _, err := ParseMode(m); err != nil {
			return nil, err
		}
	}
	var rows []HotSetRow
	for _, clients := range cfg.Clients {
		for _, mode := range cfg.Modes {
			fmt.Fprintf(progress, "hotset: %d clients, %s\n", clients, mode)
			row, err := runHotSet(ctx, &cfg, clients, mode)
			if err != nil {
				return rows, fmt.Errorf("bench hotset: %d clients, %s: %w", clients, mode, err)
			}
			fmt.Fprintf(progress, "hotset: served %v, TTFT p50 %.1f p90 %.1f ms, %.1f req/s\n", row.Served, row.TTFTP50, row.TTFTP90, row.RPS)
			rows = append(rows, row)
		}
	}
	return rows, nil
}

func runHotSet(ctx context.Context, cfg *HotSetConfig, clients int, mode string) (HotSetRow, error) {
	row := HotSetRow{Clients: clients, Mode: mode}
	fcfg := cfg.Fleet
	fcfg.NumWorkers, fcfg.SpeedupRatio = 2, cfg.Speedup
	fcfg.Host, fcfg.HTTPPort, fcfg.KVEventsPort, fcfg.KVEventsReplayPort = "127.0.0.1", 0, 0, 0
	engines, err := fleet.Start(ctx, fcfg)
	if err != nil {
		return row, err
	}
	defer engines.Close()
	workers := serve.FleetWorkers(engines, fcfg)
	rcfg, err := ModeConfig(cfg.Router, mode, fcfg.Engine.BlockSize)
	if err != nil {
		return row, err
	}
	rcfg.Rand = newLockedRand(cfg.Seed)
	s, err := serve.Start(ctx, serve.Config{
		Router: rcfg, Workers: workers, Addr: "127.0.0.1:0", HealthInterval: time.Second,
		HTTP: serve.HTTPLimits{MaxConcurrentRequests: -1, MaxConnections: -1},
	})
	if err != nil {
		return row, err
	}
	defer s.Close()
	ready, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	if err := s.WaitReady(ready); err != nil {
		return row, fmt.Errorf("engines did not join routing: %w", err)
	}

	rng := rand.New(rand.NewPCG(cfg.Seed, 29))
	histories := make([][]uint32, cfg.Conversations)
	for i := range histories {
		histories[i] = hotSetTokens(rng, cfg.HistoryTokens)
	}
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: clients + 1}}
	model := fcfg.Server.Model
	// The first engine caches every conversation, asked directly; the
	// router learns it from the engine's KV events.
	for i, h := range histories {
		r := workload.Request{Tokens: h, OSL: 1}
		if rec := send(ctx, client, workers[0].URL, model, &r, cfg.Speedup, ""); rec.Err != "" {
			return row, fmt.Errorf("warming conversation %d: %s", i, rec.Err)
		}
	}
	bs := fcfg.Engine.BlockSize
	if err := waitHeld(ctx, s.Router(), kv.Worker{ID: workers[0].ID}, cfg.Conversations*(cfg.HistoryTokens/bs)); err != nil {
		return row, err
	}

	index := map[string]int{}
	for i, w := range workers {
		index[strconv.FormatUint(w.ID, 10)] = i
	}
	rngs := make([]*rand.Rand, clients)
	for c := range rngs {
		rngs[c] = rand.New(rand.NewPCG(cfg.Seed, uint64(c)+1000))
	}
	url := "http://" + s.Addr()
	win, err := bench.ClosedLoop(ctx, clients, cfg.Warmup, cfg.Duration, func(ctx context.Context, c, i int) (Record, error) {
		toks := append(append(make([]uint32, 0, cfg.HistoryTokens+cfg.TurnTokens), histories[(c+i)%len(histories)]...), hotSetTokens(rngs[c], cfg.TurnTokens)...)
		rec := send(ctx, client, url, model, &workload.Request{Tokens: toks, OSL: cfg.OutputTokens}, cfg.Speedup, "")
		if rec.Err != "" {
			return rec, errors.New(rec.Err)
		}
		return rec, nil
	})
	if err != nil {
		return row, err
	}
	row.Errors = win.Errors
	if win.FirstErr != nil {
		row.FirstErr = win.FirstErr.Error()
	}
	row.Served = make([]int, len(workers))
	ttft := make([]float64, 0, len(win.Samples))
	var prompt, cached int
	for _, rec := range win.Samples {
		if e, ok := index[rec.Worker]; ok {
			row.Served[e]++
		}
		ttft = append(ttft, rec.TTFTMS)
		prompt += rec.PromptTokens
		cached += rec.CachedTokens
	}
	row.TTFTP50, row.TTFTP90 = bench.Percentile(ttft, 50), bench.Percentile(ttft, 90)
	if model := win.Elapsed.Seconds() * cfg.Speedup; model > 0 {
		row.RPS = float64(len(win.Samples)) / model
	}
	if prompt > 0 {
		row.HitRate = float64(cached) / float64(prompt)
	}
	return row, nil
}

// waitHeld waits until the router's index holds at least blocks of w's
// blocks, for at most 10 s.
func waitHeld(ctx context.Context, r *router.Router, w kv.Worker, blocks int) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for len(r.HeldBlocks(w)) < blocks {
		select {
		case <-ctx.Done():
			return fmt.Errorf("the router learnt %d of the %d cached blocks: %w", len(r.HeldBlocks(w)), blocks, ctx.Err())
		case <-tick.C:
		}
	}
	return nil
}

func hotSetTokens(rng *rand.Rand, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(rng.IntN(128000))
	}
	return out
}
