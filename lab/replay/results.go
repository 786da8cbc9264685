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
	"github.com/kvrouter/kvrouter/lab/bench"
	"github.com/kvrouter/kvrouter/lab/workload"
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
	// EngineDrift is how much longer the engines' steps took than the
	// timing model (divided by the speedup) says, as a fraction: above a
	// few percent the machine could not keep up with --speedup, and every
	// latency of the run is longer than the model's.
	EngineDrift     float64 `json:"engine_drift"`
	EngineLagResets uint64  `json:"engine_lag_resets"` // times an engine fell more than 50 ms behind and skipped ahead
	// Disagg is a disaggregated setup's traffic between its pools; its
	// PrefixHitRate is then DisaggResult.PrefillHitRate.
	Disagg *DisaggResult `json:"disagg,omitempty"`
	// Sessions and SplitSessions, with --session-header: the sessions
	// answered, and those whose turns went to more than one engine.
	Sessions      int `json:"sessions,omitempty"`
	SplitSessions int `json:"split_sessions,omitempty"`
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

// splitSessions counts the sessions with an answered turn, and those whose
// answered turns went to more than one engine.
func splitSessions(recs []Record, reqs []workload.Request) (sessions, split int) {
	first := map[string]string{}
	isSplit := map[string]bool{}
	for i := range recs {
		r := &recs[i]
		sess := reqs[r.Index].Session
		if r.Err != "" || r.Worker == "" || sess == "" {
			continue
		}
		w, ok := first[sess]
		if !ok {
			first[sess] = r.Worker
		} else if w != r.Worker {
			isSplit[sess] = true
		}
	}
	return len(first), len(isSplit)
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
		c.AddSalted(reqs[i].Tokens, reqs[i].CacheSalt)
	}
	return c.Rate()
}

// Ceiling computes CeilingHitRate one prompt at a time, in arrival order,
// for workloads whose prompts are materialised one by one.
type Ceiling struct {
	h           blockhash.Hasher
	blockSize   int
	ids         *BlockIDs // AddHashes' numbering of the blocks
	seen        []uint64  // bit per block number: cached (infinite cache)
	local, seq  []uint64
	idBuf       []int32
	hits, total int
	lru         *lru // nil: the cache is infinite
}

// NewCeiling starts an empty infinite cache of blockSize-token blocks.
func NewCeiling(blockSize int) *Ceiling {
	return &Ceiling{h: blockhash.New(blockSize, ""), blockSize: blockSize}
}

// NewPooledCeiling starts an empty cache of capacity blocks that evicts the
// least recently used: one cache holding as much as a whole fleet, the hit
// rate no routing of the fleet's requests can beat by more than LRU's own
// misjudgements (a router's engines each evict on their own, and a
// request's blocks are one engine's). Blocks of a prompt are used last to
// first, so that its prefix outlives its tail, as engines free them.
func NewPooledCeiling(blockSize, capacity int) *Ceiling {
	c := NewCeiling(blockSize)
	c.lru = newLRU(capacity)
	return c
}

// lru is a set of at most capacity block numbers in recency order, linked
// through arrays indexed by the number: the pooled ceiling of a fleet
// holds millions of blocks, and the numbering already found each one.
type lru struct {
	prev, next []int32 // prev is out for a number not in the set
	capacity   int32
	used       int32
	head, tail int32 // head is the most recent; -1 when empty
}

const out = -2

func newLRU(capacity int) *lru {
	return &lru{capacity: int32(capacity), head: -1, tail: -1}
}

func (l *lru) has(k int32) bool { return int(k) < len(l.prev) && l.prev[k] != out }

func (l *lru) unlink(i int32) {
	if p := l.prev[i]; p >= 0 {
		l.next[p] = l.next[i]
	} else {
		l.head = l.next[i]
	}
	if n := l.next[i]; n >= 0 {
		l.prev[n] = l.prev[i]
	} else {
		l.tail = l.prev[i]
	}
	l.prev[i] = out
}

func (l *lru) pushFront(i int32) {
	l.prev[i], l.next[i] = -1, l.head
	if l.head >= 0 {
		l.prev[l.head] = i
	}
	l.head = i
	if l.tail < 0 {
		l.tail = i
	}
}

// grow lengthens the arrays to n numbers, at least doubling their
// capacity when they must move: append grows a large slice by a quarter,
// and a workload's millions of numbers had them copied dozens of times.
func (l *lru) grow(n int) {
	if n > cap(l.prev) {
		l.room(max(n, 2*cap(l.prev)))
	}
	for len(l.prev) < n {
		l.prev = append(l.prev, out)
		l.next = append(l.next, -1)
	}
}

// Reserve makes room for about blocks distinct block numbers, so that a
// pass that knows how many it will add never moves its arrays.
func (c *Ceiling) Reserve(blocks int) {
	if c.lru != nil && blocks > cap(c.lru.prev) {
		c.lru.room(blocks)
	}
}

// room moves the arrays to ones of capacity n.
func (l *lru) room(n int) {
	l.prev = append(make([]int32, 0, n), l.prev...)
	l.next = append(make([]int32, 0, n), l.next...)
}

// touch makes k the most recent, evicting the least recent when full.
func (l *lru) touch(k int32) {
	if l.capacity <= 0 {
		return
	}
	if int(k) >= len(l.prev) {
		l.grow(int(k) + 1)
	}
	if l.has(k) {
		l.unlink(k)
		l.pushFront(k)
		return
	}
	if l.used < l.capacity {
		l.used++
	} else {
		l.unlink(l.tail)
	}
	l.pushFront(k)
}

// Add looks a prompt up and caches it.
func (c *Ceiling) Add(toks []uint32) { c.AddSalted(toks, "") }

// AddSalted adds a prompt cached under a cache salt: it hits only blocks
// of prompts with the same salt.
func (c *Ceiling) AddSalted(toks []uint32, salt string) {
	h := c.h
	if salt != "" {
		h = blockhash.NewKeyed(c.blockSize, "", salt)
	}
	c.local, c.seq = h.AppendHashes(c.local[:0], c.seq[:0], toks)
	c.AddHashes(c.seq, len(toks))
}

// AddHashes adds a prompt of n tokens by its full blocks' chained hashes
// (blockhash.Hasher.AppendHashes under the prompt's salt), for a caller
// that has hashed it already.
func (c *Ceiling) AddHashes(seq []uint64, n int) {
	if c.ids == nil {
		c.ids = NewBlockIDs(0)
	}
	c.idBuf = c.ids.AppendIDs(c.idBuf[:0], seq)
	c.AddBlocks(c.idBuf, n)
}

// AddBlocks adds a prompt of n tokens by its full blocks' numbers, from
// one BlockIDs that numbers every prompt's blocks, for a caller that
// numbers them for other uses too. A Ceiling takes prompts by hashes or
// by numbers, not both.
func (c *Ceiling) AddBlocks(ids []int32, n int) {
	hit := 0
	for hit < len(ids) && c.cached(ids[hit]) {
		hit++
	}
	c.hits += min(hit*c.blockSize, (n-1)/c.blockSize*c.blockSize)
	c.total += n
	if c.lru != nil {
		for i := len(ids) - 1; i >= 0; i-- {
			c.lru.touch(ids[i])
		}
		return
	}
	for _, id := range ids {
		w := int(id >> 6)
		for w >= len(c.seen) {
			c.seen = append(c.seen, 0)
		}
		c.seen[w] |= 1 << (id & 63)
	}
}

func (c *Ceiling) cached(id int32) bool {
	if c.lru != nil {
		return c.lru.has(id)
	}
	w := int(id >> 6)
	return w < len(c.seen) && c.seen[w]&(1<<(id&63)) != 0
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
