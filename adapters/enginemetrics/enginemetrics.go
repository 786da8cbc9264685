// Package enginemetrics reads the load that vLLM engines publish on
// GET /metrics: per data-parallel rank, the requests waiting and running and
// the fraction of KV-cache blocks in use. Routing policies that score
// workers by engine-reported load (as the Gateway API Inference Extension
// and llm-d do) poll it often, every 50 ms or so, so a scrape is kept cheap
// and bounded in time and memory.
//
// The metrics read are vllm:num_requests_waiting, vllm:num_requests_running
// and vllm:kv_cache_usage_perc, with vllm:gpu_cache_usage_perc (its name
// before vLLM v1) as a fallback, and the counter vllm:prefix_cache_queries. vLLM labels each series with the dp rank in
// `engine` and the served model in `model_name`. The num_gpu_blocks label
// of vllm:cache_config_info gives each rank's KV capacity.
package enginemetrics

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Metric names as vLLM publishes them.
const (
	MetricWaiting    = "vllm:num_requests_waiting"
	MetricRunning    = "vllm:num_requests_running"
	MetricKVUsage    = "vllm:kv_cache_usage_perc"
	MetricKVUsageOld = "vllm:gpu_cache_usage_perc"
	// MetricPrefixQueries is a counter: Python's client publishes its
	// series with _total appended, Go's as named.
	MetricPrefixQueries = "vllm:prefix_cache_queries"
	// MetricCacheConfig is an info gauge whose num_gpu_blocks label is the
	// rank's KV capacity in blocks.
	MetricCacheConfig = "vllm:cache_config_info"
	labelGPUBlocks    = "num_gpu_blocks"
	rankLabel         = "engine"
	maxCount          = 1 << 31 // far beyond any batch; guards the float→int conversion
	defaultMinTimeout = 200 * time.Millisecond
	keepBufBytes      = 256 << 10
)

// MaxBodyBytes bounds a scraped exposition, so that a broken engine cannot
// exhaust the router's memory. vLLM's exposition is some tens of KiB.
const MaxBodyBytes = 4 << 20

// DefaultInterval is the polling interval used when Poller.Interval is zero,
// the one the Gateway API Inference Extension uses.
const DefaultInterval = 50 * time.Millisecond

// Sample is one engine rank's load as the engine reports it.
type Sample struct {
	Waiting, Running int
	KVUsage          float64 // fraction of KV blocks in use, 0..1
	// PrefixCacheQueries is the prompt tokens the engine has looked up in
	// its prefix cache since it started: when it grows, the engine is
	// computing prompts (and, with KV events on, announcing their blocks).
	PrefixCacheQueries float64
	// CacheBlocks is the rank's KV capacity in blocks (num_gpu_blocks of
	// vllm:cache_config_info); 0 when not published.
	CacheBlocks int
}

// textParsers recycles parsers, which reset themselves on each use: a new
// one allocates its read buffer, which cost more than parsing a scrape of
// a few gauges.
var textParsers = sync.Pool{New: func() any {
	p := expfmt.NewTextParser(model.UTF8Validation)
	return &p
}}

// Parse reads a Prometheus text exposition and returns the samples per dp
// rank: the `engine` label parsed as a non-negative integer; a series
// without it, or with any other value, counts as rank 0 (the simulator, for
// one, names its engines there). A rank appears in the result when at least
// one of the load metrics has a series for it; metrics it lacks are zero.
//
// Several series of one metric for one rank (e.g. one per model_name) are
// summed for Waiting and Running, since each counts distinct requests, and
// their maximum is taken for KVUsage, since they share one pool of blocks
// and the fullest view is the safe one for routing. vllm:gpu_cache_usage_perc
// is used for a rank only when it has no vllm:kv_cache_usage_perc. KVUsage
// is clamped to 1 to absorb rounding.
//
// Other metrics, histograms included, are ignored. A malformed exposition,
// or a load metric whose value is negative, NaN or infinite, is an error:
// reading it as zero load would draw traffic to a broken engine.
func Parse(r io.Reader) (map[int]Sample, error) {
	p := textParsers.Get().(*expfmt.TextParser)
	families, err := p.TextToMetricFamilies(r)
	textParsers.Put(p)
	if err != nil {
		return nil, fmt.Errorf("enginemetrics: %w", err)
	}
	out := make(map[int]Sample)
	add := func(field func(*Sample) *int) func(int, float64) error {
		return func(rank int, v float64) error {
			if v >= maxCount {
				return fmt.Errorf("count out of range: %v", v)
			}
			s := out[rank]
			*field(&s) += int(math.Round(v))
			out[rank] = s
			return nil
		}
	}
	// Ranks that report the current name ignore the old one: engines in
	// vLLM's deprecation window publish both.
	current := make(map[int]bool)
	kv := func(fallback bool) func(int, float64) error {
		return func(rank int, v float64) error {
			if fallback && current[rank] {
				return nil
			}
			current[rank] = current[rank] || !fallback
			s := out[rank]
			s.KVUsage = max(s.KVUsage, min(v, 1))
			out[rank] = s
			return nil
		}
	}
	queries := func(rank int, v float64) error {
		s := out[rank]
		s.PrefixCacheQueries += v
		out[rank] = s
		return nil
	}
	for _, step := range []struct {
		name string
		f    func(int, float64) error
	}{
		{MetricWaiting, add(func(s *Sample) *int { return &s.Waiting })},
		{MetricRunning, add(func(s *Sample) *int { return &s.Running })},
		{MetricKVUsage, kv(false)},
		{MetricKVUsageOld, kv(true)},
		{MetricPrefixQueries, queries},
		{MetricPrefixQueries + "_total", queries},
	} {
		if err := forEach(families[step.name], step.f); err != nil {
			return nil, err
		}
	}
	if mf := families[MetricCacheConfig]; mf != nil {
		for _, m := range mf.GetMetric() {
			s, ok := out[rank(m)]
			if !ok {
				continue
			}
			for _, l := range m.GetLabel() {
				// A value that is not a block count says nothing: the
				// capacity stays unknown, as without the metric.
				if n, err := strconv.ParseUint(l.GetValue(), 10, 31); l.GetName() == labelGPUBlocks && err == nil {
					s.CacheBlocks = int(n)
					out[rank(m)] = s
				}
			}
		}
	}
	return out, nil
}

// forEach calls f with the rank and value of every series of mf, rejecting
// values no load figure can take (negative, NaN, infinite) for all of them.
func forEach(mf *dto.MetricFamily, f func(rank int, v float64) error) error {
	if mf == nil {
		return nil
	}
	for _, m := range mf.GetMetric() {
		v, ok := value(m)
		if !ok {
			// A histogram or summary under a load metric's name is not
			// vLLM's; it carries no single load figure.
			return fmt.Errorf("enginemetrics: %s is not a gauge", mf.GetName())
		}
		if math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
			return fmt.Errorf("enginemetrics: %s has invalid value %v", mf.GetName(), v)
		}
		if err := f(rank(m), v); err != nil {
			return fmt.Errorf("enginemetrics: %s: %w", mf.GetName(), err)
		}
	}
	return nil
}

// value accepts untyped and counter series as well as gauges: an exposition
// without TYPE lines, or one by a variant engine, still carries the figure.
func value(m *dto.Metric) (float64, bool) {
	switch {
	case m.Gauge != nil:
		return m.Gauge.GetValue(), true
	case m.Untyped != nil:
		return m.Untyped.GetValue(), true
	case m.Counter != nil:
		return m.Counter.GetValue(), true
	}
	return 0, false
}

func rank(m *dto.Metric) int {
	for _, l := range m.GetLabel() {
		if l.GetName() != rankLabel {
			continue
		}
		n, err := strconv.ParseUint(l.GetValue(), 10, 31)
		if err != nil {
			return 0
		}
		return int(n)
	}
	return 0
}

// Target is one engine to poll.
type Target struct {
	ID  uint64
	URL string // HTTP base URL; /metrics is appended
}

// Poller polls targets' /metrics every Interval and calls OnSamples with the
// fresh samples of one target (ranks → Sample) after each successful scrape.
//
// Callbacks run on the target's goroutine: calls for one target are
// sequential, calls for different targets concurrent. A slow callback
// delays that target's next scrape, never another's. The map passed to
// OnSamples is the callee's to keep.
type Poller struct {
	Client    *http.Client // nil = a client whose timeout is the scrape timeout
	Interval  time.Duration
	OnSamples func(id uint64, samples map[int]Sample)
	// OnError, optional, is told of every failed scrape: unreachable
	// engine, status other than 200, oversized or malformed body, or an
	// exposition without any load metric (not a vLLM engine, or the wrong
	// URL). Errors caused by Run's context ending are not reported.
	OnError func(id uint64, err error)
}

// Run polls every target concurrently (one goroutine per target; a first
// scrape at once, then one per Interval, skipping ticks while a scrape
// overruns; each scrape bounded by 2×Interval, at least 200 ms) until ctx
// ends. It returns when all its goroutines have stopped.
func (p *Poller) Run(ctx context.Context, targets []Target) {
	interval := p.Interval
	if interval <= 0 {
		interval = DefaultInterval
	}
	timeout := max(2*interval, defaultMinTimeout)
	client := p.Client
	if client == nil {
		client = &http.Client{Timeout: timeout}
	}
	var wg sync.WaitGroup
	for _, t := range targets {
		wg.Go(func() { p.poll(ctx, client, t, interval, timeout) })
	}
	wg.Wait()
}

func (p *Poller) poll(ctx context.Context, client *http.Client, t Target, interval, timeout time.Duration) {
	url := strings.TrimRight(t.URL, "/") + "/metrics"
	var buf bytes.Buffer // reused: a scrape every 50 ms should not allocate its body anew
	ticker := time.NewTicker(interval)
	defer ticker.Stop()
	for {
		samples, err := scrape(ctx, client, url, timeout, &buf)
		if ctx.Err() != nil {
			return
		}
		switch {
		case err != nil:
			if p.OnError != nil {
				p.OnError(t.ID, err)
			}
		case p.OnSamples != nil:
			p.OnSamples(t.ID, samples)
		}
		if buf.Cap() > keepBufBytes {
			// One oversized answer should not pin megabytes per target.
			buf = bytes.Buffer{}
		}
		select {
		case <-ctx.Done():
			return
		case <-ticker.C:
		}
	}
}

var errNoMetrics = errors.New("no vLLM load metrics in the exposition")

func scrape(ctx context.Context, client *http.Client, url string, timeout time.Duration, buf *bytes.Buffer) (map[int]Sample, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, fmt.Errorf("enginemetrics: %w", err)
	}
	// The classic text format is what Parse reads; without this a
	// negotiating server might answer in OpenMetrics or protobuf.
	req.Header.Set("Accept", "text/plain;version=0.0.4")
	resp, err := client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("enginemetrics: %w", err)
	}
	defer func() {
		// A drained body lets the connection be reused by the next scrape.
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		resp.Body.Close()
	}()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("enginemetrics: GET %s: status %s", url, resp.Status)
	}
	buf.Reset()
	if _, err := buf.ReadFrom(io.LimitReader(resp.Body, MaxBodyBytes+1)); err != nil {
		return nil, fmt.Errorf("enginemetrics: GET %s: %w", url, err)
	}
	if buf.Len() > MaxBodyBytes {
		return nil, fmt.Errorf("enginemetrics: GET %s: body exceeds %d bytes", url, MaxBodyBytes)
	}
	samples, err := Parse(buf)
	if err != nil {
		return nil, fmt.Errorf("%w (GET %s)", err, url)
	}
	if len(samples) == 0 {
		return nil, fmt.Errorf("enginemetrics: GET %s: %w", url, errNoMetrics)
	}
	return samples, nil
}
