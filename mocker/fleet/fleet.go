// Package fleet starts simulated engines in one process, each looking like
// a vLLM server from outside: an OpenAI HTTP port, and per data-parallel
// rank a ZMQ PUB socket of KV events with a replay socket. It is what
// `kvrouter mocker` runs and what `kvrouter up` embeds.
package fleet

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvrouter/kvrouter/adapters/vllmevents"
	"github.com/kvrouter/kvrouter/adapters/zmqevents"
	"github.com/kvrouter/kvrouter/mocker/engine"
	"github.com/kvrouter/kvrouter/mocker/server"
)

// Config describes the fleet; the comments name the mocker's flags.
type Config struct {
	NumWorkers       int     // --num-workers
	DataParallelSize int     // --data-parallel-size
	SpeedupRatio     float64 // --speedup-ratio
	Engine           engine.Config
	// Server is every engine's HTTP face: --model-name, limits, and for
	// disaggregated serving the default role (--role) and the KV transfer
	// link (--kv-transfer-bandwidth, --kv-bytes-per-token,
	// --kv-transfer-timeout).
	Server server.Config
	// Tokenizer is the path of a Hugging Face tokenizer (a directory
	// holding tokenizer.json, or that file) every engine tokenizes with
	// (--tokenizer); Start loads it once into Server.Tokenizer. Empty keeps
	// Server.Tokenizer, by default the mocker's own tokenizer.
	Tokenizer string
	// Roles sets engine i's role to Roles[i], so that one fleet can hold
	// both the prefill and the decode engines of a disaggregated pair;
	// engines past its end take Server.Role.
	Roles []server.Role
	// Specs sizes engine i by Specs[i] (--fleet): its speed and KV blocks
	// relative to Engine; engines past its end are Engine.
	Specs []EngineSpec
	Host  string // address to bind, 127.0.0.1 by default
	// Engine i serves HTTP on HTTPPort+i; rank r of engine i publishes KV
	// events on KVEventsPort + i×dp + r and answers replay requests on
	// KVEventsReplayPort + i×dp + r. Port 0 picks free ports instead.
	HTTPPort, KVEventsPort, KVEventsReplayPort int
	Encoding                                   vllmevents.Encoding // --kv-events-encoding
	// NoKVEvents starts every engine silent, as vLLM without
	// --kv-events-config: its sockets are bound but it publishes nothing
	// until SetKVEvents turns it on (--no-kv-events).
	NoKVEvents bool
	// ReplayBufferSize is how many batches each rank keeps for replay
	// (--kv-events-buffer-steps); 0 means zmqevents.DefaultBufferSize.
	ReplayBufferSize int
	// Clock makes a clock per rank; nil means real time.
	Clock func() server.Clock
	// ZMQMaxMessageBytes bounds what a peer may send to the ZMQ sockets,
	// at most 64 KiB (see zmqevents.PublisherConfig.MaxMessageBytes); 0
	// means 64 KiB.
	ZMQMaxMessageBytes int64
	// Logger receives the ZMQ peers dropped for oversized or malformed
	// input (rate-limited); nil discards.
	Logger *slog.Logger
}

// DefaultConfig is one engine with vLLM's defaults.
func DefaultConfig() Config {
	return Config{
		NumWorkers: 1, DataParallelSize: 1, SpeedupRatio: 1,
		Engine: engine.DefaultConfig(), Server: server.DefaultConfig(),
		Host: "127.0.0.1", HTTPPort: 8100, KVEventsPort: 5557, KVEventsReplayPort: 6557,
	}
}

// RankSeed is the engine seed of the n-th rank of a fleet (counting
// every rank of every engine) whose engines are configured with seed.
// Distinct seeds: engines name the same content with different ids, as
// independent vLLM processes with hash salts would.
func RankSeed(seed uint64, n int) uint64 { return seed ^ uint64(n+1)*0x9e3779b97f4a7c15 }

// Rank is where one data-parallel rank publishes.
type Rank struct {
	Rank           int
	Events, Replay string // ZMQ endpoints
	Runner         *server.Runner
}

// DisaggregatedRoles lays out a fleet of prefill engines, then decode
// engines, for Config.Roles.
func DisaggregatedRoles(prefill, decode int) []server.Role {
	roles := make([]server.Role, 0, prefill+decode)
	for range prefill {
		roles = append(roles, server.RolePrefill)
	}
	for range decode {
		roles = append(roles, server.RoleDecode)
	}
	return roles
}

// Engine is one simulated vLLM server.
type Engine struct {
	Name    string
	HTTPURL string
	Ranks   []Rank
	Role    server.Role // its part in disaggregated serving
}

// Fleet is a running set of engines. Close stops it.
type Fleet struct {
	engines []Engine
	cancel  context.CancelFunc
	wg      sync.WaitGroup
	servers []*http.Server
	pubs    []*zmqevents.Publisher
	pubErrs []error // per rank: the last publish error, for diagnosis
	errMu   sync.Mutex
	silent  []*atomic.Bool // per engine: publishes no KV events
	engine  engine.Config  // every rank's, for the KV-cache groups of its events
}

func port(base, offset int) int {
	if base == 0 {
		return 0
	}
	return base + offset
}

// Start binds every socket and starts serving. On error nothing is left
// running.
func Start(ctx context.Context, cfg Config) (_ *Fleet, err error) {
	if cfg.NumWorkers < 1 || cfg.DataParallelSize < 1 {
		return nil, fmt.Errorf("fleet: need at least one worker and one rank, got %d × %d", cfg.NumWorkers, cfg.DataParallelSize)
	}
	if cfg.SpeedupRatio <= 0 {
		return nil, fmt.Errorf("fleet: speedup ratio must be positive, got %v", cfg.SpeedupRatio)
	}
	if cfg.Host == "" {
		cfg.Host = "127.0.0.1"
	}
	if len(cfg.Specs) > cfg.NumWorkers {
		return nil, fmt.Errorf("fleet: %d engine specs for %d engines", len(cfg.Specs), cfg.NumWorkers)
	}
	if len(cfg.Roles) > cfg.NumWorkers {
		return nil, fmt.Errorf("fleet: %d roles for %d engines", len(cfg.Roles), cfg.NumWorkers)
	}
	roles := make([]server.Role, cfg.NumWorkers)
	for i := range roles {
		r := cfg.Server.Role
		if i < len(cfg.Roles) {
			r = cfg.Roles[i]
		}
		var err error
		if roles[i], err = server.ParseRole(string(r)); err != nil {
			return nil, fmt.Errorf("fleet: engine %d: %w", i, err)
		}
	}
	if err := cfg.Server.KVTransfer.Validate(); err != nil {
		return nil, fmt.Errorf("fleet: %w", err)
	}
	if cfg.Tokenizer != "" {
		tok, err := server.LoadTokenizer(cfg.Tokenizer)
		if err != nil {
			return nil, fmt.Errorf("fleet: %w", err)
		}
		cfg.Server.Tokenizer = tok
	}
	ctx, cancel := context.WithCancel(ctx)
	f := &Fleet{cancel: cancel, engine: cfg.Engine}
	defer func() {
		if err != nil {
			f.Close()
		}
	}()
	dp := cfg.DataParallelSize
	for i := range cfg.NumWorkers {
		e := Engine{Name: "engine-" + strconv.Itoa(i), Role: roles[i]}
		silent := new(atomic.Bool)
		silent.Store(cfg.NoKVEvents)
		f.silent = append(f.silent, silent)
		var runners []*server.Runner
		for r := range dp {
			ecfg := cfg.EngineConfig(i)
			ecfg.Seed = RankSeed(cfg.Engine.Seed, i*dp+r)
			eng, err := engine.New(ecfg)
			if err != nil {
				return nil, err
			}
			pub, err := zmqevents.NewPublisher(zmqevents.PublisherConfig{
				Endpoint:        fmt.Sprintf("tcp://%s:%d", cfg.Host, port(cfg.KVEventsPort, i*dp+r)),
				ReplayEndpoint:  fmt.Sprintf("tcp://%s:%d", cfg.Host, port(cfg.KVEventsReplayPort, i*dp+r)),
				MaxMessageBytes: cfg.ZMQMaxMessageBytes,
				BufferSize:      cfg.ReplayBufferSize,
				Log:             cfg.Logger,
			})
			if err != nil {
				return nil, fmt.Errorf("fleet: %s rank %d: %w", e.Name, r, err)
			}
			f.pubs = append(f.pubs, pub)
			f.pubErrs = append(f.pubErrs, nil)
			clock := server.Clock(server.RealClock{})
			if cfg.Clock != nil {
				clock = cfg.Clock()
			}
			runner := server.NewRunner(eng, clock, cfg.SpeedupRatio, f.publisher(len(f.pubs)-1, pub, r, cfg.Engine.BlockSize, cfg.Encoding, silent))
			runners = append(runners, runner)
			e.Ranks = append(e.Ranks, Rank{Rank: r, Events: pub.Endpoint(), Replay: pub.ReplayEndpoint(), Runner: runner})
			f.wg.Add(1)
			go func() {
				defer f.wg.Done()
				_ = runner.Run(ctx)
			}()
		}
		scfg := cfg.Server
		scfg.Name = e.Name
		scfg.Role = e.Role
		scfg.KVEventsDump = f.dumper(i, cfg.Engine.BlockSize, cfg.Encoding)
		ln, err := net.Listen("tcp", net.JoinHostPort(cfg.Host, strconv.Itoa(port(cfg.HTTPPort, i))))
		if err != nil {
			return nil, fmt.Errorf("fleet: %s: %w", e.Name, err)
		}
		e.HTTPURL = "http://" + ln.Addr().String()
		engineServer := server.New(scfg, runners)
		engineServer.MustRegister(zmqDropped(e.Name, f.pubs[len(f.pubs)-dp:])...)
		srv := &http.Server{Handler: engineServer.Handler(), ReadHeaderTimeout: 10 * time.Second}
		f.servers = append(f.servers, srv)
		f.wg.Add(1)
		go func() {
			defer f.wg.Done()
			_ = srv.Serve(ln)
		}()
		f.engines = append(f.engines, e)
	}
	return f, nil
}

// publisher encodes each step's events as one vLLM batch on the rank's
// socket, unless the engine is silent.
func (f *Fleet) publisher(i int, pub *zmqevents.Publisher, rank, blockSize int, enc vllmevents.Encoding, silent *atomic.Bool) server.Publisher {
	return func(at time.Time, events []engine.BlockEvent) {
		if silent.Load() {
			return
		}
		batch := vllmevents.Batch{TS: float64(at.UnixNano()) / 1e9, DPRank: &rank}
		for _, ev := range events {
			switch ev.Kind {
			case engine.Stored:
				batch.Events = append(batch.Events, &vllmevents.BlockStored{BlockHashes: ev.BlockHashes, ParentBlockHash: ev.Parent, TokenIDs: ev.TokenIDs, BlockSize: blockSize, Medium: medium(ev),
					LoRAName: ev.LoRAName, ExtraKeys: encodeExtraKeys(ev.ExtraKeys)})
			case engine.Removed:
				batch.Events = append(batch.Events, &vllmevents.BlockRemoved{BlockHashes: ev.BlockHashes, Medium: medium(ev)})
			case engine.Cleared:
				batch.Events = append(batch.Events, &vllmevents.AllBlocksCleared{})
			}
		}
		labelGroups(batch.Events, func(i int) int { return events[i].Group }, f.engine)
		payload, err := vllmevents.EncodeBatch(&batch, enc)
		if err == nil {
			_, err = pub.Publish(payload)
		}
		if err != nil {
			f.errMu.Lock()
			f.pubErrs[i] = err
			f.errMu.Unlock()
		}
	}
}

// medium is the event's medium as vLLM names it: the host tier's is its
// offloading connector's CPU backend's (CPULoadStoreSpec.medium()).
func medium(ev engine.BlockEvent) vllmevents.Medium {
	if ev.Host {
		return "CPU"
	}
	return "GPU"
}

// dumper answers an engine's /kv_events/dump: a rank's cached blocks as
// single-block Stored events, parents first, in one batch numbered like
// the rank's published ones: the GPU's, then the host tier's with medium
// CPU. The host blocks keep their parents and tokens (the connector's
// events name them by id alone): a router restarted from the dump has
// seen none of their GPU copies, so it could place them no other way.
func (f *Fleet) dumper(eng int, blockSize int, enc vllmevents.Encoding) func(context.Context, int) (uint64, []byte, error) {
	return func(ctx context.Context, rank int) (next uint64, payload []byte, err error) {
		ierr := f.Inspect(ctx, eng, rank, func(n uint64, blocks []engine.CachedBlock) {
			next = n
			batch := vllmevents.Batch{TS: float64(time.Now().UnixNano()) / 1e9, DPRank: &rank}
			for _, b := range blocks {
				var keys [][]any
				if b.ExtraKeys != nil {
					keys = [][]any{b.ExtraKeys}
				}
				batch.Events = append(batch.Events, &vllmevents.BlockStored{BlockHashes: []uint64{b.Hash}, ParentBlockHash: b.Parent, TokenIDs: b.Tokens, BlockSize: blockSize,
					Medium: medium(engine.BlockEvent{Host: b.Host}), LoRAName: b.LoRAName, ExtraKeys: encodeExtraKeys(keys)})
			}
			labelGroups(batch.Events, func(int) int { return f.engine.OwnGroup() }, f.engine)
			payload, err = vllmevents.EncodeBatch(&batch, enc)
		})
		return next, payload, cmp.Or(ierr, err)
	}
}

// Inspect pauses a rank between two steps and calls fn with its cached
// blocks (the GPU's, then the host tier's, each parents first; valid
// during the call) and the sequence number
// of its next KV event batch: the blocks are what the batches before it
// add up to, and nothing is published until fn returns.
func (f *Fleet) Inspect(ctx context.Context, eng, rank int, fn func(next uint64, blocks []engine.CachedBlock)) error {
	if eng < 0 || eng >= len(f.engines) || rank < 0 || rank >= len(f.engines[eng].Ranks) {
		return fmt.Errorf("fleet: no engine %d rank %d", eng, rank)
	}
	pub := f.pubs[eng*len(f.engines[0].Ranks)+rank]
	return f.engines[eng].Ranks[rank].Runner.Snapshot(ctx, func(eng *engine.Engine) {
		fn(pub.NextSeq(), append(eng.CachedBlocks(), eng.HostBlocks()...))
	})
}

// Buffered is the range of KV event batches a rank keeps for replay:
// [oldest, next).
func (f *Fleet) Buffered(eng, rank int) (oldest, next uint64) {
	return f.pubs[eng*len(f.engines[0].Ranks)+rank].Buffered()
}

// SetKVEvents starts (on) or stops engine eng publishing its KV events
// from its next step on. What it stored while silent is never announced:
// a router learns of those blocks as of a lost history.
func (f *Fleet) SetKVEvents(eng int, on bool) {
	f.silent[eng].Store(!on)
}

// Engines describes the running engines.
func (f *Fleet) Engines() []Engine { return f.engines }

// Timing sums the pacing figures of every rank.
func (f *Fleet) Timing() server.Timing {
	var t server.Timing
	for _, e := range f.engines {
		for _, r := range e.Ranks {
			rt := r.Runner.Timing()
			t.Steps += rt.Steps
			t.Model += rt.Model
			t.Actual += rt.Actual
			t.LagResets += rt.LagResets
		}
	}
	return t
}

// PublishErr returns the first error a rank met publishing events, if any.
func (f *Fleet) PublishErr() error {
	f.errMu.Lock()
	defer f.errMu.Unlock()
	return errors.Join(f.pubErrs...)
}

// PrintTable writes the engines as a table: name, HTTP URL, events and
// replay endpoints, and the roles when some engine is not RoleBoth.
func (f *Fleet) PrintTable(w io.Writer) {
	disagg := slices.ContainsFunc(f.engines, func(e Engine) bool { return e.Role != server.RoleBoth })
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	if disagg {
		fmt.Fprintln(tw, "ENGINE\tROLE\tRANK\tHTTP\tKV EVENTS\tREPLAY")
	} else {
		fmt.Fprintln(tw, "ENGINE\tRANK\tHTTP\tKV EVENTS\tREPLAY")
	}
	for _, e := range f.engines {
		for _, r := range e.Ranks {
			if disagg {
				fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%s\n", e.Name, e.Role, r.Rank, e.HTTPURL, r.Events, r.Replay)
			} else {
				fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\n", e.Name, r.Rank, e.HTTPURL, r.Events, r.Replay)
			}
		}
	}
	tw.Flush()
}

// Close stops serving and releases every socket.
func (f *Fleet) Close() {
	f.cancel()
	for _, s := range f.servers {
		_ = s.Close()
	}
	f.wg.Wait()
	for _, p := range f.pubs {
		_ = p.Close()
	}
}

// zmqDropped counts the peers an engine's ZMQ sockets dropped.
func zmqDropped(engine string, pubs []*zmqevents.Publisher) []prometheus.Collector {
	counter := func(name, help string, read func(zmqevents.PublisherStats) uint64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Name: name, Help: help, ConstLabels: prometheus.Labels{"engine": engine}}, func() float64 {
			var n uint64
			for _, p := range pubs {
				n += read(p.Stats())
			}
			return float64(n)
		})
	}
	return []prometheus.Collector{
		counter("kvrouter_zmq_oversized_messages_total", "ZMQ peers disconnected for announcing a message above --zmq-max-message-bytes.",
			func(st zmqevents.PublisherStats) uint64 { return st.Oversized }),
		counter("kvrouter_zmq_bad_handshakes_total", "ZMQ peers disconnected for a malformed or stalled handshake.",
			func(st zmqevents.PublisherStats) uint64 { return st.BadHandshakes }),
	}
}

// encodeExtraKeys writes a Stored event's per-block extra keys as vLLM's
// msgspec does: a list with one entry per block, nil or an array (a tuple;
// a multimodal item is an (identifier, offset) pair). nil when there are
// none.
func encodeExtraKeys(keys [][]any) []byte {
	if keys == nil {
		return nil
	}
	b, err := msgpack.Marshal(keys)
	if err != nil { // strings, ints and nested slices of them always encode
		panic(err)
	}
	return b
}
