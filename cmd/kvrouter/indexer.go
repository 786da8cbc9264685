package main

import (
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/kvrouter/kvrouter/adapters/indexerapi"
	"github.com/kvrouter/kvrouter/internal/indexer"
)

// indexerFlags are kvrouter indexer's flags.
type indexerFlags struct {
	host, model, group string
	port, blockSize    int
	threads            int
	workers, peers     string
	zmqMax             int64
	silenceProbe       time.Duration
}

func (f *indexerFlags) register(fs *pflag.FlagSet) {
	fs.StringVar(&f.host, "host", "0.0.0.0", "address to listen on")
	fs.IntVar(&f.port, "port", 8090, "port to listen on")
	fs.IntVar(&f.threads, "threads", 0, "write parallelism of each index (--router-event-threads; 0: the default, 4)")
	fs.StringVar(&f.workers, "workers", "", `engines to register at start: "instance_id[:dp_rank]=tcp://host:port,..." (needs --block-size)`)
	fs.IntVar(&f.blockSize, "block-size", 0, "KV block size of the --workers engines, in tokens")
	fs.StringVar(&f.model, "model-name", "default", "model of the --workers engines")
	fs.StringVar(&f.group, "routing-group", indexerapi.DefaultRoutingGroup, "routing group of the --workers engines")
	fs.StringVar(&f.peers, "peers", "", "comma-separated indexer URLs to recover from at start (the first that answers)")
	registerZMQMaxMessageBytes(fs, &f.zmqMax)
	registerSilenceProbe(fs, &f.silenceProbe)
}

// config checks the flags and makes the service's config (without its
// logger).
func (f *indexerFlags) config() (indexer.Config, error) {
	if f.port < 0 || f.port > 65535 {
		return indexer.Config{}, fmt.Errorf("--port must be a port (0-65535), got %d", f.port)
	}
	if err := checkSilenceProbe(f.silenceProbe); err != nil {
		return indexer.Config{}, err
	}
	regs, err := parseIndexerWorkers(f.workers, f.model, f.group, f.blockSize)
	if err != nil {
		return indexer.Config{}, err
	}
	var peerList []string
	for _, p := range strings.Split(f.peers, ",") {
		if p = strings.TrimSpace(p); p != "" {
			peerList = append(peerList, p)
		}
	}
	return indexer.Config{
		Addr: net.JoinHostPort(f.host, strconv.Itoa(f.port)), Peers: peerList, Workers: regs,
		EventThreads: f.threads, ZMQMaxMessageBytes: f.zmqMax, SilenceProbe: silenceProbeConfig(f.silenceProbe),
	}, nil
}

func newIndexerCmd() *cobra.Command {
	var f indexerFlags
	cmd := &cobra.Command{
		Use:   "indexer",
		Short: "Standalone KV indexer: engines' KV events in, overlap queries out, over HTTP",
		Long: `Runs the KV indexer alone, as Dynamo's standalone indexer (python -m
dynamo.indexer) does: engines are registered with their ZMQ KV-event
endpoints (POST /register, or --workers), subscribed to as "kvrouter serve"
subscribes to them (catch-up, gap replay from replay_endpoint, resets), one
index per model and routing group, and clients ask which instance caches
how much of a prompt: POST /query (token ids) or /query_by_hash (block
hashes). Also GET /workers, /dump, /peers, /health, /metrics and POST
/unregister, /register_peer, /deregister_peer; JSON or MessagePack bodies
(Content-Type application/msgpack). See docs/indexer.md.

With --peers, it first recovers the workers and the indexes of the first
peer that answers (its /workers and /dump), then follows the engines'
streams. "kvrouter serve --use-remote-indexer URL" routes by this index.

  kvrouter indexer --port 8090 --block-size 16 --model-name llama \
      --workers "1=tcp://10.0.0.5:5557,2:1=tcp://10.0.0.6:5558"`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := applyEnv(cmd.Flags()); err != nil {
				return err
			}
			cfg, err := f.config()
			if err != nil {
				return err
			}
			cfg.Logger = slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), nil))
			signalled, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			s, err := indexer.Start(cmd.Context(), cfg)
			if err != nil {
				return err
			}
			defer s.Close()
			fmt.Fprintf(cmd.OutOrStdout(), "kvrouter indexer serving on %s (%d workers registered)\n", s.URL(), len(cfg.Workers))
			<-signalled.Done()
			return nil
		},
	}
	f.register(cmd.Flags())
	return cmd
}

// parseIndexerWorkers reads --workers: instance_id[:dp_rank]=endpoint,...
func parseIndexerWorkers(spec, model, group string, blockSize int) ([]indexerapi.Registration, error) {
	if strings.TrimSpace(spec) == "" {
		return nil, nil
	}
	if blockSize <= 0 {
		return nil, fmt.Errorf("--workers needs --block-size (the engines' KV block size in tokens)")
	}
	var out []indexerapi.Registration
	for _, item := range strings.Split(spec, ",") {
		id, ep, ok := strings.Cut(strings.TrimSpace(item), "=")
		if !ok || ep == "" {
			return nil, fmt.Errorf("--workers: %q is not instance_id[:dp_rank]=tcp://host:port", item)
		}
		idStr, rankStr, hasRank := strings.Cut(id, ":")
		reg := indexerapi.Registration{Endpoint: ep, Key: indexerapi.GroupKey{Model: model, Group: group}, BlockSize: blockSize}
		var err error
		if reg.InstanceID, err = strconv.ParseUint(idStr, 10, 64); err != nil {
			return nil, fmt.Errorf("--workers: %q: the instance id must be a number", item)
		}
		if hasRank {
			r, err := strconv.ParseUint(rankStr, 10, 32)
			if err != nil {
				return nil, fmt.Errorf("--workers: %q: the dp rank must be a number", item)
			}
			reg.DPRank = uint32(r)
		}
		out = append(out, reg)
	}
	return out, nil
}
