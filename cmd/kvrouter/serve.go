package main

import (
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/internal/serve"
)

func newServeCmd() *cobra.Command {
	var migrationLimit int
	var (
		rf         = newRouterFlags()
		df         disaggFlags
		lora       loraFlags
		tf         tokenizerFlags
		lf         limitFlags
		hard       hardeningFlags
		pf         planeFlags
		kf         kubeFlags
		hf         httpFlags
		host       string
		port       int
		specs      []string
		configPath string
		zmqMax     int64
		eppPort    int
		eppHealth  int
		serveIx    bool
		remoteIx   string
		tr         transportFlags
	)
	cmd := &cobra.Command{
		Use:   "serve",
		Short: "OpenAI-compatible frontend routing on the engines' live KV events",
		Long: `Serves the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models) in
front of engines (vLLM, SGLang or kvrouter mocker), routing every request on
the engines' live KV events (ZMQ, vLLM's format) and the router's load
prediction. Also: the router API (/router/...), /live, /ready, /health,
/metrics and /busy_threshold.

serve listens on 0.0.0.0 like vLLM and Dynamo; beyond loopback give it
--api-key and --admin-token (better as DYN_API_KEY / DYN_ADMIN_TOKEN, out of
the process list) and, off a trusted network, --tls-cert-file and
--tls-key-file. SIGTERM or SIGINT drains: /ready turns 503, new connections
are refused, requests in flight get --shutdown-timeout seconds to finish.

Engines are given with --worker (repeatable) or in a JSON file (--config,
{"workers": [...]}) with the same fields:

  --worker url=http://10.0.0.5:8000,events=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558,dp=1,model=llama

url is the engine's HTTP base; events its KV-event PUB endpoint (rank r of a
data-parallel engine on port + r); replay its replay endpoint (optional);
dp its data-parallel size; model the model it serves; optional: id, name,
kv-blocks (its KV capacity, for busy detection), max-batched-tokens (for
the queue) and dump (an endpoint answering the engine's whole cache when its
events cannot be replayed, as "kvrouter mocker" serves on
http://HOST:PORT/kv_events/dump; vLLM has none).

With --epp-port, serve is also the endpoint picker (EPP) of a Gateway API
Inference Extension gateway: an InferencePool's endpointPickerRef names
that port, the gateway asks it for each request's engine over Envoy's
ext_proc, and forwards the request itself (docs/epp.md).

Engines also join through NATS discovery: run "kvrouter agent" next to each
one with the same --nats-url and --namespace. Without --nats-url (or
NATS_SERVER), serve starts an embedded NATS server on --nats-host:--nats-port
for the agents to join, unless it has --worker engines and no NATS or plane
flag (then it runs without NATS); beyond 127.0.0.1 it requires --nats-token (or a token
it generates into <nats-store-dir>/nats-token). Every flag can also be set as DYN_<FLAG>, e.g.
DYN_ROUTER_TEMPERATURE=0.5.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := applyEnv(cmd.Flags()); err != nil {
				return err
			}
			if err := tr.check(cmd.ErrOrStderr()); err != nil {
				return err
			}
			if migrationLimit < 0 {
				return fmt.Errorf("--migration-limit must be at least 0, got %d", migrationLimit)
			}
			eppAddr, eppHealthAddr, err := eppAddrs(host, eppPort, eppHealth)
			if err != nil {
				return err
			}
			log := slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), nil))
			rcfg, err := rf.config(cmd.Flags(), func(w string) { log.Warn(w) })
			if err != nil {
				return err
			}
			if err := lf.check(); err != nil {
				return err
			}
			lf.applyRouter(&rcfg)
			if err := hard.validate(); err != nil {
				return err
			}
			rcfg.RecoveryWindow = hard.recoveryWindow
			disagg, err := df.config(rf.noAssumeReuse, rcfg.QueueThreshold, rf.mode)
			if err != nil {
				return err
			}
			loraCfg, loraPoll, err := lora.config()
			if err != nil {
				return err
			}
			workers, err := loadWorkers(configPath, specs)
			if err != nil {
				return err
			}
			tokenizers, err := tf.load(workers)
			if err != nil {
				return err
			}
			placeholders, err := tf.placeholders()
			if err != nil {
				return err
			}
			shutdownTimeout, err := hf.timeout()
			if err != nil {
				return err
			}
			signalled, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			var plane *serve.Plane
			natsURL := ""
			discovery, err := kf.discovery(log)
			if err != nil {
				return err
			}
			joinPlane, err := tr.plane(wantsPlane(cmd.Flags(), pf.natsURL, workers, discovery != nil), pf.natsURL, len(workers) > 0, discovery != nil)
			if err != nil {
				return err
			}
			if joinPlane {
				nc, url, closeNATS, err := pf.connect(cmd.Flags(), "kvrouter-serve", log)
				if err != nil {
					return err
				}
				defer closeNATS()
				plane, natsURL = pf.plane(nc), url
			}
			// The engines stay in routing while the frontend drains: the
			// signal does not end serve's own context.
			headerTimeout, responseTimeout := hard.engineTimeouts()
			s, err := serve.Start(cmd.Context(), serve.Config{EPPAddr: eppAddr, EPPHealthAddr: eppHealthAddr, Router: rcfg, Workers: workers, Plane: plane, Addr: net.JoinHostPort(host, strconv.Itoa(port)), Logger: log, Access: hf.access, MigrationLimit: migrationLimit, ZMQMaxMessageBytes: zmqMax, SilenceProbe: hard.silenceProbeConfig(), MaxBookings: hard.maxBookings, StrictNvext: hard.strictNvext, DynamoMetricNames: hard.dynamoMetrics, EngineHeaderTimeout: headerTimeout, EngineResponseTimeout: responseTimeout, Outlier: hard.outlierConfig(), HTTP: lf.httpLimits(), Disagg: disagg, MinInitialWorkers: lf.minInitialWorkers, Tokenizers: tokenizers, TokenizerCacheLookup: tf.cacheLookup, MMPlaceholders: placeholders, LoRA: loraCfg, LoRAPollInterval: loraPoll, Discovery: discovery, ServeIndexer: serveIx, RemoteIndexer: remoteIx, SystemAddr: tr.systemAddr(host)})
			if err != nil {
				return err
			}
			if len(workers) > 0 {
				printWorkers(cmd.OutOrStdout(), workers)
			}
			if discovery != nil {
				fmt.Fprintf(cmd.OutOrStdout(), "\nkvrouter serving on %s (mode %s, dashboard %s/ui); engines discovered from Kubernetes: %s\n", s.URL(), rcfg.Mode, s.URL(), kf.describe())
			} else if plane != nil {
				fmt.Fprintf(cmd.OutOrStdout(), "\nkvrouter serving on %s (mode %s, dashboard %s/ui); engines also discovered on NATS %s, namespace %q\n", s.URL(), rcfg.Mode, s.URL(), natsURL, pf.namespace)
			} else {
				fmt.Fprintf(cmd.OutOrStdout(), "\nkvrouter serving on %s (mode %s, dashboard %s/ui); the --worker engines only, no NATS (--nats-url adds engines discovered there)\n", s.URL(), rcfg.Mode, s.URL())
			}
			if serveIx {
				fmt.Fprintf(cmd.OutOrStdout(), "KV indexer API (kvrouter indexer's) on %s%s: other routers use it with --use-remote-indexer %s%s\n", s.URL(), serve.IndexerPath, s.URL(), serve.IndexerPath)
			}
			if remoteIx != "" {
				fmt.Fprintf(cmd.OutOrStdout(), "routing by the remote KV indexer %s (the local approximate index while it does not answer)\n", remoteIx)
			}
			if a := s.SystemAddr(); a != "" {
				fmt.Fprintf(cmd.OutOrStdout(), "system port (/metrics, /health, /live, /ready) on %s\n", a)
			}
			if a := s.EPPAddr(); a != "" {
				fmt.Fprintf(cmd.OutOrStdout(), "endpoint picker (Gateway API Inference Extension, Envoy ext_proc) on %s\n", a)
			}
			<-signalled.Done()
			stop() // a second signal ends the process at once
			return s.Shutdown(shutdownTimeout)
		},
	}
	fs := cmd.Flags()
	fs.IntVar(&migrationLimit, "migration-limit", 0, "how many times a stream broken off by its engine may continue on another engine (0: it ends with an error event)")
	rf.register(fs)
	df.register(fs)
	lora.register(fs)
	tf.register(fs)
	lf.register(fs)
	hard.register(fs)
	pf.register(fs, true, 4222)
	kf.register(fs)
	hf.register(fs)
	fs.StringVar(&host, "http-host", "0.0.0.0", "address to listen on")
	fs.IntVar(&port, "http-port", 8000, "port to listen on")
	fs.StringArrayVar(&specs, "worker", nil, "an engine: url=...,events=...,replay=...,dp=N,model=M,role=prefill|decode|both,tokenizer=PATH (repeatable)")
	fs.StringVar(&configPath, "config", "", "JSON file with {\"workers\": [...]}")
	registerZMQMaxMessageBytes(fs, &zmqMax)
	fs.IntVar(&eppPort, "epp-port", 0, "also serve the Gateway API Inference Extension's endpoint picker (Envoy ext_proc gRPC, with gRPC health) on this port of --http-host, routing with the frontend (0: off; the Inference Extension uses 9002)")
	fs.IntVar(&eppHealth, "epp-health-port", 0, "also serve the endpoint picker's gRPC health service alone on this port (0: only on --epp-port; the Inference Extension uses 9003)")
	fs.BoolVar(&serveIx, "serve-indexer", false, "also serve this router's KV index to other routers and gateways, with kvrouter indexer's HTTP API under /indexer (docs/indexer.md)")
	fs.StringVar(&remoteIx, "use-remote-indexer", "", "route by the KV index of this indexer (kvrouter indexer's URL, or a --serve-indexer router's http://HOST:PORT/indexer) instead of subscribing to the engines' KV events; while it does not answer, by the local approximate index")
	tr.register(fs)
	registerDynamoAliases(fs)
	return cmd
}

// eppAddrs are the endpoint picker's listen addresses from its ports.
func eppAddrs(host string, port, healthPort int) (addr, healthAddr string, err error) {
	for _, p := range []struct {
		flag string
		v    int
	}{{"--epp-port", port}, {"--epp-health-port", healthPort}} {
		if p.v < 0 || p.v > 65535 {
			return "", "", fmt.Errorf("%s must be a port (1-65535, or 0 for none), got %d", p.flag, p.v)
		}
	}
	if healthPort > 0 && port == 0 {
		return "", "", fmt.Errorf("--epp-health-port needs --epp-port: it is the endpoint picker's")
	}
	if port > 0 {
		addr = net.JoinHostPort(host, strconv.Itoa(port))
	}
	if healthPort > 0 {
		healthAddr = net.JoinHostPort(host, strconv.Itoa(healthPort))
	}
	return addr, healthAddr, nil
}

// wantsPlane tells whether serve needs NATS: for engines to join through
// discovery when none is given, or because a NATS or plane flag (or its
// variable) was set. Static engines alone, or Kubernetes discovery
// (dynamic), need no embedded server that nothing would connect to, holding
// port 4222 and a JetStream directory.
func wantsPlane(fs *pflag.FlagSet, natsURL string, workers []serve.WorkerSpec, dynamic bool) bool {
	if (len(workers) == 0 && !dynamic) || natsURL != "" {
		return true
	}
	planeOnly := pflag.NewFlagSet("plane", pflag.ContinueOnError)
	new(planeFlags).register(planeOnly, true, 0)
	changed := false
	planeOnly.VisitAll(func(fl *pflag.Flag) {
		changed = changed || (fl.Name != "nats-url" && fs.Changed(fl.Name))
	})
	return changed
}

// loadWorkers reads the config file, then the --worker specs; ids default
// to the position in that order.
func loadWorkers(path string, specs []string) ([]serve.WorkerSpec, error) {
	var workers []serve.WorkerSpec
	if path != "" {
		b, err := os.ReadFile(path)
		if err != nil {
			return nil, err
		}
		var file struct {
			Workers []serve.WorkerSpec `json:"workers"`
		}
		dec := json.NewDecoder(strings.NewReader(string(b)))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&file); err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		workers = file.Workers
	}
	for _, spec := range specs {
		w, err := parseWorker(spec)
		if err != nil {
			return nil, err
		}
		workers = append(workers, w)
	}
	for i := range workers {
		if workers[i].ID == 0 {
			workers[i].ID = uint64(i + 1)
		}
		if err := workers[i].CheckAddresses(); err != nil {
			return nil, fmt.Errorf("worker %d: %w", i+1, err)
		}
	}
	return workers, nil
}

func parseWorker(spec string) (serve.WorkerSpec, error) {
	var w serve.WorkerSpec
	for _, kv := range strings.Split(spec, ",") {
		k, v, ok := strings.Cut(kv, "=")
		if !ok {
			return w, fmt.Errorf("--worker %q: %q is not key=value", spec, kv)
		}
		var err error
		switch k {
		case "url":
			w.URL = v
		case "events":
			w.Events = v
		case "replay":
			w.Replay = v
		case "dump":
			w.Dump = v
		case "model":
			w.Model = v
		case "name":
			w.Name = v
		case "id":
			w.ID, err = strconv.ParseUint(v, 10, 64)
		case "dp":
			w.DPSize, err = strconv.Atoi(v)
		case "kv-blocks":
			w.KVBlocks, err = strconv.Atoi(v)
		case "max-batched-tokens":
			w.MaxBatchedTokens, err = strconv.Atoi(v)
		case "role":
			w.Role = v
			_, err = router.ParseRole(v)
		case "tokenizer":
			w.Tokenizer = v
		case "device":
			w.Device = v
			_, err = router.ParseDevice(v)
		default:
			return w, fmt.Errorf("--worker %q: unknown key %q", spec, k)
		}
		if err != nil {
			return w, fmt.Errorf("--worker %q: %s: %w", spec, k, err)
		}
	}
	return w, nil
}

func printWorkers(out io.Writer, workers []serve.WorkerSpec) {
	tw := tabwriter.NewWriter(out, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tNAME\tMODEL\tROLE\tDP\tHTTP\tKV EVENTS\tREPLAY")
	for _, w := range workers {
		role, _ := router.ParseRole(w.Role)
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%d\t%s\t%s\t%s\n", w.ID, w.Name, w.Model, role, max(w.DPSize, 1), w.URL, w.Events, w.Replay)
	}
	tw.Flush()
}
