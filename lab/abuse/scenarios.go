package abuse

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/adapters/vllmevents"
	"github.com/kvrouter/kvrouter/adapters/zmqevents"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/internal/serve"
	"github.com/kvrouter/kvrouter/mocker/fleet"
)

// badID is the misbehaving engine's worker id.
const badID = 100

// stand is one scenario's router and engines.
type stand struct {
	srv     *serve.Server
	model   string
	closers []func()
}

func (s *stand) close() {
	if s.srv != nil {
		_ = s.srv.Close()
	}
	for i := len(s.closers) - 1; i >= 0; i-- {
		s.closers[i]()
	}
}

// goodEngines starts n simulated engines running speedup times faster
// than the modelled GPU; anyModel makes the router send them every model.
func (s *stand) goodEngines(ctx context.Context, n int, speedup float64, anyModel bool) ([]serve.WorkerSpec, error) {
	fc := fleet.DefaultConfig()
	fc.NumWorkers, fc.SpeedupRatio = n, speedup
	fc.HTTPPort, fc.KVEventsPort, fc.KVEventsReplayPort = 0, 0, 0
	f, err := fleet.Start(ctx, fc)
	if err != nil {
		return nil, err
	}
	s.closers = append(s.closers, f.Close)
	s.model = fc.Server.Model
	specs := serve.FleetWorkers(f, fc)
	if anyModel {
		for i := range specs {
			specs[i].Model = ""
		}
	}
	return specs, nil
}

// badEngine is an HTTP engine that answers /health and hands every other
// request to h.
func (s *stand) badEngine(h http.HandlerFunc) serve.WorkerSpec {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/health" {
			return
		}
		_, _ = io.Copy(io.Discard, r.Body)
		h(w, r)
	}))
	s.closers = append(s.closers, srv.CloseClientConnections, srv.Close)
	return serve.WorkerSpec{ID: badID, Name: "misbehaving", URL: srv.URL, Model: s.model, KVBlocks: 16384}
}

// start runs the router in front of workers and waits for them all.
func (s *stand) start(ctx context.Context, cfg Config, workers []serve.WorkerSpec) error {
	srv, err := serve.Start(ctx, serve.Config{
		Router: router.DefaultConfig(), Workers: workers, Addr: "127.0.0.1:0", HealthInterval: 100 * time.Millisecond,
		EngineHeaderTimeout: cfg.HeaderTimeout, EngineResponseTimeout: cfg.HeaderTimeout,
	})
	if err != nil {
		return err
	}
	s.srv = srv
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	return srv.WaitReady(wctx)
}

func (s *stand) url() string { return s.srv.URL() }

// prompt is 64 token ids distinct for each i.
func prompt(i int) []int {
	out := make([]int, 64)
	for k := range out {
		out[k] = 300 + (k*131+i*7919)%90000
	}
	return out
}

// answer is how one request ended.
type answer struct {
	status int
	sse    bool // a text/event-stream ending with [DONE]
	body   []byte
	took   time.Duration
	err    error
}

func (a answer) ok() bool {
	return a.err == nil && a.status == 200 && !bytes.Contains(a.body, []byte(`"error"`))
}

// send posts a completion (streamed or not) for prompt i and reads the
// whole answer within timeout.
func (s *stand) send(ctx context.Context, model string, i int, stream bool, maxTokens int, timeout time.Duration) answer {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	b, _ := json.Marshal(map[string]any{"model": model, "prompt": prompt(i), "max_tokens": maxTokens, "stream": stream})
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, s.url()+"/v1/completions", bytes.NewReader(b))
	req.Header.Set("Content-Type", "application/json")
	start := time.Now()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return answer{err: err, took: time.Since(start)}
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	a := answer{status: resp.StatusCode, body: body, err: err, took: time.Since(start)}
	a.sse = strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") && bytes.HasSuffix(body, []byte("data: [DONE]\n\n"))
	if stream && a.status == 200 && !a.sse && a.err == nil {
		a.err = errors.New("a 200 answer to a stream that is not a complete event stream")
	}
	return a
}

// load sends n requests from 8 clients at once.
func (s *stand) load(ctx context.Context, n int, stream bool, timeout time.Duration) []answer {
	out := make([]answer, n)
	var next atomic.Int64
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for {
				i := int(next.Add(1)) - 1
				if i >= n || ctx.Err() != nil {
					return
				}
				out[i] = s.send(ctx, s.model, i, stream, 8, timeout)
			}
		})
	}
	wg.Wait()
	return out
}

// metric reads one sample of /metrics, 0 when absent.
func (s *stand) metric(series string) float64 {
	resp, err := http.Get(s.url() + "/metrics")
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), series+" "); ok {
			f, _ := strconv.ParseFloat(v, 64)
			return f
		}
	}
	return 0
}

// series counts /metrics' samples and bytes.
func (s *stand) series() (n int, size int64, err error) {
	resp, err := http.Get(s.url() + "/metrics")
	if err != nil {
		return 0, 0, err
	}
	defer resp.Body.Close()
	br := bufio.NewReaderSize(resp.Body, 1<<16)
	for {
		line, err := br.ReadSlice('\n')
		size += int64(len(line))
		if len(line) > 0 && line[0] != '#' && len(bytes.TrimSpace(line)) > 0 {
			n++
		}
		if err != nil && !errors.Is(err, bufio.ErrBufferFull) {
			return n, size, nil
		}
	}
}

// loadsSettle waits up to within for every booked load to be freed and
// returns how long it took, or -1.
func (s *stand) loadsSettle(within time.Duration) float64 {
	start := time.Now()
	for time.Since(start) < within {
		zero := true
		for _, l := range s.srv.Router().Loads() {
			if l.ActiveRequests != 0 || l.ActiveDecodeBlocks != 0 || l.ActivePrefillTokens != 0 {
				zero = false
			}
		}
		if zero {
			return time.Since(start).Seconds()
		}
		time.Sleep(20 * time.Millisecond)
	}
	return -1
}

// tally counts failed answers and the slowest.
func tally(as []answer) (failed int, slowest time.Duration) {
	for _, a := range as {
		if !a.ok() {
			failed++
		}
		slowest = max(slowest, a.took)
	}
	return failed, slowest
}

// misbehaving runs cfg.Requests requests through two good engines and
// the misbehaving one made of h.
func misbehaving(ctx context.Context, cfg Config, h http.HandlerFunc, stream bool) (*stand, []answer, error) {
	s := &stand{}
	good, err := s.goodEngines(ctx, 2, 100, false)
	if err != nil {
		return s, nil, err
	}
	if err := s.start(ctx, cfg, append(good, s.badEngine(h))); err != nil {
		return s, nil, err
	}
	return s, s.load(ctx, cfg.Requests, stream, 3*cfg.HeaderTimeout+10*time.Second), nil
}

func ejected(s *stand) float64 {
	return s.metric(`kvrouter_worker_ejections_total{worker_id="` + strconv.Itoa(badID) + `"}`)
}

func runHang(ctx context.Context, cfg Config, v *Verdict) error {
	stop := make(chan struct{})
	defer close(stop)
	s, as, err := misbehaving(ctx, cfg, func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-stop:
		}
	}, true)
	defer s.close()
	if err != nil {
		return err
	}
	// An engine holding a request is avoided while it does: it meets a
	// few requests per header timeout, and needs five failures in a row.
	for deadline := time.Now().Add(10*cfg.HeaderTimeout + 5*time.Second); ejected(s) == 0 && time.Now().Before(deadline); {
		as = append(as, s.load(ctx, cfg.Requests, true, 3*cfg.HeaderTimeout+10*time.Second)...)
	}
	failed, slowest := tally(as)
	ej := ejected(s)
	bound := 2*cfg.HeaderTimeout + 2*time.Second
	v.Figures["failed"], v.Figures["requests"], v.Figures["slowest_s"], v.Figures["ejections"] = float64(failed), float64(len(as)), slowest.Seconds(), ej
	v.Pass = failed == 0 && slowest <= bound && ej >= 1
	v.Measured = fmt.Sprintf("%d of %d failed, slowest %.2f s, engine ejected %v times", failed, len(as), slowest.Seconds(), ej)
	v.Want = fmt.Sprintf("none failed, slowest ≤ %v, ejected", bound)
	return nil
}

func runDrip(ctx context.Context, cfg Config, v *Verdict) error {
	const clientTimeout = 2 * time.Second
	s := &stand{}
	defer s.close()
	good, err := s.goodEngines(ctx, 2, 100, false)
	if err != nil {
		return err
	}
	var dripped atomic.Int64
	bad := s.badEngine(func(w http.ResponseWriter, r *http.Request) {
		dripped.Add(1)
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: {\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\ndata: {\"choices\":")
		w.(http.Flusher).Flush()
		t := time.NewTicker(100 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-r.Context().Done():
				return
			case <-t.C:
			}
			if _, err := io.WriteString(w, " "); err != nil {
				return
			}
			w.(http.Flusher).Flush()
		}
	})
	if err := s.start(ctx, cfg, append(good, bad)); err != nil {
		return err
	}
	s.load(ctx, cfg.Requests, true, clientTimeout)
	settle := s.loadsSettle(5 * time.Second)
	v.Figures["dripping_streams"], v.Figures["settle_s"] = float64(dripped.Load()), settle
	v.Pass = settle >= 0
	v.Measured = fmt.Sprintf("%d streams dripped until their clients left; loads back to 0 after %.2f s", dripped.Load(), settle)
	if settle < 0 {
		v.Measured = fmt.Sprintf("%d streams dripped; loads not back to 0 within 5 s", dripped.Load())
	}
	v.Want = "loads back to 0 within 5 s of the clients leaving"
	return nil
}

func runHugeLine(ctx context.Context, cfg Config, v *Verdict) error {
	line := bytes.Repeat([]byte("a"), 64<<20)
	heap := watchHeap()
	s, as, err := misbehaving(ctx, cfg, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: ")
		_, _ = w.Write(line)
		_, _ = io.WriteString(w, "\n\n")
	}, true)
	peak := heap.end()
	defer s.close()
	if err != nil {
		return err
	}
	failed, _ := tally(as)
	v.Figures["failed"], v.Figures["heap_peak_mib"] = float64(failed), peak
	const limit = 128
	v.Pass = failed == 0 && peak <= limit
	v.Measured = fmt.Sprintf("%d of %d failed, heap peak +%.0f MiB (8 clients)", failed, len(as), peak)
	v.Want = fmt.Sprintf("none failed, heap peak ≤ +%d MiB", limit)
	return nil
}

func runNonSSE(ctx context.Context, cfg Config, v *Verdict) error {
	s, as, err := misbehaving(ctx, cfg, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Server", "engine/1.0")
		_, _ = io.WriteString(w, `{"id":"x","object":"text_completion","choices":[{"index":0,"text":"a","finish_reason":"length"}]}`)
	}, true)
	defer s.close()
	if err != nil {
		return err
	}
	passed := 0
	for _, a := range as {
		if a.status == 200 && !a.sse {
			passed++
		}
	}
	failed, _ := tally(as)
	v.Figures["non_sse_relayed"], v.Figures["failed"] = float64(passed), float64(failed)
	v.Pass = passed == 0
	v.Measured = fmt.Sprintf("%d of %d streams answered 200 without an event stream; %d failed in all", passed, len(as), failed)
	v.Want = "no 200 without an event stream"
	return nil
}

func runShortBody(ctx context.Context, cfg Config, v *Verdict) error {
	s, as, err := misbehaving(ctx, cfg, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", "1000")
		_, _ = io.WriteString(w, `{"id":"x",`)
	}, false)
	defer s.close()
	if err != nil {
		return err
	}
	failed, _ := tally(as)
	ej := ejected(s)
	v.Figures["failed"], v.Figures["ejections"] = float64(failed), ej
	v.Pass = failed == 0
	v.Measured = fmt.Sprintf("%d of %d failed, engine ejected %v times", failed, len(as), ej)
	v.Want = "none failed"
	return nil
}

// chainEngine publishes one chain of blocks over ZMQ, as an engine that
// declares kvBlocks of capacity.
type chainEngine struct {
	pub       *zmqevents.Publisher
	blockSize int
	next      uint64 // the next block's hash (hashes are 1, 2, ...)
	tokens    []uint32
}

func newChainEngine(blockSize int) (*chainEngine, error) {
	pub, err := zmqevents.NewPublisher(zmqevents.PublisherConfig{Endpoint: "tcp://127.0.0.1:0", ReplayEndpoint: "tcp://127.0.0.1:0", BufferSize: 4})
	if err != nil {
		return nil, err
	}
	return &chainEngine{pub: pub, blockSize: blockSize, next: 1}, nil
}

// publish appends n blocks to the chain in one batch.
func (c *chainEngine) publish(n int) error {
	hashes := make([]uint64, n)
	for i := range hashes {
		hashes[i] = c.next + uint64(i)
	}
	if need := n * c.blockSize; len(c.tokens) < need {
		c.tokens = make([]uint32, need)
		for i := range c.tokens {
			c.tokens[i] = uint32(1000 + i%30000)
		}
	}
	ev := &vllmevents.BlockStored{BlockHashes: hashes, TokenIDs: c.tokens[:n*c.blockSize], BlockSize: c.blockSize, Medium: "GPU"}
	if c.next > 1 {
		parent := c.next - 1
		ev.ParentBlockHash = &parent
	}
	payload, err := vllmevents.EncodeBatch(&vllmevents.Batch{TS: float64(time.Now().UnixNano()) / 1e9, Events: []vllmevents.Event{ev}}, vllmevents.EncodingArray)
	if err != nil {
		return err
	}
	if _, err := c.pub.Publish(payload); err != nil {
		return err
	}
	c.next += uint64(n)
	return nil
}

// chain starts a router whose only engine publishes a chain of blocks
// blocks, declaring kvBlocks of capacity, and returns once the router's
// index stopped growing.
func chain(ctx context.Context, cfg Config, s *stand, blocks, kvBlocks int) (indexed int, took time.Duration, err error) {
	rc := router.DefaultConfig()
	ce, err := newChainEngine(rc.BlockSize)
	if err != nil {
		return 0, 0, err
	}
	s.closers = append(s.closers, func() { _ = ce.pub.Close() })
	s.model = "hostile"
	spec := s.badEngine(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusNotFound) })
	spec.Events, spec.Replay, spec.KVBlocks = ce.pub.Endpoint(), ce.pub.ReplayEndpoint(), kvBlocks
	if err := s.start(ctx, cfg, []serve.WorkerSpec{spec}); err != nil {
		return 0, 0, err
	}
	w := kv.Worker{ID: badID}
	// The subscription is made when the engine joins; the first block,
	// sent until it is seen, proves it is live.
	deadline := time.Now().Add(20 * time.Second)
	for s.srv.Router().IndexedBlocks(w) == 0 {
		if time.Now().After(deadline) {
			return 0, 0, errors.New("the router never indexed the engine's first block")
		}
		ce.next = 1
		if err := ce.publish(1); err != nil {
			return 0, 0, err
		}
		time.Sleep(50 * time.Millisecond)
	}
	start := time.Now()
	const batch = 4096
	for left := blocks - 1; left > 0; left -= batch {
		if err := ce.publish(min(batch, left)); err != nil {
			return 0, 0, err
		}
		if ctx.Err() != nil {
			return 0, 0, ctx.Err()
		}
	}
	// Settled: no growth for a second, or the whole chain.
	last, still := -1, time.Now()
	for {
		n := s.srv.Router().IndexedBlocks(w)
		if n != last {
			last, still = n, time.Now()
		}
		if n >= blocks || time.Since(still) > time.Second {
			return n, time.Since(start), nil
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func runChain(ctx context.Context, cfg Config, v *Verdict) error {
	const declared = 4096
	s := &stand{}
	defer s.close()
	heap := watchHeap()
	indexed, took, err := chain(ctx, cfg, s, cfg.ChainBlocks, declared)
	peak := heap.end()
	if err != nil {
		return err
	}
	v.Figures["chain_blocks"], v.Figures["indexed_blocks"], v.Figures["declared_blocks"] = float64(cfg.ChainBlocks), float64(indexed), declared
	v.Figures["apply_s"], v.Figures["heap_peak_mib"] = took.Seconds(), peak
	v.Pass = indexed <= 4*declared
	v.Measured = fmt.Sprintf("%d of %d blocks indexed for an engine of %d (%.1f s, heap +%.0f MiB)", indexed, cfg.ChainBlocks, declared, took.Seconds(), peak)
	v.Want = fmt.Sprintf("≤ %d blocks indexed (4 × declared)", 4*declared)
	return nil
}

func runLabels(ctx context.Context, cfg Config, v *Verdict) error {
	s := &stand{}
	defer s.close()
	good, err := s.goodEngines(ctx, 2, 100, true)
	if err != nil {
		return err
	}
	if err := s.start(ctx, cfg, good); err != nil {
		return err
	}
	before, _, err := s.series()
	if err != nil {
		return err
	}
	heap := watchHeap()
	var next atomic.Int64
	var wg sync.WaitGroup
	for range 16 {
		wg.Go(func() {
			for {
				i := int(next.Add(1)) - 1
				if i >= cfg.LabelModels || ctx.Err() != nil {
					return
				}
				s.send(ctx, "m"+strconv.Itoa(i), i, false, 1, 30*time.Second)
			}
		})
	}
	wg.Wait()
	after, size, err := s.series()
	peak := heap.end()
	if err != nil {
		return err
	}
	const limit = 1000
	v.Figures["series_before"], v.Figures["series_after"], v.Figures["metrics_bytes"], v.Figures["heap_peak_mib"] = float64(before), float64(after), float64(size), peak
	v.Pass = after-before <= limit
	v.Measured = fmt.Sprintf("%d model names: /metrics %d → %d series (%.1f MB), heap +%.0f MiB", cfg.LabelModels, before, after, float64(size)/1e6, peak)
	v.Want = fmt.Sprintf("≤ %d new series", limit)
	return nil
}

// dump reads /router/dump_events to its end and returns the status.
func (s *stand) dump(ctx context.Context) (int, error) {
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, s.url()+"/router/dump_events", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	_, err = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode, err
}

func runDumps(ctx context.Context, cfg Config, v *Verdict) error {
	s := &stand{}
	defer s.close()
	indexed, _, err := chain(ctx, cfg, s, cfg.DumpBlocks, cfg.DumpBlocks)
	if err != nil {
		return err
	}
	heap := watchHeap()
	status, err := s.dump(ctx)
	one := heap.end()
	if err != nil {
		return err
	}
	heap = watchHeap()
	statuses := map[int]int{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	for range cfg.DumpClients {
		wg.Go(func() {
			code, _ := s.dump(ctx)
			mu.Lock()
			statuses[code]++
			mu.Unlock()
		})
	}
	wg.Wait()
	many := heap.end()
	limit := 2*one + 32
	v.Figures["indexed_blocks"], v.Figures["one_dump_heap_mib"], v.Figures["concurrent_heap_mib"], v.Figures["ok_answers"] = float64(indexed), one, many, float64(statuses[200])
	v.Pass = many <= limit
	v.Measured = fmt.Sprintf("index of %d blocks: one dump (%d) heap +%.0f MiB; %d at once %v heap +%.0f MiB", indexed, status, one, cfg.DumpClients, statuses, many)
	v.Want = fmt.Sprintf("%d at once ≤ +%.0f MiB (2 × one + 32)", cfg.DumpClients, limit)
	return nil
}

func runCancels(ctx context.Context, cfg Config, v *Verdict) error {
	s := &stand{}
	defer s.close()
	good, err := s.goodEngines(ctx, 2, 1, false)
	if err != nil {
		return err
	}
	if err := s.start(ctx, cfg, good); err != nil {
		return err
	}
	var started, cancelled atomic.Int64
	var wg sync.WaitGroup
	for c := range cfg.CancelClients {
		wg.Go(func() {
			cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			b, _ := json.Marshal(map[string]any{"model": s.model, "prompt": prompt(c), "max_tokens": 2000, "stream": true})
			req, _ := http.NewRequestWithContext(cctx, http.MethodPost, s.url()+"/v1/completions", bytes.NewReader(b))
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				return
			}
			defer resp.Body.Close()
			started.Add(1)
			line, err := bufio.NewReader(resp.Body).ReadString('\n')
			if err == nil && strings.HasPrefix(line, "data: {") {
				cancelled.Add(1)
			}
			cancel()
		})
	}
	wg.Wait()
	settle := s.loadsSettle(10 * time.Second)
	v.Figures["clients"], v.Figures["cancelled_mid_stream"], v.Figures["settle_s"] = float64(cfg.CancelClients), float64(cancelled.Load()), settle
	v.Pass = settle >= 0 && started.Load() == int64(cfg.CancelClients)
	v.Measured = fmt.Sprintf("%d of %d clients left mid-stream; loads back to 0 after %.2f s", cancelled.Load(), cfg.CancelClients, settle)
	if settle < 0 {
		v.Measured = fmt.Sprintf("%d of %d clients left mid-stream; loads not back to 0 within 10 s", cancelled.Load(), cfg.CancelClients)
	}
	v.Want = "every stream started, loads back to 0 within 10 s"
	return nil
}
