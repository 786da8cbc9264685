package enginemetrics

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/mocker/fleet"
)

// vllmV1 is shaped like vLLM v1's exposition (prometheus_client output) for
// a dp=2 engine: HELP/TYPE lines, counters with _total/_created, histograms,
// the load gauges labelled by rank and model.
const vllmV1 = `# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12345.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B"} 3.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B"} 5.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B"} 0.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B"} 7.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B"} 0.875
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B"} 1024.0
vllm:prompt_tokens_created{engine="0",model_name="meta-llama/Llama-3.1-8B"} 1.7e+09
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="meta-llama/Llama-3.1-8B"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.5",model_name="meta-llama/Llama-3.1-8B"} 4.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B"} 5.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B"} 5.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B"} 1.5
# HELP vllm:num_requests_waiting_by_reason Unknown to this package.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 99.0
`

func TestParseVLLMV1(t *testing.T) {
	got, err := Parse(strings.NewReader(vllmV1))
	if err != nil {
		t.Fatal(err)
	}
	want := map[int]Sample{
		0: {Waiting: 0, Running: 3, KVUsage: 0.25},
		1: {Waiting: 7, Running: 5, KVUsage: 0.875},
	}
	assertSamples(t, got, want)
}

func TestParseOldNameFallback(t *testing.T) {
	// vLLM v0: no engine label at all, the old KV metric name.
	const v0 = `# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 4.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
`
	got, err := Parse(strings.NewReader(v0))
	if err != nil {
		t.Fatal(err)
	}
	assertSamples(t, got, map[int]Sample{0: {Waiting: 4, Running: 2, KVUsage: 0.5}})

	// Both names (vLLM's deprecation window): the current one wins per rank,
	// the old one still serves the rank that lacks the current one.
	const both = `vllm:kv_cache_usage_perc{engine="0"} 0.1
vllm:gpu_cache_usage_perc{engine="0"} 0.9
vllm:gpu_cache_usage_perc{engine="1"} 0.3
`
	got, err = Parse(strings.NewReader(both))
	if err != nil {
		t.Fatal(err)
	}
	assertSamples(t, got, map[int]Sample{0: {KVUsage: 0.1}, 1: {KVUsage: 0.3}})
}

func TestParseAggregatesAndRanks(t *testing.T) {
	// Untyped series (no TYPE lines), two models on rank 0, ranks that are
	// missing, named or negative, and a usage rounded just above 1.
	const in = `vllm:num_requests_running{engine="0",model_name="a"} 2
vllm:num_requests_running{engine="0",model_name="b"} 3
vllm:num_requests_running{model_name="c"} 1
vllm:num_requests_running{engine="engine-0"} 10
vllm:num_requests_running{engine="-1"} 100
vllm:num_requests_waiting{engine="3"} 6
vllm:kv_cache_usage_perc{engine="0",model_name="a"} 0.2
vllm:kv_cache_usage_perc{engine="0",model_name="b"} 0.6
vllm:kv_cache_usage_perc{engine="3"} 1.0000001
`
	got, err := Parse(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	assertSamples(t, got, map[int]Sample{
		0: {Running: 116, KVUsage: 0.6},
		3: {Waiting: 6, KVUsage: 1},
	})
}

func TestParseNoLoadMetrics(t *testing.T) {
	for _, in := range []string{"", "# just a comment\n", "process_open_fds 12\n"} {
		got, err := Parse(strings.NewReader(in))
		if err != nil || len(got) != 0 {
			t.Errorf("Parse(%q) = %v, %v; want empty, nil", in, got, err)
		}
	}
}

func TestParseMalformed(t *testing.T) {
	for _, in := range []string{
		"vllm:num_requests_waiting{engine=\"0\" 3\n",
		"vllm:num_requests_waiting{engine=\"0\"} three\n",
		"vllm:num_requests_waiting 1 2 3\n",
		"vllm:num_requests_waiting{engine=0} 1\n",
		"{engine=\"0\"} 1\n",
		"# TYPE vllm:num_requests_waiting gauge\n# TYPE vllm:num_requests_waiting counter\nvllm:num_requests_waiting 1\n",
		"# TYPE vllm:num_requests_running bogus\n",
		"vllm:num_requests_waiting{engine=\"0\"} 1", // no final newline
		"vllm:num_requests_waiting{engine=\"0\"} -1\n",
		"vllm:num_requests_running{engine=\"0\"} NaN\n",
		"vllm:kv_cache_usage_perc{engine=\"0\"} +Inf\n",
		"vllm:kv_cache_usage_perc{engine=\"0\"} -0.5\n",
		"vllm:num_requests_running{engine=\"0\"} 1e300\n",
		"# TYPE vllm:num_requests_waiting histogram\nvllm:num_requests_waiting_bucket{le=\"+Inf\"} 1\nvllm:num_requests_waiting_count 1\nvllm:num_requests_waiting_sum 1\n",
		"\x00\xff\xfe garbage\n",
	} {
		got, err := Parse(strings.NewReader(in))
		if err == nil {
			t.Errorf("Parse(%q) = %v, want an error", in, got)
		}
	}
}

func FuzzParse(f *testing.F) {
	f.Add(vllmV1)
	f.Add("vllm:num_requests_waiting{engine=\"0\" 3\n")
	f.Add("vllm:kv_cache_usage_perc{engine=\"99999999999999999999\"} 0.5\n")
	f.Fuzz(func(t *testing.T, in string) {
		got, err := Parse(strings.NewReader(in))
		if err != nil {
			return
		}
		for r, s := range got {
			if r < 0 || s.Waiting < 0 || s.Running < 0 || !(s.KVUsage >= 0 && s.KVUsage <= 1) {
				t.Fatalf("rank %d: %+v out of range", r, s)
			}
		}
	})
}

func assertSamples(t *testing.T, got, want map[int]Sample) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	for r, w := range want {
		if g, ok := got[r]; !ok || g != w {
			t.Fatalf("rank %d: got %+v, want %+v (all: %v)", r, g, w, got)
		}
	}
}

// exposition is what the test server serves for a load of n waiting.
func exposition(n int) string {
	return fmt.Sprintf(`# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} %d
vllm:num_requests_waiting{engine="1",model_name="m"} 0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 1
vllm:num_requests_running{engine="1",model_name="m"} 2
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
`, n)
}

type report struct {
	id      uint64
	samples map[int]Sample
	err     error
}

// startPoller runs p, with callbacks feeding the returned channel, until the
// test ends, and then checks that Run returns once cancelled. The returned
// context bounds the test's waits.
func startPoller(t *testing.T, p *Poller, targets []Target) (context.Context, <-chan report) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	runCtx, stop := context.WithCancel(ctx)
	reports := make(chan report, 16)
	send := func(r report) {
		select {
		case reports <- r:
		case <-runCtx.Done(): // nobody reads any more; Run must still return
		}
	}
	p.OnSamples = func(id uint64, s map[int]Sample) { send(report{id: id, samples: s}) }
	p.OnError = func(id uint64, err error) { send(report{id: id, err: err}) }
	done := make(chan struct{})
	go func() {
		defer close(done)
		p.Run(runCtx, targets)
	}()
	t.Cleanup(func() {
		defer cancel()
		stop()
		select {
		case <-done:
		case <-ctx.Done():
			t.Error("Run did not return after cancel")
		}
	})
	return ctx, reports
}

func next(ctx context.Context, t *testing.T, reports <-chan report) report {
	t.Helper()
	select {
	case r := <-reports:
		return r
	case <-ctx.Done():
		t.Fatal("timed out waiting for a report")
		return report{}
	}
}

func TestPollerFollowsChanges(t *testing.T) {
	var waiting atomic.Int64
	waiting.Store(1)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/metrics" {
			http.NotFound(w, r)
			return
		}
		fmt.Fprint(w, exposition(int(waiting.Load())))
	}))
	defer srv.Close()

	ctx, reports := startPoller(t, &Poller{Interval: 5 * time.Millisecond}, []Target{{ID: 42, URL: srv.URL + "/"}})
	r := next(ctx, t, reports)
	if r.err != nil || r.id != 42 {
		t.Fatalf("first report: %+v", r)
	}
	assertSamples(t, r.samples, map[int]Sample{
		0: {Waiting: 1, Running: 1, KVUsage: 0.5},
		1: {Waiting: 0, Running: 2, KVUsage: 0.25},
	})

	waiting.Store(9)
	for {
		r := next(ctx, t, reports)
		if r.err != nil || r.id != 42 {
			t.Fatalf("report: %+v", r)
		}
		if r.samples[0].Waiting == 9 {
			break
		}
		if r.samples[0].Waiting != 1 {
			t.Fatalf("unexpected sample %+v", r.samples)
		}
	}
}

func TestPollerErrors(t *testing.T) {
	good := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, exposition(3))
	}))
	defer good.Close()
	failing := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "engine dead", http.StatusServiceUnavailable)
	}))
	defer failing.Close()
	malformed := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, "vllm:num_requests_waiting{engine=\"0\" 3\n")
	}))
	defer malformed.Close()
	notVLLM := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, "process_open_fds 12\n")
	}))
	defer notVLLM.Close()
	gone := httptest.NewServer(http.NotFoundHandler())
	gone.Close()

	wantErr := map[uint64]string{2: "503", 3: "line 1", 5: errNoMetrics.Error(), 6: "connect"}
	targets := []Target{{ID: 1, URL: good.URL}, {ID: 2, URL: failing.URL}, {ID: 3, URL: malformed.URL},
		{ID: 5, URL: notVLLM.URL}, {ID: 6, URL: gone.URL}}
	ctx, reports := startPoller(t, &Poller{Interval: 10 * time.Millisecond}, targets)
	pending := map[uint64]bool{1: true, 2: true, 3: true, 5: true, 6: true}
	for len(pending) > 0 {
		r := next(ctx, t, reports)
		if want, bad := wantErr[r.id]; bad {
			if r.err == nil || !strings.Contains(r.err.Error(), want) {
				t.Fatalf("target %d: got %v, %v; want an error containing %q", r.id, r.samples, r.err, want)
			}
		} else if r.err != nil || r.samples[0].Waiting != 3 {
			t.Fatalf("target %d: got %v, %v", r.id, r.samples, r.err)
		}
		delete(pending, r.id)
	}
}

func TestPollerBodyLimit(t *testing.T) {
	// Valid text (comments), so only the size can make it fail.
	line := "# " + strings.Repeat("x", 1021) + "\n"
	body := strings.Repeat(line, MaxBodyBytes/len(line)+1)
	huge := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, body)
	}))
	defer huge.Close()
	// A long interval gives the 4 MiB transfer a generous scrape timeout
	// under -race; the first scrape does not wait for it.
	ctx, reports := startPoller(t, &Poller{Interval: 5 * time.Second}, []Target{{ID: 4, URL: huge.URL}})
	r := next(ctx, t, reports)
	if r.err == nil || !strings.Contains(r.err.Error(), "exceeds") {
		t.Fatalf("got %v, %v; want a size error", r.samples, r.err)
	}
}

func TestRunReturnsOnCancelMidScrape(t *testing.T) {
	entered := make(chan struct{}, 1)
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case entered <- struct{}{}:
		default:
		}
		select {
		case <-r.Context().Done():
		case <-release:
		}
	}))
	defer srv.Close()
	defer close(release) // lets the handler end so that Close does not wait

	var errs atomic.Int64
	p := &Poller{
		Interval:  time.Hour, // the scrape timeout (2 h) must not be what ends it
		OnSamples: func(uint64, map[int]Sample) { t.Error("samples from a hanging server") },
		OnError:   func(uint64, error) { errs.Add(1) },
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		p.Run(ctx, []Target{{ID: 1, URL: srv.URL}, {ID: 2, URL: srv.URL}})
	}()
	bound, stop := context.WithTimeout(context.Background(), 10*time.Second)
	defer stop()
	select {
	case <-entered:
	case <-bound.Done():
		t.Fatal("no scrape reached the server")
	}
	cancel()
	select {
	case <-done:
	case <-bound.Done():
		t.Fatal("Run did not return after cancel")
	}
	if n := errs.Load(); n != 0 {
		t.Errorf("%d errors reported for a cancelled scrape", n)
	}
}

func TestRunWithoutTargets(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	(&Poller{}).Run(ctx, nil)
}

// TestSimulatedEngine polls the repository's simulated vLLM engine. It
// names its engines in the `engine` label and publishes one series summed
// over its dp ranks, so everything lands on rank 0.
func TestSimulatedEngine(t *testing.T) {
	cfg := fleet.DefaultConfig()
	cfg.NumWorkers, cfg.DataParallelSize, cfg.SpeedupRatio = 2, 2, 100
	cfg.HTTPPort, cfg.KVEventsPort, cfg.KVEventsReplayPort = 0, 0, 0
	cfg.Engine.NumGPUBlocks = 64
	f, err := fleet.Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()

	var targets []Target
	for i, e := range f.Engines() {
		targets = append(targets, Target{ID: uint64(i + 10), URL: e.HTTPURL})
	}
	ctx, reports := startPoller(t, &Poller{Interval: 10 * time.Millisecond}, targets)
	seen := map[uint64]bool{}
	for len(seen) < len(targets) {
		r := next(ctx, t, reports)
		if r.err != nil {
			// On a loaded machine a scrape may overrun its bound; the
			// poller scrapes again at its next tick, and next fails the
			// test if no good report comes. Any other error is a defect.
			if errors.Is(r.err, context.DeadlineExceeded) {
				continue
			}
			t.Fatalf("target %d: %v", r.id, r.err)
		}
		s, ok := r.samples[0]
		if !ok || len(r.samples) != 1 || s.Waiting != 0 || s.Running != 0 || s.KVUsage != 0 {
			t.Fatalf("target %d: %+v, want one idle rank 0", r.id, r.samples)
		}
		seen[r.id] = true
	}
}

func BenchmarkParse(b *testing.B) {
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Parse(strings.NewReader(vllmV1)); err != nil {
			b.Fatal(err)
		}
	}
}

func TestParsePrefixCacheQueries(t *testing.T) {
	// vLLM (Python's client) appends _total to the counter's series; the
	// simulator (Go's client) does not.
	const python = `# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 4096.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 3.0e+09
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 1.0
`
	got, err := Parse(strings.NewReader(python))
	if err != nil {
		t.Fatal(err)
	}
	assertSamples(t, got, map[int]Sample{0: {Running: 1, PrefixCacheQueries: 4096}, 1: {PrefixCacheQueries: 3e9}})

	const golang = `# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries{engine="engine-0"} 160
`
	if got, err = Parse(strings.NewReader(golang)); err != nil {
		t.Fatal(err)
	}
	assertSamples(t, got, map[int]Sample{0: {PrefixCacheQueries: 160}})

	if _, err := Parse(strings.NewReader("vllm:prefix_cache_queries_total -1\n")); err == nil {
		t.Fatal("a negative counter was accepted")
	}
}

func TestParseCacheConfigCapacity(t *testing.T) {
	body := vllmV1 + `# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="27000",num_cpu_blocks="None"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="1",num_gpu_blocks="None"} 1.0
vllm:cache_config_info{engine="5",num_gpu_blocks="12"} 1.0
`
	got, err := Parse(strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	want := map[int]Sample{
		0: {Waiting: 0, Running: 3, KVUsage: 0.25, CacheBlocks: 27000},
		1: {Waiting: 7, Running: 5, KVUsage: 0.875},
	}
	assertSamples(t, got, want)
}
