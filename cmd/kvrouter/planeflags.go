package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/spf13/pflag"

	"github.com/kvrouter/kvrouter/adapters/natsplane"
	"github.com/kvrouter/kvrouter/internal/agent"
	"github.com/kvrouter/kvrouter/internal/serve"
)

// planeFlags are the NATS plane's flags, shared by up, serve, agent and mocker.
type planeFlags struct {
	natsURL   string
	auth      natsplane.Auth
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
	fs.StringVar(&p.natsURL, "nats-url", "", "NATS server or cluster to use (env NATS_SERVER, NATS_URL); empty starts an embedded one")
	fs.StringVar(&p.auth.Token, "nats-token", "", "NATS token (env NATS_AUTH_TOKEN); with the embedded server, required of its clients")
	fs.StringVar(&p.auth.User, "nats-user", "", "NATS user (env NATS_AUTH_USERNAME, NATS_USER; without a password: a token); with the embedded server, required of its clients")
	fs.StringVar(&p.auth.Password, "nats-password", "", "NATS password (env NATS_AUTH_PASSWORD, NATS_PASSWORD)")
	fs.StringVar(&p.auth.CredsFile, "nats-creds", "", "NATS user credentials file, JWT and seed (env NATS_AUTH_CREDENTIALS_FILE, NATS_CREDS)")
	fs.StringVar(&p.auth.NkeySeedFile, "nats-nkey-seed", "", "file with the NATS user's nkey seed (env NATS_NKEY; NATS_AUTH_NKEY: the seed itself)")
	fs.StringVar(&p.auth.TLSCA, "nats-tls-ca", "", "CA file the NATS server's certificate must chain to; turns TLS on (env NATS_TLS_CA_CERT_PATH, NATS_CA)")
	fs.StringVar(&p.auth.TLSCert, "nats-tls-cert", "", "client certificate for NATS servers that verify clients (env NATS_TLS_CLIENT_CERT_PATH, NATS_CERT)")
	fs.StringVar(&p.auth.TLSKey, "nats-tls-key", "", "key of --nats-tls-cert (env NATS_TLS_CLIENT_KEY_PATH, NATS_KEY)")
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

// natsEnv lists, per flag, the variables NATS tooling already reads, in
// order of precedence after DYN_<FLAG>: Dynamo's, then the nats CLI's.
var natsEnv = []struct {
	flag string
	envs []string
}{
	{"nats-url", []string{"NATS_SERVER", "NATS_URL"}},
	{"nats-token", []string{"NATS_AUTH_TOKEN"}},
	{"nats-user", []string{"NATS_AUTH_USERNAME", "NATS_USER"}},
	{"nats-password", []string{"NATS_AUTH_PASSWORD", "NATS_PASSWORD"}},
	{"nats-creds", []string{"NATS_AUTH_CREDENTIALS_FILE", "NATS_CREDS"}},
	{"nats-nkey-seed", []string{"NATS_NKEY"}},
	{"nats-tls-ca", []string{"NATS_TLS_CA_CERT_PATH", "NATS_CA"}},
	{"nats-tls-cert", []string{"NATS_TLS_CLIENT_CERT_PATH", "NATS_CERT"}},
	{"nats-tls-key", []string{"NATS_TLS_CLIENT_KEY_PATH", "NATS_KEY"}},
}

// connect dials --nats-url, or starts an embedded server when it is not
// given. stop closes what it started.
func (p *planeFlags) connect(fs *pflag.FlagSet, name string, log *slog.Logger) (nc *nats.Conn, url string, stop func(), err error) {
	url = p.natsURL
	auth := p.auth
	if fs.Lookup("nats-nkey-seed") != nil && !fs.Changed("nats-nkey-seed") {
		auth.NkeySeed = os.Getenv("NATS_AUTH_NKEY")
	}
	var cleanups []func()
	stop = func() {
		for i := len(cleanups) - 1; i >= 0; i-- {
			cleanups[i]()
		}
	}
	if url == "" {
		if auth.NkeySeedFile != "" || auth.NkeySeed != "" || auth.CredsFile != "" || auth.TLSCA != "" || auth.TLSCert != "" {
			return nil, "", stop, errors.New("nkeys, credentials files and TLS need an external NATS server (--nats-url); the embedded one takes --nats-token or --nats-user and --nats-password")
		}
		dir := p.storeDir
		if dir == "" {
			if dir, err = os.MkdirTemp("", "kvrouter-nats-"); err != nil {
				return nil, "", stop, err
			}
			cleanups = append(cleanups, func() { os.RemoveAll(dir) })
		} else if dir, err = filepath.Abs(dir); err != nil {
			return nil, "", stop, err
		}
		srv, err := natsplane.StartEmbedded(natsplane.EmbeddedConfig{
			Host: p.natsHost, Port: p.natsPort, StoreDir: dir,
			Token: auth.Token, User: auth.User, Password: auth.Password,
		})
		if err != nil {
			stop()
			return nil, "", stop, err
		}
		cleanups = append(cleanups, srv.Shutdown)
		url, auth = srv.URL(), srv.ClientAuth()
		log.Info("embedded NATS server started", "url", url, "store", dir)
		if srv.TokenGenerated() {
			tokenFile := filepath.Join(dir, "nats-token")
			if err := os.WriteFile(tokenFile, []byte(auth.Token+"\n"), 0o600); err != nil {
				stop()
				return nil, "", stop, fmt.Errorf("embedded NATS server: writing its token: %w", err)
			}
			log.Warn("the embedded NATS server listens beyond loopback, so it requires a token; agents pass it with --nats-token or NATS_AUTH_TOKEN",
				"token_file", tokenFile)
		}
	}
	opts, err := auth.Options()
	if err != nil {
		stop()
		return nil, "", stop, err
	}
	nc, err = natsplane.Connect(url, name, log, opts...)
	if err != nil {
		stop()
		return nil, "", stop, fmt.Errorf("NATS at %s: %w", natsplane.RedactURL(url), err)
	}
	cleanups = append(cleanups, nc.Close)
	return nc, natsplane.RedactURL(url), stop, nil
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
// in-process agent each, as "kvrouter agent" would from outside. stop
// deregisters them; calling it again does nothing.
func startAgents(ctx context.Context, nc *nats.Conn, pf *planeFlags, workers []serve.WorkerSpec, blockSize int, zmqMaxMessageBytes int64, silenceProbe time.Duration, log *slog.Logger) (stop func(), err error) {
	var (
		agents []*agent.Agent
		once   sync.Once
	)
	stop = func() {
		once.Do(func() {
			for _, a := range agents {
				a.Close()
			}
		})
	}
	for _, w := range workers {
		a, err := agent.Start(ctx, nc, agent.Config{
			Names: pf.names(), Events: w.Events, Replay: w.Replay, LeaseTTL: pf.leaseTTL, Logger: log, ZMQMaxMessageBytes: zmqMaxMessageBytes, SilenceProbe: silenceProbe,
			Instance: natsplane.Instance{
				WorkerID: w.ID, Name: w.Name, Model: w.Model, URL: w.URL, BlockSize: blockSize,
				DPSize: w.DPSize, TotalKVBlocks: w.KVBlocks, MaxNumBatchedTokens: w.MaxBatchedTokens, Role: w.Role, Tokenizer: w.Tokenizer, Device: w.Device,
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

// stoppedDuringStart makes a stop (Ctrl-C, SIGTERM) that lands while a
// command is still starting a clean exit rather than the error it caused.
func stoppedDuringStart(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return nil
	}
	return err
}
