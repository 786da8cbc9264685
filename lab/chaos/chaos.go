// Package chaos runs the router under steady streaming traffic while
// injecting faults on a schedule (engine crashes, KV-event connection
// cuts, router crashes and drains, NATS restarts), then checks that the
// system returned to a clean state: no booked load left, the router's
// index equal to the engines' caches, memory flat, and every client error
// explained by a fault. It is what `kvrouter bench chaos` runs.
//
// The router is a child process (the kvrouter binary's serve command), so
// that a crash is a real SIGKILL and its memory can be read from /proc.
// The simulated engines, the TCP proxies in front of their event sockets
// and, on the NATS plane, the NATS server and the engines' agents run in
// the calling process, each restartable on its ports.
package chaos

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrouter/kvrouter/adapters/natsplane"
	"github.com/kvrouter/kvrouter/internal/agent"
	"github.com/kvrouter/kvrouter/lab/workload"
	"github.com/kvrouter/kvrouter/mocker/fleet"
)

// Planes.
const (
	PlaneZMQ  = "zmq"  // the router subscribes to the engines' ZMQ sockets
	PlaneNATS = "nats" // agents carry events and registrations over NATS
)

// Config is one chaos run; the comments name the flags of `kvrouter bench
// chaos`.
type Config struct {
	Duration   time.Duration // --duration: traffic and faults
	Clients    int           // --clients: closed-loop streaming clients
	Engines    int           // --engines
	Plane      string        // --plane
	Faults     []FaultKind   // --faults: kinds to inject, cycled
	FaultEvery time.Duration // --fault-every: mean time between faults
	Pause      time.Duration // --fault-pause: how long a killed component stays down
	Grace      time.Duration // --grace: errors explained this long after recovery
	Quiet      time.Duration // --quiet-period: no traffic, no faults before the end checks
	Settle     time.Duration // --settle: how long the end state may take to converge
	// RequestTimeout ends a request that has not finished.
	RequestTimeout time.Duration
	Seed           uint64 // --seed

	// RouterBinary is the kvrouter executable run as `serve`; RouterArgs
	// are extra serve flags (e.g. --migration-limit).
	RouterBinary string
	RouterArgs   []string

	Fleet    fleet.Config             // engines' model, sizes and speed
	Workload workload.SyntheticConfig // prompts (shared system prompts)

	// WorkDir holds the router's log and NATS storage; "" = a temporary
	// directory removed at the end.
	WorkDir  string
	Progress io.Writer // a line every ProgressEvery; nil = quiet
	// ProgressEvery defaults to 5 s.
	ProgressEvery time.Duration
}

// DefaultConfig is ten minutes of 500 streams on four engines over ZMQ.
func DefaultConfig() Config {
	fc := fleet.DefaultConfig()
	fc.Engine.NumGPUBlocks = 8192
	syn := workload.DefaultSyntheticConfig()
	syn.Requests, syn.Turns, syn.Groups = 4000, 1, 16
	syn.SystemTokens, syn.QuestionTokens, syn.OutputTokens = 1024, 128, 64
	return Config{
		Duration: 10 * time.Minute, Clients: 500, Engines: 4, Plane: PlaneZMQ,
		FaultEvery: 45 * time.Second, Pause: 3 * time.Second, Grace: 5 * time.Second,
		Quiet: 5 * time.Second, Settle: 60 * time.Second, RequestTimeout: 2 * time.Minute,
		Seed: 1, Fleet: fc, Workload: syn, ProgressEvery: 5 * time.Second,
	}
}

func (c *Config) validate() error {
	switch {
	case c.Duration <= 0 || c.Clients < 1 || c.Engines < 1:
		return fmt.Errorf("chaos: need a positive duration, clients and engines (got %v, %d, %d)", c.Duration, c.Clients, c.Engines)
	case c.Plane != PlaneZMQ && c.Plane != PlaneNATS:
		return fmt.Errorf("chaos: plane %q: want zmq or nats", c.Plane)
	case c.RouterBinary == "":
		return errors.New("chaos: no router binary")
	case c.Pause < 0 || c.Grace < 0 || c.Quiet < 0 || c.Settle <= 0 || c.RequestTimeout <= 0:
		return errors.New("chaos: pause, grace and quiet must be ≥ 0, settle and request timeout > 0")
	}
	for _, k := range c.Faults {
		if k == NATSRestart && c.Plane != PlaneNATS {
			return errors.New("chaos: nats-restart needs --plane nats")
		}
	}
	return nil
}

// run is the state of one chaos run.
type run struct {
	cfg    Config
	pool   *enginePool
	router *routerProc
	ids    []uint64
	t0     time.Time

	// NATS plane only.
	natsCfg natsplane.EmbeddedConfig
	nats    *natsplane.Embedded
	nc      *nats.Conn
	agents  []*agent.Agent

	mu         sync.Mutex
	faults     []Fault
	rss        []RSSSample
	failures   []string
	routerDown bool // a router fault is in progress: its exit is expected
}

// Run performs the chaos run and returns its results; an error means the
// run itself could not be carried out, a failed check is in the results.
func Run(ctx context.Context, cfg Config) (*Results, error) {
	if len(cfg.Faults) == 0 {
		cfg.Faults = DefaultFaults(cfg.Plane)
	}
	if cfg.ProgressEvery <= 0 {
		cfg.ProgressEvery = 5 * time.Second
	}
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	syn := cfg.Workload
	syn.Seed = cfg.Seed
	reqs, err := workload.Synthetic(syn)
	if err != nil {
		return nil, err
	}
	dir := cfg.WorkDir
	if dir == "" {
		if dir, err = os.MkdirTemp("", "kvrouter-chaos-"); err != nil {
			return nil, err
		}
		defer os.RemoveAll(dir)
	} else if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	logFile, err := os.Create(filepath.Join(dir, "router.log"))
	if err != nil {
		return nil, err
	}
	defer logFile.Close()

	r := &run{cfg: cfg}
	if r.pool, err = startPool(ctx, cfg.Fleet, cfg.Engines); err != nil {
		return nil, err
	}
	defer r.pool.close()
	for _, w := range r.pool.workers() {
		r.ids = append(r.ids, w.ID)
	}
	httpPort, err := freePort()
	if err != nil {
		return nil, err
	}
	args := []string{"serve", "--http-host", "127.0.0.1", "--http-port", strconv.Itoa(httpPort),
		"--kv-cache-block-size", strconv.Itoa(cfg.Fleet.Engine.BlockSize)}
	if cfg.Plane == PlaneNATS {
		if err := r.startNATS(ctx, filepath.Join(dir, "nats")); err != nil {
			return nil, err
		}
		defer r.stopNATS()
		args = append(args, "--nats-url", r.nats.URL())
	} else {
		// The router's own embedded NATS serves no one here; keep it off
		// fixed ports and out of /tmp.
		args = append(args, "--nats-port", "0", "--nats-store-dir", filepath.Join(dir, "router-nats"))
		for _, w := range r.pool.workers() {
			args = append(args, "--worker", fmt.Sprintf("url=%s,events=%s,replay=%s,dp=1,model=%s,name=%s,id=%d,kv-blocks=%d,max-batched-tokens=%d",
				w.URL, w.Events, w.Replay, w.Model, w.Name, w.ID, w.KVBlocks, w.MaxBatchedTokens))
		}
	}
	args = append(args, cfg.RouterArgs...)
	r.router = newRouterProc(cfg.RouterBinary, args, httpPort, logFile)
	if err := r.router.start(); err != nil {
		return nil, err
	}
	defer func() { _ = r.router.stop(syscall.SIGTERM, 30*time.Second) }()
	if !waitFor(ctx, 60*time.Second, func() bool { return r.router.allRegistered(r.ids) }) {
		return nil, fmt.Errorf("chaos: the router did not take every engine into routing within a minute (log: %s)", logFile.Name())
	}

	r.t0 = time.Now()
	samplerDone := make(chan struct{})
	samplerStop := make(chan struct{})
	go func() {
		defer close(samplerDone)
		r.sampleRSS(samplerStop)
	}()
	r.sampleOnce() // idle, before any traffic

	tr := newTraffic(r.router.url, cfg.Fleet.Server.Model, reqs, cfg.Clients, cfg.RequestTimeout)
	stopTraffic := make(chan struct{})
	trafficDone := make(chan struct{})
	go func() {
		defer close(trafficDone)
		tr.run(ctx, cfg.Clients, stopTraffic)
	}()
	progressStop := make(chan struct{})
	progressDone := make(chan struct{})
	go func() {
		defer close(progressDone)
		r.progress(tr, progressStop)
	}()

	r.injectAll(ctx, Plan(cfg.Duration, cfg.FaultEvery, cfg.Faults, cfg.Engines, cfg.Seed))
	if d := time.Until(r.t0.Add(cfg.Duration)); d > 0 {
		select {
		case <-ctx.Done():
		case <-time.After(d):
		}
	}
	close(stopTraffic)
	<-trafficDone
	trafficEnd := time.Since(r.t0).Seconds()
	if ctx.Err() != nil {
		close(progressStop)
		close(samplerStop)
		return nil, ctx.Err()
	}
	select {
	case <-ctx.Done():
	case <-time.After(cfg.Quiet):
	}
	end := r.endState(ctx)
	close(progressStop)
	<-progressDone
	close(samplerStop)
	<-samplerDone
	return r.results(tr, end, trafficEnd), nil
}

func (r *run) startNATS(ctx context.Context, store string) error {
	port, err := freePort()
	if err != nil {
		return err
	}
	r.natsCfg = natsplane.EmbeddedConfig{Host: "127.0.0.1", Port: port, StoreDir: store}
	if r.nats, err = natsplane.StartEmbedded(r.natsCfg); err != nil {
		return err
	}
	if r.nc, err = natsplane.Connect(r.nats.URL(), "kvrouter-bench-chaos", nil); err != nil {
		return err
	}
	for i := range r.pool.slots {
		a, err := r.startAgent(ctx, i)
		if err != nil {
			return err
		}
		r.agents = append(r.agents, a)
	}
	return nil
}

func (r *run) startAgent(ctx context.Context, i int) (*agent.Agent, error) {
	w := r.pool.workers()[i]
	return agent.Start(ctx, r.nc, agent.Config{
		Names:  natsplane.Names{Namespace: natsplane.DefaultNamespace, Component: natsplane.DefaultComponent},
		Events: w.Events, Replay: w.Replay, LeaseTTL: natsplane.DefaultLeaseTTL, Logger: slog.New(slog.DiscardHandler),
		Instance: natsplane.Instance{
			WorkerID: w.ID, Name: w.Name, Model: w.Model, URL: w.URL, BlockSize: r.cfg.Fleet.Engine.BlockSize,
			DPSize: 1, TotalKVBlocks: w.KVBlocks, MaxNumBatchedTokens: w.MaxBatchedTokens,
		},
	})
}

func (r *run) stopNATS() {
	for _, a := range r.agents {
		if a != nil {
			a.Close()
		}
	}
	if r.nc != nil {
		r.nc.Close()
	}
	if r.nats != nil {
		r.nats.Shutdown()
	}
}

func (r *run) since() float64 { return time.Since(r.t0).Seconds() }

func (r *run) fail(format string, args ...any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.failures = append(r.failures, fmt.Sprintf(format, args...))
}

// injectAll injects the planned faults in order, each once the previous
// one has recovered.
func (r *run) injectAll(ctx context.Context, plan []Planned) {
	for _, p := range plan {
		if d := time.Until(r.t0.Add(p.At)); d > 0 {
			select {
			case <-ctx.Done():
				return
			case <-time.After(d):
			}
		}
		if ctx.Err() != nil || time.Since(r.t0) > r.cfg.Duration {
			return
		}
		f := r.inject(ctx, p)
		r.mu.Lock()
		r.faults = append(r.faults, f)
		r.mu.Unlock()
	}
}

// recoveryTimeout bounds the wait for a component to serve again.
const recoveryTimeout = 90 * time.Second

func (r *run) inject(ctx context.Context, p Planned) Fault {
	f := Fault{Kind: p.Kind, Injected: r.since()}
	pause := func() {
		select {
		case <-ctx.Done():
		case <-time.After(r.cfg.Pause):
		}
	}
	var recovered func() bool
	var err error
	switch p.Kind {
	case EngineKill:
		s := r.pool.slots[p.Engine]
		f.Engine = s.name
		if r.agents != nil {
			// The agent is the engine's sidecar: they die and restart
			// together, as a pod would.
			r.agents[p.Engine].Close()
		}
		s.kill()
		pause()
		if err = s.start(ctx); err == nil && r.agents != nil {
			r.agents[p.Engine], err = r.startAgent(ctx, p.Engine)
		}
		recovered = func() bool { return s.up() && r.router.allRegistered(r.ids) }
	case EventCut:
		cutAt := time.Now().Add(r.cfg.Pause)
		for _, s := range r.pool.slots {
			s.eventsProxy.cut(r.cfg.Pause)
			s.replayProxy.cut(r.cfg.Pause)
		}
		pause()
		recovered = func() bool {
			for _, s := range r.pool.slots {
				if !s.eventsProxy.connectedSince(cutAt) {
					return false
				}
			}
			return true
		}
	case RouterKill, RouterTerm:
		r.mu.Lock()
		r.routerDown = true
		r.mu.Unlock()
		sig := syscall.SIGKILL
		if p.Kind == RouterTerm {
			sig = syscall.SIGTERM
		}
		if err = r.router.stop(sig, 60*time.Second); err == nil {
			pause()
			err = r.router.start()
		}
		r.mu.Lock()
		r.routerDown = false
		r.mu.Unlock()
		recovered = func() bool { return r.router.allRegistered(r.ids) }
	case NATSRestart:
		r.nats.Shutdown()
		pause()
		r.nats, err = natsplane.StartEmbedded(r.natsCfg)
		recovered = func() bool { return r.nc.IsConnected() && r.router.allRegistered(r.ids) }
	}
	f.Restored = r.since()
	if err == nil && !waitFor(ctx, recoveryTimeout, recovered) {
		err = fmt.Errorf("not recovered within %v", recoveryTimeout)
	}
	if err != nil {
		f.Err = err.Error()
		r.fail("%s at %.0f s: %v", p.Kind, f.Injected, err)
	}
	f.Recovered = r.since()
	f.WindowEnd = f.Recovered + r.cfg.Grace.Seconds()
	return f
}

// RSSSample is the router's resident memory at T seconds.
type RSSSample struct {
	T           float64 `json:"t_s"`
	MB          float64 `json:"mb"`
	Incarnation int     `json:"incarnation"` // which router process (1 = the first)
}

func (r *run) sampleOnce() {
	pid, inc := r.router.pid()
	if pid == 0 {
		return
	}
	if mb, ok := rssMB(pid); ok {
		r.mu.Lock()
		r.rss = append(r.rss, RSSSample{T: r.since(), MB: mb, Incarnation: inc})
		r.mu.Unlock()
	}
}

// sampleRSS samples every second, and notices a router that died on its
// own: a crash no fault caused is a failure (it is restarted so that the
// run can go on).
func (r *run) sampleRSS(stop <-chan struct{}) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
		}
		r.sampleOnce()
		r.mu.Lock()
		down := r.routerDown
		r.mu.Unlock()
		if !down && r.router.exitedEarly() {
			r.fail("the router exited on its own at %.0f s", r.since())
			if err := r.router.start(); err != nil {
				r.fail("restarting the router: %v", err)
			}
		}
	}
}

func (r *run) progress(tr *traffic, stop <-chan struct{}) {
	if r.cfg.Progress == nil {
		return
	}
	t := time.NewTicker(r.cfg.ProgressEvery)
	defer t.Stop()
	var lastOK int64
	last := time.Now()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
		}
		ok := tr.ok.Load()
		rate := float64(ok-lastOK) / time.Since(last).Seconds()
		lastOK, last = ok, time.Now()
		r.mu.Lock()
		nf := len(r.faults)
		var mb float64
		if n := len(r.rss); n > 0 {
			mb = r.rss[n-1].MB
		}
		r.mu.Unlock()
		fmt.Fprintf(r.cfg.Progress, "%5.0fs  ok %d (%.0f/s)  errors %d  in flight %d  router RSS %.0f MB  faults %d\n",
			r.since(), ok, rate, tr.failed.Load(), tr.inflight.Load(), mb, nf)
	}
}

// EngineIndex compares the router's index of one engine with its cache.
type EngineIndex struct {
	Engine       string `json:"engine"`
	RouterBlocks int    `json:"router_blocks"`
	EngineBlocks int    `json:"engine_blocks"`
	Missing      int    `json:"missing"` // cached by the engine, unknown to the router
	Extra        int    `json:"extra"`   // in the router's index, not cached
	// Unnamed are blocks the router knows, at the right place, under an id
	// it inferred while rebuilding a rank from traffic, since no event has
	// named them yet (docs/routing-core.md): routing is exact for them.
	Unnamed int `json:"unnamed"`
}

// EndState is the system after the quiet period.
type EndState struct {
	LoadsZero  bool          `json:"loads_zero"`
	Loads      []LoadRow     `json:"loads"`
	IndexEqual bool          `json:"index_equal"`
	Index      []EngineIndex `json:"index"`
	// SettledAfter is how long after the quiet period both held (or the
	// settle timeout when they did not).
	SettledAfter float64 `json:"settled_after_s"`
	Err          string  `json:"error,omitempty"`
}

// compareHeld compares by content what the router's index holds for an
// engine with what the engine caches: the engine's ids for blocks it stored
// before a lost history cannot all be known.
func compareHeld(engine string, have, want heldBlocks) EngineIndex {
	row := EngineIndex{Engine: engine, RouterBlocks: len(have.seqs), EngineBlocks: len(want.seqs)}
	for seq := range want.seqs {
		if !have.seqs[seq] {
			row.Missing++
		}
	}
	for seq := range have.seqs {
		if !want.seqs[seq] {
			row.Extra++
		}
	}
	for id, seq := range want.ids {
		if _, named := have.ids[id]; !named && have.seqs[seq] {
			row.Unnamed++
		}
	}
	return row
}

// endState polls the router until its loads are zero and its index equals
// the engines' caches, or the settle time is over.
func (r *run) endState(ctx context.Context) EndState {
	start := time.Now()
	var st EndState
	check := func() bool {
		st = EndState{}
		loads, err := r.router.loads(r.cfg.Fleet.Server.Model)
		if err != nil {
			st.Err = err.Error()
			return false
		}
		st.Loads, st.LoadsZero = loads, len(loads) == len(r.ids)
		for _, l := range loads {
			if l.ActiveRequests != 0 || l.ActiveDecodeBlocks != 0 || l.ActivePrefillTokens != 0 {
				st.LoadsZero = false
			}
		}
		idx, err := r.router.index()
		if err != nil {
			st.Err = err.Error()
			return false
		}
		st.IndexEqual = true
		for _, s := range r.pool.slots {
			row := compareHeld(s.name, idx[s.id], s.blocks())
			st.IndexEqual = st.IndexEqual && row.Missing == 0 && row.Extra == 0
			st.Index = append(st.Index, row)
		}
		return st.LoadsZero && st.IndexEqual
	}
	waitFor(ctx, r.cfg.Settle, check)
	st.SettledAfter = time.Since(start).Seconds()
	slices.SortFunc(st.Loads, func(a, b LoadRow) int { return int(a.WorkerID) - int(b.WorkerID) })
	return st
}
