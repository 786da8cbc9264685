package serve

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrouter/kvrouter/adapters/natsplane"
)

// Plane puts the frontend on kvrouter's NATS plane: engines come from
// discovery (in addition to Config.Workers), their KV events and load
// reports from the event plane, and replicas can share their load.
type Plane struct {
	Conn     *nats.Conn
	Names    natsplane.Names
	RouterID string
	// Durable: events from the JetStream stream (--router-durable-kv-events).
	Durable           bool
	ReplicaSync       bool          // --router-replica-sync
	SnapshotThreshold uint64        // --router-snapshot-threshold
	ResetStates       bool          // --router-reset-states
	LeaseTTL          time.Duration // discovery lease
}

// planeState is the running plane of a Server.
type planeState struct {
	sub     *natsplane.Subscriber
	watcher *natsplane.Watcher
	sync    *natsplane.ReplicaSync
	// sessions shares session bindings with the other replicas on the
	// plane, as Dynamo does whenever bindings have a TTL (here always):
	// without it a session whose requests a load balancer spreads over
	// replicas would be bound once by each, to different engines.
	sessions *natsplane.SessionSync
}

func (s *Server) startPlane(ctx context.Context) error {
	p := s.cfg.Plane
	sub, err := natsplane.NewSubscriber(p.Conn, natsplane.SubscriberConfig{
		Names: p.Names, RouterID: p.RouterID, Durable: p.Durable,
		SnapshotThreshold: p.SnapshotThreshold, ResetStates: p.ResetStates, Logger: s.log,
	}, s.router)
	if err != nil {
		return err
	}
	s.plane = &planeState{sub: sub}
	// Workers present at start are announced before the subscriber starts,
	// so a durable snapshot finds them registered.
	watcher, err := natsplane.Watch(ctx, p.Conn, p.Names, p.LeaseTTL, natsplane.WatchHandler{
		Added:   s.discovered,
		Removed: s.undiscovered,
	}, s.log)
	if err != nil {
		return err
	}
	s.plane.watcher = watcher
	select {
	case <-watcher.Ready():
	case <-time.After(10 * time.Second):
		s.log.Warn("discovery did not list the registered engines within 10 s; starting without them")
	}
	if err := sub.Start(ctx); err != nil {
		watcher.Close()
		s.toks.wait()
		return err
	}
	syncCfg := natsplane.ReplicaSyncConfig{Names: p.Names, RouterID: p.RouterID, Logger: s.log}
	ss, err := natsplane.StartSessionSync(p.Conn, syncCfg, s.router)
	if err != nil {
		s.closePlane()
		return err
	}
	s.plane.sessions = ss
	if p.ReplicaSync {
		rs, err := natsplane.StartReplicaSync(p.Conn, syncCfg, s.router)
		if err != nil {
			s.closePlane()
			return err
		}
		s.plane.sync = rs
	}
	return nil
}

func (s *Server) closePlane() {
	if s.plane == nil {
		return
	}
	s.plane.watcher.Close()
	s.toks.wait()
	if s.plane.sync != nil {
		_ = s.plane.sync.Close()
	}
	if s.plane.sessions != nil {
		_ = s.plane.sessions.Close()
	}
	s.plane.sub.Close()
}

// discovered registers (or updates) an engine announced by discovery. Its
// lease stands in for health probes.
func (s *Server) discovered(in natsplane.Instance) {
	spec := WorkerSpec{
		ID: in.WorkerID, Name: in.Name, URL: in.URL, Model: in.Model, DPSize: max(in.DPSize, 1),
		KVBlocks: in.TotalKVBlocks, MaxBatchedTokens: in.MaxNumBatchedTokens, Role: in.Role, Tokenizer: in.Tokenizer,
		Device: in.Device,
	}
	if err := spec.validate(); err != nil {
		s.log.Warn("discovered engine skipped", "worker", in.Name, "err", err)
		return
	}
	s.mu.Lock()
	if w := s.workers[in.WorkerID]; w != nil && !w.discovered {
		s.mu.Unlock()
		s.log.Warn("discovered engine has the id of a configured one; skipped", "id", in.WorkerID, "worker", in.Name)
		return
	} else if w != nil && w.drained {
		// Held out by an operator: remembered for re-admission only.
		w.spec, w.instance = spec, in
		s.mu.Unlock()
		return
	}
	s.mu.Unlock()
	s.toks.engineLater(in.Model, in.Tokenizer)
	info := spec.info()
	info.BlockSize = in.BlockSize
	s.router.AddWorker(info)
	s.warnBlockSize(in.WorkerID, spec.Name, s.router.WorkerBlockSize(in.WorkerID), "announces")
	s.plane.sub.WorkerAdded(in)
	s.mu.Lock()
	nw := &supervised{spec: spec, up: true, discovered: true, instance: in}
	if old := s.workers[in.WorkerID]; old != nil && old.spec.URL == spec.URL {
		nw.adapters = old.adapters // an update, not a new engine
	}
	s.workers[in.WorkerID] = nw
	s.notifyLocked()
	s.mu.Unlock()
	s.kickAdapters()
	s.log.Info("engine joined routing", "worker", spec.Name, "url", spec.URL, "ranks", spec.DPSize, "via", "discovery")
}

func (s *Server) undiscovered(id uint64, why string) {
	s.mu.Lock()
	w := s.workers[id]
	if w == nil || !w.discovered {
		s.mu.Unlock()
		return
	}
	delete(s.workers, id)
	s.mu.Unlock()
	s.router.RemoveWorker(id)
	s.plane.sub.WorkerRemoved(id)
	s.mu.Lock()
	s.notifyLocked()
	s.mu.Unlock()
	// An engine that deregisters leaves in order; one whose lease ran out
	// may have crashed.
	level := slog.LevelWarn
	if why == "deregistered" {
		level = slog.LevelInfo
	}
	s.log.Log(context.Background(), level, "engine left routing", "worker", w.spec.Name, "why", why)
}

// planeHealth reports the NATS connection for /health: without it the
// router keeps routing on what it last knew, and says so.
func (s *Server) planeHealth() map[string]string {
	if s.plane == nil {
		return nil
	}
	status := "ok"
	if c := s.cfg.Plane.Conn; !c.IsConnected() {
		status = fmt.Sprintf("disconnected (%s): routing on the last known state", c.Status())
	}
	return map[string]string{"nats": status}
}

var errNoEngines = errors.New(`serve: no engines: give each with --worker url=http://HOST:8000,events=tcp://HOST:5557 or in a --config file, or let them join through NATS discovery ("kvrouter agent" next to each engine)`)
