package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/common/expfmt"
	promModel "github.com/prometheus/common/model"
	"github.com/prometheus/procfs"

	"github.com/kvrouter/kvrouter/mocker/fleet"
)

// MemoryConfig sets up `kvrouter bench memory`: a `kvrouter serve` process
// over simulated engines, probed with the requests whose memory a client
// controls, its resident memory read from /proc before, during and after.
type MemoryConfig struct {
	Binary    string   // the kvrouter binary run as `serve`
	ServeArgs []string // extra flags for serve
	Workers   int      // simulated engines, in this process

	Sessions      int // requests opening a session with an id of IDBytes
	IDBytes       int
	Models        int // POST /busy_threshold with model names of IDBytes
	PromptBytes   int // text prompts of this size...
	PromptClients int // ...sent this many at once
	// Settle is how long the process is watched after the probes.
	Settle time.Duration
}

// DefaultMemoryConfig is the reference probe: 100 session ids and 100
// model names of 1 MiB, 16 concurrent prompts of 12 MiB, 60 s to settle.
func DefaultMemoryConfig() MemoryConfig {
	return MemoryConfig{Workers: 2, Sessions: 100, IDBytes: 1 << 20, Models: 100, PromptBytes: 12 << 20, PromptClients: 16, Settle: 60 * time.Second}
}

// MemoryResult is the serve process's resident memory (VmRSS) through the
// probes, and what the probes were answered.
type MemoryResult struct {
	IdleMB        float64 `json:"idle_mb"`
	PeakMB        float64 `json:"peak_mb"`
	AfterProbesMB float64 `json:"after_probes_mb"` // when the last probe returned
	SettledMB     float64 `json:"settled_mb"`      // Settle later
	BackWithinS   float64 `json:"back_within_s"`   // seconds until RSS ≤ 1.2 × idle; -1 = not within Settle
	// BackWithinWarmS is BackWithinS against the warm idle: a router that
	// has served one ordinary request has touched the code pages of its
	// request path, which a freshly started one has not.
	BackWithinWarmS float64           `json:"back_within_warm_s"`
	ListBytes       int               `json:"busy_threshold_list_bytes"`
	Statuses        map[string]string `json:"statuses"` // probe → "status×count ..."

	// Where the memory is at each point: the breakdown of the RSS and the
	// Go runtime's own account of its heap.
	Idle        MemorySample `json:"idle"`
	WarmIdle    MemorySample `json:"warm_idle"` // after one ordinary completion
	Peak        MemorySample `json:"peak"`      // RSS breakdown only
	AfterProbes MemorySample `json:"after_probes"`
	Settled     MemorySample `json:"settled"`
}

// MemorySample is one reading of the serve process, in MB: its RSS split
// into anonymous memory (heap, stacks), file-backed pages (the binary's
// code and data) and shared memory, from /proc/<pid>/status, and the Go
// heap as the process's /metrics reports it.
type MemorySample struct {
	RSSMB          float64 `json:"rss_mb"`
	AnonMB         float64 `json:"rss_anon_mb"`
	FileMB         float64 `json:"rss_file_mb"`
	ShmemMB        float64 `json:"rss_shmem_mb"`
	HeapInuseMB    float64 `json:"heap_inuse_mb"`
	HeapIdleMB     float64 `json:"heap_idle_mb"`     // held by the runtime, unused...
	HeapReleasedMB float64 `json:"heap_released_mb"` // ...of which returned to the OS
	StacksMB       float64 `json:"stacks_mb"`
	Goroutines     int     `json:"goroutines"`
}

// RunMemory runs the probes; progress lines go to progress.
func RunMemory(ctx context.Context, cfg MemoryConfig, progress io.Writer) (MemoryResult, error) {
	fcfg := fleet.DefaultConfig()
	fcfg.NumWorkers, fcfg.SpeedupRatio = cfg.Workers, 100
	fcfg.HTTPPort, fcfg.KVEventsPort, fcfg.KVEventsReplayPort = 0, 0, 0
	fcfg.Server.MaxBodyBytes = int64(cfg.PromptBytes) + 1<<20
	fl, err := fleet.Start(ctx, fcfg)
	if err != nil {
		return MemoryResult{}, err
	}
	defer fl.Close()

	port, err := freePort()
	if err != nil {
		return MemoryResult{}, err
	}
	args := []string{"serve", "--http-host", "127.0.0.1", "--http-port", strconv.Itoa(port), "--nats-port", "0"}
	for _, e := range fl.Engines() {
		args = append(args, "--worker", fmt.Sprintf("url=%s,events=%s,replay=%s,model=%s", e.HTTPURL, e.Ranks[0].Events, e.Ranks[0].Replay, fcfg.Server.Model))
	}
	args = append(args, cfg.ServeArgs...)
	logFile, err := os.CreateTemp("", "kvrouter-bench-memory-*.log")
	if err != nil {
		return MemoryResult{}, err
	}
	defer logFile.Close()
	cmd := exec.CommandContext(ctx, cfg.Binary, args...)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Start(); err != nil {
		return MemoryResult{}, err
	}
	defer func() {
		_ = cmd.Process.Signal(os.Interrupt)
		_ = cmd.Wait()
	}()
	base := "http://127.0.0.1:" + strconv.Itoa(port)
	fmt.Fprintf(progress, "serve pid %d on %s, log %s\n", cmd.Process.Pid, base, logFile.Name())
	if err := waitHealthy(ctx, base, 30*time.Second); err != nil {
		return MemoryResult{}, fmt.Errorf("%w (log: %s)", err, logFile.Name())
	}
	pid := cmd.Process.Pid
	client := &http.Client{Timeout: 5 * time.Minute}
	sample := func() MemorySample {
		m := rssSample(pid)
		m.addHeap(ctx, client, base)
		return m
	}
	rss := func() float64 { return rssSample(pid).RSSMB }
	var res MemoryResult
	res.Idle = sample()
	res.IdleMB = res.Idle.RSSMB
	res.Statuses = map[string]string{}
	fmt.Fprintf(progress, "idle: %s\n", res.Idle)
	res.Statuses["ordinary"] = probe(1, 1, func(int) (*http.Request, error) {
		body, _ := json.Marshal(map[string]any{"model": fcfg.Server.Model, "prompt": "hello world", "max_tokens": 1})
		return http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", bytes.NewReader(body))
	}, client)
	res.WarmIdle = sample()
	fmt.Fprintf(progress, "warm idle (one ordinary completion, %s): %s\n", res.Statuses["ordinary"], res.WarmIdle)

	peak := res.Idle
	var peakMu sync.Mutex
	stopSampling := make(chan struct{})
	sampled := make(chan struct{})
	go func() {
		defer close(sampled)
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stopSampling:
				return
			case <-tick.C:
				v := rssSample(pid)
				peakMu.Lock()
				if v.RSSMB > peak.RSSMB {
					peak = v
				}
				peakMu.Unlock()
			}
		}
	}()

	id := strings.Repeat("s", cfg.IDBytes)
	res.Statuses["sessions"] = probe(cfg.Sessions, 8, func(i int) (*http.Request, error) {
		body, _ := json.Marshal(map[string]any{"model": fcfg.Server.Model, "prompt": []int{1, 2, 3}, "max_tokens": 1,
			"nvext": map[string]any{"session_control": map[string]any{"session_id": strconv.Itoa(i) + id, "action": "open", "timeout": 1e9}}})
		return http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", bytes.NewReader(body))
	}, client)
	fmt.Fprintf(progress, "sessions: %s, %.0f MB\n", res.Statuses["sessions"], rss())
	res.Statuses["busy_threshold"] = probe(cfg.Models, 8, func(i int) (*http.Request, error) {
		body, _ := json.Marshal(map[string]any{"model": strconv.Itoa(i) + id, "active_prefill_tokens_threshold": 1000})
		return http.NewRequestWithContext(ctx, http.MethodPost, base+"/busy_threshold", bytes.NewReader(body))
	}, client)
	if resp, err := client.Get(base + "/busy_threshold"); err == nil {
		n, _ := io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		res.ListBytes = int(n)
	}
	fmt.Fprintf(progress, "busy_threshold: %s, list %d bytes, %.0f MB\n", res.Statuses["busy_threshold"], res.ListBytes, rss())
	prompt := strings.Repeat("hello world ", cfg.PromptBytes/12)
	res.Statuses["prompts"] = probe(cfg.PromptClients, cfg.PromptClients, func(i int) (*http.Request, error) {
		body, _ := json.Marshal(map[string]any{"model": fcfg.Server.Model, "prompt": strconv.Itoa(i) + prompt, "max_tokens": 1})
		return http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/completions", bytes.NewReader(body))
	}, client)
	res.AfterProbes = sample()
	res.AfterProbesMB = res.AfterProbes.RSSMB
	fmt.Fprintf(progress, "prompts: %s, %s\n", res.Statuses["prompts"], res.AfterProbes)

	res.BackWithinS, res.BackWithinWarmS = -1, -1
	start := time.Now()
	deadline := time.NewTimer(cfg.Settle)
	defer deadline.Stop()
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
settle:
	for {
		select {
		case <-ctx.Done():
			return res, ctx.Err()
		case <-deadline.C:
			break settle
		case <-tick.C:
			v := rss()
			if res.BackWithinS < 0 && v <= 1.2*res.Idle.RSSMB {
				res.BackWithinS = time.Since(start).Seconds()
			}
			if res.BackWithinWarmS < 0 && v <= 1.2*res.WarmIdle.RSSMB {
				res.BackWithinWarmS = time.Since(start).Seconds()
			}
		}
	}
	res.Settled = sample()
	res.SettledMB = res.Settled.RSSMB
	fmt.Fprintf(progress, "%v later: %s\n", cfg.Settle, res.Settled)
	close(stopSampling)
	<-sampled
	res.Peak = peak
	res.PeakMB = peak.RSSMB
	return res, nil
}

// probe sends n requests, c at a time, and sums up their statuses.
func probe(n, c int, mk func(i int) (*http.Request, error), client *http.Client) string {
	var mu sync.Mutex
	counts := map[string]int{}
	sem := make(chan struct{}, max(c, 1))
	var wg sync.WaitGroup
	for i := range n {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			status := "error"
			if req, err := mk(i); err == nil {
				req.Header.Set("Content-Type", "application/json")
				if resp, err := client.Do(req); err == nil {
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					status = strconv.Itoa(resp.StatusCode)
				}
			}
			mu.Lock()
			counts[status]++
			mu.Unlock()
		})
	}
	wg.Wait()
	var parts []string
	for s, k := range counts {
		parts = append(parts, fmt.Sprintf("%s×%d", s, k))
	}
	return strings.Join(parts, " ")
}

func waitHealthy(ctx context.Context, base string, within time.Duration) error {
	deadline := time.Now().Add(within)
	for time.Now().Before(deadline) {
		if resp, err := http.Get(base + "/health"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
	return errors.New("serve did not become healthy")
}

func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// rssSample reads a process's resident memory from /proc; zero if it
// cannot be read (the process is gone).
func rssSample(pid int) MemorySample {
	var m MemorySample
	p, err := procfs.NewProc(pid)
	if err != nil {
		return m
	}
	st, err := p.NewStatus()
	if err != nil {
		return m
	}
	m.RSSMB, m.AnonMB, m.FileMB, m.ShmemMB = mb(st.VmRSS), mb(st.RssAnon), mb(st.RssFile), mb(st.RssShmem)
	return m
}

// addHeap adds the Go runtime's heap figures from the process's /metrics;
// they stay zero if it does not answer.
func (m *MemorySample) addHeap(ctx context.Context, client *http.Client, base string) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, base+"/metrics", nil)
	if err != nil {
		return
	}
	resp, err := client.Do(req)
	if err != nil {
		return
	}
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(promModel.UTF8Validation)
	families, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		return
	}
	value := func(name string) float64 {
		f, ok := families[name]
		if !ok || len(f.GetMetric()) == 0 {
			return 0
		}
		met := f.GetMetric()[0]
		if g := met.GetGauge(); g != nil {
			return g.GetValue()
		}
		return met.GetUntyped().GetValue()
	}
	m.HeapInuseMB = value("go_memstats_heap_inuse_bytes") / (1 << 20)
	m.HeapIdleMB = value("go_memstats_heap_idle_bytes") / (1 << 20)
	m.HeapReleasedMB = value("go_memstats_heap_released_bytes") / (1 << 20)
	m.StacksMB = value("go_memstats_stack_inuse_bytes") / (1 << 20)
	m.Goroutines = int(value("go_goroutines"))
}

func mb(bytes uint64) float64 { return float64(bytes) / (1 << 20) }

func (m MemorySample) String() string {
	return fmt.Sprintf("RSS %.1f MB (anon %.1f, file %.1f, shmem %.1f); heap in use %.1f MB, idle %.1f, released %.1f; stacks %.1f MB, %d goroutines",
		m.RSSMB, m.AnonMB, m.FileMB, m.ShmemMB, m.HeapInuseMB, m.HeapIdleMB, m.HeapReleasedMB, m.StacksMB, m.Goroutines)
}
