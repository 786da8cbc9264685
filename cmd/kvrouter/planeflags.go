package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/spf13/pflag"

	"github.com/kvrouter/kvrouter/adapters/natsplane"
	"github.com/kvrouter/kvrouter/internal/agent"
	"github.com/kvrouter/kvrouter/internal/serve"
)

// planeFlags are the NATS plane's flags, shared by up, serve and agent.
type planeFlags struct {
	natsURL   string
	natsHost  string
	natsPort  int
	storeDir  string
	namespace string
	component string
	leaseTTL  time.Duration

	// Router side only.
	routerID          string
	durable           bool
	replicaSync       bool
	snapshotThreshold uint64
	resetStates       bool
}

func (p *planeFlags) register(fs *pflag.FlagSet, routerSide bool, defaultNATSPort int) {
	fs.StringVar(&p.natsURL, "nats-url", "", "NATS server or cluster to use (env NATS_SERVER); empty starts an embedded one")
	fs.StringVar(&p.namespace, "namespace", natsplane.DefaultNamespace, "namespace of this fleet on NATS; fleets in other namespaces are invisible")
	fs.StringVar(&p.component, "component", natsplane.DefaultComponent, "component name of the engines within the namespace")
	fs.DurationVar(&p.leaseTTL, "lease-ttl", natsplane.DefaultLeaseTTL, "an engine leaves routing this long after its agent's last heartbeat")
	if !routerSide {
		return
	}
	fs.StringVar(&p.natsHost, "nats-host", "127.0.0.1", "address of the embedded NATS server")
	fs.IntVar(&p.natsPort, "nats-port", defaultNATSPort, "port of the embedded NATS server (0: any free one)")
	fs.StringVar(&p.storeDir, "nats-store-dir", "", "JetStream storage of the embedded server (default: a temporary directory)")
	fs.StringVar(&p.routerID, "router-id", "", "this replica's id on the plane (default: host name and process id)")
	fs.BoolVar(&p.durable, "router-durable-kv-events", false, "read KV events from a durable JetStream stream with snapshots instead of NATS core with recovery")
	fs.BoolVar(&p.replicaSync, "router-replica-sync", false, "share booked load with the other router replicas")
	fs.Uint64Var(&p.snapshotThreshold, "router-snapshot-threshold", natsplane.DefaultSnapshotThreshold, "durable mode: stream length above which the index is snapshotted and the stream purged")
	fs.BoolVar(&p.resetStates, "router-reset-states", false, "durable mode: purge the event stream and the snapshot at start")
}

// connect dials --nats-url (or NATS_SERVER), or starts an embedded server
// when neither is given. stop closes what it started.
func (p *planeFlags) connect(fs *pflag.FlagSet, name string, log *slog.Logger) (nc *nats.Conn, url string, stop func(), err error) {
	url = p.natsURL
	if !fs.Changed("nats-url") && os.Getenv("NATS_SERVER") != "" {
		url = os.Getenv("NATS_SERVER")
	}
	var cleanups []func()
	stop = func() {
		for i := len(cleanups) - 1; i >= 0; i-- {
			cleanups[i]()
		}
	}
	if url == "" {
		dir := p.storeDir
		if dir == "" {
			if dir, err = os.MkdirTemp("", "kvrouter-nats-"); err != nil {
				return nil, "", stop, err
			}
			cleanups = append(cleanups, func() { os.RemoveAll(dir) })
		} else if dir, err = filepath.Abs(dir); err != nil {
			return nil, "", stop, err
		}
		srv, err := natsplane.StartEmbedded(natsplane.EmbeddedConfig{Host: p.natsHost, Port: p.natsPort, StoreDir: dir})
		if err != nil {
			stop()
			return nil, "", stop, err
		}
		cleanups = append(cleanups, srv.Shutdown)
		url = srv.URL()
		log.Info("embedded NATS server started", "url", url, "store", dir)
	}
	nc, err = natsplane.Connect(url, name, log)
	if err != nil {
		stop()
		return nil, "", stop, fmt.Errorf("NATS at %s: %w", url, err)
	}
	cleanups = append(cleanups, nc.Close)
	return nc, url, stop, nil
}

func (p *planeFlags) names() natsplane.Names {
	return natsplane.Names{Namespace: p.namespace, Component: p.component}
}

func (p *planeFlags) plane(nc *nats.Conn) *serve.Plane {
	id := p.routerID
	if id == "" {
		host, _ := os.Hostname()
		id = fmt.Sprintf("%s-%s", host, strconv.Itoa(os.Getpid()))
	}
	return &serve.Plane{
		Conn: nc, Names: p.names(), RouterID: id, Durable: p.durable, ReplicaSync: p.replicaSync,
		SnapshotThreshold: p.snapshotThreshold, ResetStates: p.resetStates, LeaseTTL: p.leaseTTL,
	}
}

// startAgents puts every engine of a simulated fleet on the plane, one
// in-process agent each, as "kvrouter agent" would from outside.
func startAgents(ctx context.Context, nc *nats.Conn, pf *planeFlags, workers []serve.WorkerSpec, blockSize int, zmqMaxMessageBytes int64, log *slog.Logger) (stop func(), err error) {
	var agents []*agent.Agent
	stop = func() {
		for _, a := range agents {
			a.Close()
		}
	}
	for _, w := range workers {
		a, err := agent.Start(ctx, nc, agent.Config{
			Names: pf.names(), Events: w.Events, Replay: w.Replay, LeaseTTL: pf.leaseTTL, Logger: log, ZMQMaxMessageBytes: zmqMaxMessageBytes,
			Instance: natsplane.Instance{
				WorkerID: w.ID, Name: w.Name, Model: w.Model, URL: w.URL, BlockSize: blockSize,
				DPSize: w.DPSize, TotalKVBlocks: w.KVBlocks, MaxNumBatchedTokens: w.MaxBatchedTokens,
			},
		})
		if err != nil {
			stop()
			return func() {}, err
		}
		agents = append(agents, a)
	}
	return stop, nil
}
