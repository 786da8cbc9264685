package replay

import (
	"cmp"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/internal/bench"
	"github.com/kvrouter/kvrouter/internal/workload"
)

// Dist summarises a latency distribution in model milliseconds.
type Dist struct {
	Mean float64 `json:"mean"`
	P50  float64 `json:"p50"`
	P90  float64 `json:"p90"`
	P99  float64 `json:"p99"`
}

// ModeResult is one mode's outcome, shaped as results.json's modes.<mode>.
type ModeResult struct {
	Requests         int     `json:"requests"`
	Errors           int     `json:"errors"`
	TTFT             Dist    `json:"ttft_ms"`
	ITL              Dist    `json:"itl_ms"`
	E2E              Dist    `json:"e2e_ms"`
	OutputTokensPerS float64 `json:"output_tokens_per_s"`
	RequestsPerS     float64 `json:"requests_per_s"`
	// PrefixHitRate is cached prompt tokens / prompt tokens, as the engines
	// reported them per request (usage.prompt_tokens_details).
	PrefixHitRate float64 `json:"prefix_hit_rate"`
	// CeilingHitRate is the same with one infinite cache seeing every
	// request: no routing can do better.
	CeilingHitRate float64            `json:"ceiling_hit_rate"`
	WorkerShare    map[string]float64 `json:"worker_share"`
	PeakActive     map[string]int     `json:"peak_active"`
	DurationS      float64            `json:"duration_s"` // model time, first send to last completion
	FirstError     string             `json:"first_error,omitempty"`
}

// RunConfig is results.json's config: what was run, to rerun it.
type RunConfig struct {
	Workload       string   `json:"workload"`
	Requests       int      `json:"requests"`
	Modes          []string `json:"modes"`
	Workers        int      `json:"workers"`
	Speedup        float64  `json:"speedup"`
	ArrivalSpeedup float64  `json:"arrival_speedup"`
	Seed           uint64   `json:"seed"`
	Target         string   `json:"target,omitempty"`
	Model          string   `json:"model"`
	BlockSize      int      `json:"block_size"`
	NumGPUBlocks   int      `json:"num_gpu_blocks"`
	MaxBatched     int      `json:"max_num_batched_tokens"`
	CeilingHitRate float64  `json:"ceiling_hit_rate"`
	Command        string   `json:"command,omitempty"`
	WallSeconds    float64  `json:"wall_seconds"`
}

// Results is every mode's outcome, in the order run.
type Results struct {
	Modes  map[string]*ModeResult `json:"modes"`
	Order  []string               `json:"order"`
	Config RunConfig              `json:"config"`
	// records are kept for the plots.
	records map[string][]Record
}

func (r *Results) add(mode string, m *ModeResult, recs []Record) {
	r.Modes[mode] = m
	r.Order = append(r.Order, mode)
	if r.records == nil {
		r.records = map[string][]Record{}
	}
	r.records[mode] = recs
}

// Records are the per-request records of a mode.
func (r *Results) Records(mode string) []Record { return r.records[mode] }

func (c *Config) describe(n int) RunConfig {
	rc := RunConfig{
		Requests: n, Workers: c.Workers, Speedup: c.Speedup, ArrivalSpeedup: c.ArrivalSpeedup,
		Seed: c.Seed, Target: c.Target, Model: c.Model, BlockSize: c.Fleet.Engine.BlockSize,
		NumGPUBlocks: c.Fleet.Engine.NumGPUBlocks, MaxBatched: c.Fleet.Engine.MaxNumBatchedTokens,
	}
	if rc.Model == "" {
		rc.Model = c.Fleet.Server.Model
	}
	rc.Modes = append(rc.Modes, c.Modes...)
	if c.Target != "" {
		rc.Modes, rc.Workers = []string{"target"}, 0
	}
	return rc
}

// summarise turns records into a mode's result. names maps worker ids to
// engine names so that every engine appears in the shares, even unused.
func summarise(recs []Record, dur time.Duration, ceiling float64, names map[uint64]string) *ModeResult {
	m := &ModeResult{Requests: len(recs), CeilingHitRate: ceiling, WorkerShare: map[string]float64{}, PeakActive: map[string]int{}, DurationS: dur.Seconds()}
	for _, n := range names {
		m.WorkerShare[n], m.PeakActive[n] = 0, 0
	}
	var ttft, itl, e2e []float64
	var out, prompt, cached int
	ok := 0
	for i := range recs {
		r := &recs[i]
		if r.Err != "" {
			m.Errors++
			if m.FirstError == "" {
				m.FirstError = r.Err
			}
			continue
		}
		ok++
		ttft = append(ttft, r.TTFTMS)
		e2e = append(e2e, r.E2EMS)
		itl = append(itl, r.itl...)
		out += r.OutputTokens
		prompt += r.PromptTokens
		cached += r.CachedTokens
		if r.Worker != "" {
			m.WorkerShare[r.Worker]++
		}
	}
	for w := range m.WorkerShare {
		if ok > 0 {
			m.WorkerShare[w] /= float64(ok)
		}
	}
	m.TTFT, m.ITL, m.E2E = DistOf(ttft), DistOf(itl), DistOf(e2e)
	if s := dur.Seconds(); s > 0 {
		m.OutputTokensPerS = float64(out) / s
		m.RequestsPerS = float64(ok) / s
	}
	if prompt > 0 {
		m.PrefixHitRate = float64(cached) / float64(prompt)
	}
	for w, p := range peakActive(recs) {
		m.PeakActive[w] = p
	}
	return m
}

// DistOf summarises samples in model milliseconds; xs keeps its order.
func DistOf(xs []float64) Dist {
	s := slices.Clone(xs) // Percentile sorts in place; records keep their order
	return Dist{Mean: bench.Mean(s), P50: bench.Percentile(s, 50), P90: bench.Percentile(s, 90), P99: bench.Percentile(s, 99)}
}

// peakActive is, per worker, the most requests it had in flight at once.
func peakActive(recs []Record) map[string]int {
	type edge struct {
		at    float64
		delta int
	}
	by := map[string][]edge{}
	for i := range recs {
		r := &recs[i]
		if r.Worker == "" || r.Err != "" {
			continue
		}
		by[r.Worker] = append(by[r.Worker], edge{r.SentMS, 1}, edge{r.SentMS + r.E2EMS, -1})
	}
	out := map[string]int{}
	for w, es := range by {
		// Ends before starts at the same instant: a request finishing as
		// another starts never overlaps it.
		slices.SortFunc(es, func(a, b edge) int {
			if a.at != b.at {
				return cmp.Compare(a.at, b.at)
			}
			return a.delta - b.delta
		})
		cur, peak := 0, 0
		for _, e := range es {
			cur += e.delta
			peak = max(peak, cur)
		}
		out[w] = peak
	}
	return out
}

// CeilingHitRate is the prefix-cache hit rate of one infinite cache that
// sees every request in arrival order, counted as vLLM counts hits: the
// leading full blocks already seen, and never the prompt's last token
// (it is always computed, to produce the first output token).
func CeilingHitRate(reqs []workload.Request, blockSize int) float64 {
	order := make([]int, len(reqs))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int { return cmp.Compare(reqs[a].At, reqs[b].At) })
	c := NewCeiling(blockSize)
	for _, i := range order {
		c.Add(reqs[i].Tokens)
	}
	return c.Rate()
}

// Ceiling computes CeilingHitRate one prompt at a time, in arrival order,
// for workloads whose prompts are materialised one by one.
type Ceiling struct {
	h           blockhash.Hasher
	blockSize   int
	seen        map[uint64]struct{}
	local, seq  []uint64
	hits, total int
}

// NewCeiling starts an empty infinite cache of blockSize-token blocks.
func NewCeiling(blockSize int) *Ceiling {
	return &Ceiling{h: blockhash.New(blockSize, ""), blockSize: blockSize, seen: map[uint64]struct{}{}}
}

// Add looks a prompt up and caches it.
func (c *Ceiling) Add(toks []uint32) {
	c.local = c.h.AppendLocalHashes(c.local[:0], toks)
	c.seq = blockhash.AppendSequenceHashes(c.seq[:0], c.local)
	hit := 0
	for hit < len(c.seq) {
		if _, ok := c.seen[c.seq[hit]]; !ok {
			break
		}
		hit++
	}
	c.hits += min(hit*c.blockSize, (len(toks)-1)/c.blockSize*c.blockSize)
	c.total += len(toks)
	for _, s := range c.seq {
		c.seen[s] = struct{}{}
	}
}

// Tokens are the prompt tokens added so far and those of them cached.
func (c *Ceiling) Tokens() (hits, total int) { return c.hits, c.total }

// Rate is the hit rate of the prompts added so far.
func (c *Ceiling) Rate() float64 {
	if c.total == 0 {
		return 0
	}
	return float64(c.hits) / float64(c.total)
}

// progress draws one line per second: a bar of completed requests.
type progress struct {
	stopOnce sync.Once
	done     chan struct{}
	wg       sync.WaitGroup
}

func newProgress(w io.Writer, name string, nth, of, total int, sent, done, bad *atomic.Int64) *progress {
	p := &progress{done: make(chan struct{})}
	if w == nil {
		return p
	}
	start := time.Now()
	draw := func() {
		d := int(done.Load())
		const width = 30
		fill := width * d / max(total, 1)
		fmt.Fprintf(w, "[%d/%d] %-20s [%s%s] %5d/%d done, %d sent, %d errors, %s\n", nth, of, name,
			strings.Repeat("#", fill), strings.Repeat(".", width-fill), d, total, sent.Load(), bad.Load(),
			time.Since(start).Round(time.Second))
	}
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		t := time.NewTicker(2 * time.Second)
		defer t.Stop()
		for {
			select {
			case <-p.done:
				draw()
				return
			case <-t.C:
				draw()
			}
		}
	}()
	return p
}

func (p *progress) stop() {
	p.stopOnce.Do(func() { close(p.done) })
	p.wg.Wait()
}
