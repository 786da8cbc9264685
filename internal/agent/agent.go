// Package agent is the sidecar that puts one engine on kvrouter's NATS
// plane: it registers the engine in discovery under a lease, follows the
// engine's ZMQ KV events (with replay) and republishes them, numbered, on
// the event plane, answers routers' recovery requests, and publishes the
// load the engine reports on /metrics. `kvrouter agent` runs it next to a
// real vLLM or SGLang; `kvrouter up` runs one per simulated engine.
package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrouter/kvrouter/adapters/enginemetrics"
	"github.com/kvrouter/kvrouter/adapters/enginesource"
	"github.com/kvrouter/kvrouter/adapters/natsplane"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
)

// DefaultReportInterval is how often load and the last event ids are
// published.
const DefaultReportInterval = time.Second

// Config describes the engine and the plane.
type Config struct {
	Names    natsplane.Names
	Instance natsplane.Instance
	// Events and Replay are rank 0's ZMQ endpoints; rank r uses port + r.
	// Empty Events: the engine publishes no KV events.
	Events, Replay string
	LeaseTTL       time.Duration
	ReportInterval time.Duration
	// MetricsURL is where the engine's /metrics lives; "" = Instance.URL.
	MetricsURL string
	// Loss, for tests, drops published events as a lossy wire would.
	Loss   func() bool
	Logger *slog.Logger
	// ZMQMaxMessageBytes bounds one ZMQ message from the engine (see
	// enginesource.Config.MaxMessageBytes); 0 means the default.
	ZMQMaxMessageBytes int64
	// SilenceProbe is enginesource.Config.SilenceProbe.
	SilenceProbe time.Duration
}

// Agent is a running sidecar.
type Agent struct {
	cfg     Config
	pub     *natsplane.Publisher
	publish func(kv.Event) error // pub.Publish
	offload router.OffloadPlacer // places the engine's token-less host blocks
	reg     *natsplane.Registration
	sources []*enginesource.Source
	cancel  context.CancelFunc
	wg      sync.WaitGroup

	mu      sync.Mutex // guards samples and sampled
	samples map[int]enginemetrics.Sample
	sampled time.Time

	// sizeMu guards reg (set once registered) and announced, the block
	// size the registration names: the engine's events may reveal that
	// --block-size was wrong.
	sizeMu    sync.Mutex
	announced int
}

// Start registers the engine and starts following it. A fresh incarnation
// number tells routers that this is a new process even if the engine's
// details did not change, and every rank's blocks are first cleared.
func Start(ctx context.Context, nc *nats.Conn, cfg Config) (*Agent, error) {
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if cfg.ReportInterval <= 0 {
		cfg.ReportInterval = DefaultReportInterval
	}
	if cfg.MetricsURL == "" {
		cfg.MetricsURL = cfg.Instance.URL
	}
	in := &cfg.Instance
	if in.DPSize <= 0 {
		in.DPSize = 1
	}
	if in.BlockSize <= 0 {
		return nil, errors.New("agent: the engine's block size is required")
	}
	role, err := router.ParseRole(in.Role)
	if err != nil {
		return nil, fmt.Errorf("agent: %w", err)
	}
	in.Role = role.String()
	in.Incarnation = rand.Uint64()
	pub, err := natsplane.NewPublisher(nc, natsplane.PublisherConfig{Names: cfg.Names, Worker: in.WorkerID, Loss: cfg.Loss, Logger: cfg.Logger})
	if err != nil {
		return nil, err
	}
	a := &Agent{cfg: cfg, pub: pub, publish: pub.Publish, announced: in.BlockSize}
	for rank := range in.DPSize {
		if err := pub.Publish(kv.ClearedEvent(kv.Worker{ID: in.WorkerID, DPRank: uint32(rank)}, 0)); err != nil {
			_ = pub.Close()
			return nil, err
		}
	}
	ctx, a.cancel = context.WithCancel(ctx)
	if cfg.Events != "" {
		for rank := range in.DPSize {
			events, err1 := enginesource.RankEndpoint(cfg.Events, rank)
			replay, err2 := enginesource.RankEndpoint(cfg.Replay, rank)
			if err := errors.Join(err1, err2); err != nil {
				a.Close()
				return nil, err
			}
			src, err := enginesource.Start(ctx, enginesource.Config{
				Worker: kv.Worker{ID: in.WorkerID, DPRank: uint32(rank)}, Events: events, Replay: replay, Logger: cfg.Logger,
				MaxMessageBytes: cfg.ZMQMaxMessageBytes, SilenceProbe: cfg.SilenceProbe,
			}, a)
			if err != nil {
				a.Close()
				return nil, err
			}
			a.sources = append(a.sources, src)
		}
	}
	a.sizeMu.Lock()
	inst := *in
	inst.BlockSize = a.announced
	a.reg, err = natsplane.Register(ctx, nc, cfg.Names, inst, cfg.LeaseTTL, cfg.Logger)
	a.sizeMu.Unlock()
	if err != nil {
		a.Close()
		return nil, err
	}
	a.wg.Add(2)
	go func() {
		defer a.wg.Done()
		p := enginemetrics.Poller{
			Interval: cfg.ReportInterval,
			OnSamples: func(_ uint64, s map[int]enginemetrics.Sample) {
				a.mu.Lock()
				a.samples, a.sampled = s, time.Now()
				a.mu.Unlock()
			},
			OnError: func(_ uint64, err error) { cfg.Logger.Debug("engine metrics", "err", err) },
		}
		p.Run(ctx, []enginemetrics.Target{{ID: in.WorkerID, URL: cfg.MetricsURL}})
	}()
	go func() {
		defer a.wg.Done()
		a.report(ctx)
	}()
	cfg.Logger.Info("agent registered engine", "worker", in.Name, "id", in.WorkerID, "url", in.URL, "ranks", in.DPSize)
	return a, nil
}

// report publishes every rank's load and last event id each interval. The
// ids go out even when /metrics fails: they are how routers notice lost
// events that nothing newer revealed.
func (a *Agent) report(ctx context.Context) {
	t := time.NewTicker(a.cfg.ReportInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		a.mu.Lock()
		samples, fresh := a.samples, time.Since(a.sampled) < 3*a.cfg.ReportInterval
		a.mu.Unlock()
		for rank := range a.cfg.Instance.DPSize {
			r := natsplane.LoadReport{DPRank: uint32(rank)}
			if rank < len(a.sources) {
				r.Unsupported = a.sources[rank].Stats().Unsupported
			}
			if s, ok := samples[rank]; ok && fresh {
				r.LoadKnown, r.Waiting, r.Running, r.KVUsage = true, s.Waiting, s.Running, s.KVUsage
			}
			if err := a.pub.PublishLoad(r); err != nil {
				a.cfg.Logger.Debug("load report not sent", "err", err)
			}
		}
	}
}

// ApplyEvent republishes a removed or cleared event (enginesource.Sink).
func (a *Agent) ApplyEvent(ev *kv.Event) error {
	a.offload.Removed(ev)
	return a.publish(*ev)
}

// ApplyEngineStored hashes stored blocks as routers do, in the engine's
// block size, and republishes them (enginesource.Sink). Host blocks that
// vLLM's offloading connector names by id alone are placed below their
// device copies' parents (router.OffloadPlacer) and go out hashed like any.
func (a *Agent) ApplyEngineStored(es *router.EngineStored) error {
	if es.BlockSizeConsistent() {
		a.announceBlockSize(es.BlockSize)
	}
	evs, err := a.offload.Stored(es, a.cfg.Instance.BlockSize)
	for _, ev := range evs {
		err = errors.Join(err, a.publish(ev))
	}
	return err
}

// announceBlockSize re-registers the engine with the block size its
// events carry when --block-size said otherwise: routers match an engine
// with hashes of its announced block size.
func (a *Agent) announceBlockSize(size int) {
	a.sizeMu.Lock()
	defer a.sizeMu.Unlock()
	if a.announced == size {
		return
	}
	in := a.cfg.Instance
	a.cfg.Logger.Warn(fmt.Sprintf("engine %s publishes %d-token blocks, the agent was started with --block-size %d: announcing %d-token blocks to routers",
		in.Name, size, a.announced, size), "worker", in.Name, "engine_block_size", size, "agent_block_size", a.announced)
	a.announced = size
	if a.reg == nil {
		return // Start registers it with this size
	}
	in.BlockSize = size
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := a.reg.Update(ctx, in); err != nil {
		a.cfg.Logger.Warn("block size not announced yet; the next heartbeat will", "worker", in.Name, "err", err)
	}
}

func (a *Agent) stop() {
	if a.cancel != nil {
		a.cancel()
	}
	a.wg.Wait()
	for _, s := range a.sources {
		_ = s.Close()
	}
	_ = a.pub.Close()
}

// Close deregisters the engine (routers drop it at once) and stops.
func (a *Agent) Close() {
	a.stop()
	if a.reg != nil {
		_ = a.reg.Close()
	}
}

// Kill stops without deregistering, as a crash would: routers drop the
// engine when its lease runs out.
func (a *Agent) Kill() {
	a.stop()
	if a.reg != nil {
		a.reg.Abandon()
	}
}

var _ enginesource.Sink = (*Agent)(nil)
