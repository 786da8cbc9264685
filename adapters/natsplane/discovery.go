package natsplane

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// DefaultLeaseTTL is how long a worker stays registered without a
// heartbeat.
const DefaultLeaseTTL = 10 * time.Second

// Instance is one engine as registered in discovery.
type Instance struct {
	WorkerID            uint64 `json:"worker_id"`
	Name                string `json:"name"`
	Model               string `json:"model"`
	URL                 string `json:"url"` // OpenAI HTTP base URL
	BlockSize           int    `json:"block_size"`
	DPSize              int    `json:"dp_size"`
	Role                string `json:"role"` // "both", "prefill" or "decode"
	TotalKVBlocks       int    `json:"total_kv_blocks"`
	MaxNumBatchedTokens int    `json:"max_num_batched_tokens"`
	// Tokenizer is the model's Hugging Face tokenizer as the engine's side
	// names it (a model id, or a path valid on the routers' machines);
	// routers resolve it locally and never download it.
	Tokenizer string `json:"tokenizer,omitempty"`
	// Device is what the engine computes on: cpu, or an accelerator such
	// as cuda ("" is one), for device-aware-weighted routing.
	Device string `json:"device,omitempty"`
	// Incarnation changes each time the agent starts, so routers resync a
	// worker that restarted within its lease.
	Incarnation uint64 `json:"incarnation"`
}

func (in Instance) validate() error {
	switch {
	case in.WorkerID == 0:
		return errors.New("natsplane: instance needs a worker id")
	case in.URL == "":
		return fmt.Errorf("natsplane: instance %d has no url", in.WorkerID)
	case in.DPSize < 1:
		return fmt.Errorf("natsplane: instance %d: dp size %d", in.WorkerID, in.DPSize)
	}
	return nil
}

func instancesBucket(ctx context.Context, js jetstream.JetStream, names Names, ttl time.Duration) (jetstream.KeyValue, error) {
	return js.CreateOrUpdateKeyValue(ctx, jetstream.KeyValueConfig{
		Bucket: names.InstancesBucket(), History: 1, TTL: ttl, Storage: jetstream.FileStorage,
	})
}

func discoveryDefaults(nc *nats.Conn, names Names, ttl time.Duration, log *slog.Logger) (Names, time.Duration, *slog.Logger, jetstream.JetStream, error) {
	if ttl <= 0 {
		ttl = DefaultLeaseTTL
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	js, err := jetstream.New(nc)
	return names.orDefault(), ttl, log, js, err
}

// Registration keeps one instance's lease alive until Close.
type Registration struct {
	cancel context.CancelFunc
	done   chan struct{}
	kv     jetstream.KeyValue
	key    string
	// value is the instance's JSON the heartbeat puts; Update replaces it.
	value atomic.Pointer[[]byte]
}

// Register puts inst in discovery and re-puts it every ttl/3 so that it
// expires ttl after the process stops heartbeating. A failed heartbeat (NATS
// down, bucket lost with a non-persistent server) is logged and retried,
// re-creating the bucket if needed.
func Register(ctx context.Context, nc *nats.Conn, names Names, inst Instance, ttl time.Duration, log *slog.Logger) (*Registration, error) {
	if err := inst.validate(); err != nil {
		return nil, err
	}
	names, ttl, log, js, err := discoveryDefaults(nc, names, ttl, log)
	if err != nil {
		return nil, err
	}
	value, err := json.Marshal(inst)
	if err != nil {
		return nil, err
	}
	kv, err := instancesBucket(ctx, js, names, ttl)
	if err != nil {
		return nil, fmt.Errorf("natsplane: discovery bucket: %w", err)
	}
	key := names.InstanceKey(inst.WorkerID)
	if _, err := kv.Put(ctx, key, value); err != nil {
		if ctx.Err() != nil {
			// Cancelled while waiting for the ack: the put may have landed,
			// and routers must not route to an engine whose agent stopped.
			dctx, dcancel := context.WithTimeout(context.Background(), time.Second)
			_ = kv.Delete(dctx, key)
			dcancel()
		}
		return nil, fmt.Errorf("natsplane: register %s: %w", inst.Name, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &Registration{cancel: cancel, done: make(chan struct{}), kv: kv, key: key}
	r.value.Store(&value)
	go func() {
		defer close(r.done)
		t := time.NewTicker(ttl / 3)
		defer t.Stop()
		failing := false
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			pctx, pcancel := context.WithTimeout(ctx, ttl/3)
			value := *r.value.Load()
			_, err := kv.Put(pctx, key, value)
			if err != nil {
				if b, e := instancesBucket(pctx, js, names, ttl); e == nil {
					kv = b
					_, err = kv.Put(pctx, key, value)
				}
			}
			pcancel()
			switch {
			case err != nil && !failing:
				log.Warn("discovery heartbeat failed; retrying", "worker", inst.Name, "err", err)
				failing = true
			case err == nil && failing:
				log.Info("discovery heartbeat restored", "worker", inst.Name)
				failing = false
			}
		}
	}()
	return r, nil
}

// Update replaces the registered details of the instance (same worker id)
// and puts them at once; routers see the change as the worker being added
// again. A failed put is left to the next heartbeat.
func (r *Registration) Update(ctx context.Context, inst Instance) error {
	if err := inst.validate(); err != nil {
		return err
	}
	value, err := json.Marshal(inst)
	if err != nil {
		return err
	}
	r.value.Store(&value)
	_, err = r.kv.Put(ctx, r.key, value)
	return err
}

// Close stops heartbeating and deletes the key so that routers drop the
// worker at once instead of at lease expiry.
func (r *Registration) Close() error {
	r.cancel()
	<-r.done
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	return r.kv.Delete(ctx, r.key)
}

// Abandon stops heartbeating without deleting: the lease runs out as if
// the process had died (tests use it to simulate a crash).
func (r *Registration) Abandon() {
	r.cancel()
	<-r.done
}

// WatchHandler receives discovery changes on the watcher's goroutine.
type WatchHandler struct {
	Added   func(Instance) // new worker, or a registered one whose details changed
	Removed func(worker uint64, why string)
}

// Watcher follows discovery for a router. It expires a worker whose key
// was not refreshed within the lease TTL by its own clock, so a worker
// leaves routing on time even if the bucket's own expiry is not reported.
type Watcher struct {
	cancel context.CancelFunc
	done   chan struct{}
	ready  chan struct{}
}

type lease struct {
	inst    Instance
	expires time.Time
}

// Watch follows the instances of names.Component until Close. Ready is
// closed once the instances present at start have been handed to Added.
func Watch(ctx context.Context, nc *nats.Conn, names Names, ttl time.Duration, h WatchHandler, log *slog.Logger) (*Watcher, error) {
	names, ttl, log, js, err := discoveryDefaults(nc, names, ttl, log)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(ctx)
	w := &Watcher{cancel: cancel, done: make(chan struct{}), ready: make(chan struct{})}
	go w.run(ctx, nc, js, names, ttl, h, log)
	return w, nil
}

// Ready is closed once the initial instances are known.
func (w *Watcher) Ready() <-chan struct{} { return w.ready }

// Close stops watching.
func (w *Watcher) Close() {
	w.cancel()
	<-w.done
}

func (w *Watcher) run(ctx context.Context, nc *nats.Conn, js jetstream.JetStream, names Names, ttl time.Duration, h WatchHandler, log *slog.Logger) {
	defer close(w.done)
	leases := map[uint64]*lease{}
	var readyOnce sync.Once
	markReady := func() { readyOnce.Do(func() { close(w.ready) }) }
	defer markReady()
	sweep := time.NewTicker(max(ttl/8, 10*time.Millisecond))
	defer sweep.Stop()
	prefix := names.Component + "."
	for ctx.Err() == nil {
		kv, err := instancesBucket(ctx, js, names, ttl)
		var watcher jetstream.KeyWatcher
		if err == nil {
			watcher, err = kv.Watch(ctx, prefix+"*")
		}
		if err != nil {
			log.Warn("discovery unavailable; keeping the known workers", "err", err)
			select {
			case <-ctx.Done():
				return
			case <-time.After(500 * time.Millisecond):
			}
			continue
		}
		// A watch ends when NATS goes away; a new one replays the bucket,
		// and leases already known just get refreshed. A watch can also
		// survive a reconnect yet deliver nothing more (its consumer died
		// with the restarted server), so a reconnect, or a watch silent for
		// a whole TTL, re-creates it before any lease may expire.
		reconnects := nc.Stats().Reconnects
		lastUpdate := time.Now()
		alive := true
		for alive {
			select {
			case <-ctx.Done():
				_ = watcher.Stop()
				return
			case now := <-sweep.C:
				if !nc.IsConnected() {
					// Heartbeats cannot arrive during an outage: keep
					// routing to the known workers until discovery is back.
					for _, l := range leases {
						l.expires = now.Add(ttl)
					}
					continue
				}
				if r := nc.Stats().Reconnects; r != reconnects {
					// Heartbeats sent while we were reconnecting were not
					// seen: count every lease from the reconnect.
					for _, l := range leases {
						l.expires = now.Add(ttl)
					}
					log.Info("discovery reconnected; re-watching")
					alive = false
					continue
				}
				if now.Sub(lastUpdate) >= ttl && anyExpired(leases, now) {
					log.Info("discovery watch silent for a lease; re-watching")
					alive = false
					continue
				}
				for id, l := range leases {
					if now.After(l.expires) {
						delete(leases, id)
						h.Removed(id, "lease expired")
					}
				}
			case e, ok := <-watcher.Updates():
				if !ok {
					alive = false
					break
				}
				lastUpdate = time.Now()
				if e == nil {
					markReady()
					continue
				}
				id, err := strconv.ParseUint(strings.TrimPrefix(e.Key(), prefix), 10, 64)
				if err != nil {
					log.Warn("discovery: foreign key skipped", "key", e.Key())
					continue
				}
				if e.Operation() != jetstream.KeyValuePut {
					if leases[id] != nil {
						delete(leases, id)
						h.Removed(id, "deregistered")
					}
					continue
				}
				var inst Instance
				if err := json.Unmarshal(e.Value(), &inst); err != nil || inst.validate() != nil || inst.WorkerID != id {
					log.Warn("discovery: malformed instance skipped", "key", e.Key())
					continue
				}
				// By the entry's own time, so a stale key of a dead worker
				// found at start expires at once; capped in case the
				// server's clock runs ahead of ours.
				expires := e.Created().Add(ttl)
				if capped := time.Now().Add(ttl); expires.After(capped) {
					expires = capped
				}
				l := leases[id]
				if l == nil || l.inst != inst {
					leases[id] = &lease{inst: inst, expires: expires}
					h.Added(inst)
					continue
				}
				l.expires = expires
			}
		}
		_ = watcher.Stop()
	}
}

func anyExpired(leases map[uint64]*lease, now time.Time) bool {
	for _, l := range leases {
		if now.After(l.expires) {
			return true
		}
	}
	return false
}
