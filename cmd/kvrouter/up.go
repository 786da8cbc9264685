package main

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"strconv"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/kvrouter/kvrouter/adapters/modeltok"
	"github.com/kvrouter/kvrouter/internal/serve"
	"github.com/kvrouter/kvrouter/mocker/fleet"
	"github.com/kvrouter/kvrouter/mocker/tokenizer"
)

// pdFleet lays out a disaggregated fleet of prefill then decode engines
// when --prefill-workers and --decode-workers ask for one.
func pdFleet(cfg *fleet.Config, prefill, decode int, workersSet bool) error {
	switch {
	case prefill == 0 && decode == 0:
		return nil
	case prefill < 1 || decode < 1:
		return fmt.Errorf("--prefill-workers %d and --decode-workers %d: a disaggregated fleet needs at least one of each", prefill, decode)
	case workersSet:
		return fmt.Errorf("--workers and --prefill-workers/--decode-workers both size the fleet: give one or the other")
	}
	cfg.NumWorkers, cfg.Roles = prefill+decode, fleet.DisaggregatedRoles(prefill, decode)
	return nil
}

func newUpCmd() *cobra.Command {
	var migrationLimit int
	var (
		rf   = newRouterFlags()
		lf   limitFlags
		pf   planeFlags
		hf   httpFlags
		hard hardeningFlags
		mock = fleet.DefaultConfig()
		df   disaggFlags
		lora loraFlags

		prefillWorkers, decodeWorkers int
		host                          string
		port                          int
		verbose                       bool
	)
	cmd := &cobra.Command{
		Use:   "up",
		Short: "Run everything on this machine: simulated engines and the router's OpenAI frontend",
		Long: `Starts --workers simulated vLLM engines (kvrouter mocker: OpenAI API, vLLM
metrics, KV events on ZMQ with replay, all on free ports of 127.0.0.1), an
embedded NATS server (or --nats-url), one agent per engine that registers it
and carries its KV events and load over NATS, and the router's
OpenAI-compatible frontend on --http-port, routing in kv mode on those
events. Send requests to the frontend as to any OpenAI server; Ctrl-C stops
everything. It takes serve's router and NATS flags (e.g. --router-mode,
--router-temperature, --router-durable-kv-events) and the mocker's engine
flags.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := applyEnv(cmd.Flags()); err != nil {
				return err
			}
			if migrationLimit < 0 {
				return fmt.Errorf("--migration-limit must be at least 0, got %d", migrationLimit)
			}
			level := slog.LevelWarn
			if verbose {
				level = slog.LevelInfo
			}
			log := slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), &slog.HandlerOptions{Level: level}))
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
			if err := fleetCount(cmd.Flags(), "workers", mock.Specs, &mock.NumWorkers); err != nil {
				return err
			}
			if err := pdFleet(&mock, prefillWorkers, decodeWorkers, cmd.Flags().Changed("workers") || len(mock.Specs) > 0); err != nil {
				return err
			}
			loraCfg, loraPoll, err := lora.config()
			if err != nil {
				return err
			}
			if !lora.dynamic {
				// Without dynamic loading the adapters are the engines'
				// own, loaded at start as vLLM's --lora-modules does;
				// with it the router places each on first use.
				if mock.Server.LoRAModules, err = mockerLoRAModules(lora.modules); err != nil {
					return err
				}
			}
			// Engines and router tokenize with the same files, so the router
			// hashes the ids the engines cache.
			var tokenizers map[string]*modeltok.Model
			// The engines' own tokenizer writes media as its placeholders.
			placeholders := map[string]uint32{"image": tokenizer.Image, "audio": tokenizer.Audio}
			if mock.Tokenizer != "" {
				m, err := modeltok.Load(mock.Tokenizer)
				if err != nil {
					return err
				}
				tokenizers = map[string]*modeltok.Model{mock.Server.Model: m}
				placeholders = nil
			}
			// The router and the engines it starts share one block size,
			// given by either name, or by the engine's own group.
			if err := adoptOwnBlockSize(cmd.Flags(), &mock.Engine, "block-size", "kv-cache-block-size"); err != nil {
				return err
			}
			if fs := cmd.Flags(); fs.Changed("kv-cache-block-size") {
				if fs.Changed("block-size") && rcfg.BlockSize != mock.Engine.BlockSize {
					return fmt.Errorf("--kv-cache-block-size %d and --block-size %d differ: up's engines and router use one block size", rcfg.BlockSize, mock.Engine.BlockSize)
				}
				mock.Engine.BlockSize = rcfg.BlockSize
			}
			rcfg.BlockSize = mock.Engine.BlockSize
			shutdownTimeout, err := hf.timeout()
			if err != nil {
				return err
			}
			generatedAdmin := hf.adminTokenBeyondLoopback(host)
			signalled, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			// Engines, agents and frontend run on a context the signal
			// does not end, so that requests in flight can drain; they
			// stop in reverse order once the frontend has drained.
			ctx := cmd.Context()

			mock.Host, mock.HTTPPort, mock.KVEventsPort, mock.KVEventsReplayPort = "127.0.0.1", 0, 0, 0
			mock.Logger = log
			engines, err := fleet.Start(ctx, mock)
			if err != nil {
				return err
			}
			defer engines.Close()
			nc, natsURL, closeNATS, err := pf.connect(cmd.Flags(), "kvrouter-up", log)
			if err != nil {
				return err
			}
			defer closeNATS()
			workers := serve.FleetWorkers(engines, mock)
			stopAgents, err := startAgents(ctx, nc, &pf, workers, mock.Engine.BlockSize, mock.ZMQMaxMessageBytes, hard.silenceProbeConfig(), log)
			if err != nil {
				return stoppedDuringStart(ctx, err)
			}
			defer stopAgents()
			headerTimeout, responseTimeout := hard.engineTimeouts()
			s, err := serve.Start(ctx, serve.Config{Router: rcfg, Plane: pf.plane(nc), Addr: net.JoinHostPort(host, strconv.Itoa(port)), Logger: log, Access: hf.access, MigrationLimit: migrationLimit, MaxBookings: hard.maxBookings, StrictNvext: hard.strictNvext, DynamoMetricNames: hard.dynamoMetrics, EngineHeaderTimeout: headerTimeout, EngineResponseTimeout: responseTimeout, Outlier: hard.outlierConfig(), HTTP: lf.httpLimits(), Disagg: disagg, MinInitialWorkers: lf.minInitialWorkers, Tokenizers: tokenizers, MMPlaceholders: placeholders, LoRA: loraCfg, LoRAPollInterval: loraPoll})
			if err != nil {
				return err
			}
			defer s.Close()
			ready, cancel := context.WithTimeout(signalled, 10*time.Second)
			defer cancel()
			if err := s.WaitWorkers(ready, func(live int) bool { return live >= len(workers) }); err != nil {
				return stoppedDuringStart(ctx, fmt.Errorf("engines did not join routing: %w", err))
			}
			out := cmd.OutOrStdout()
			layout := fmt.Sprintf("%d simulated engine(s)", mock.NumWorkers)
			if prefillWorkers > 0 {
				layout = fmt.Sprintf("%d prefill + %d decode simulated engines (disaggregated)", prefillWorkers, decodeWorkers)
			}
			fmt.Fprintf(out, "kvrouter up: %s × %d rank(s), model %q, speedup %g; router in %s mode\n\n",
				layout, mock.DataParallelSize, mock.Server.Model, mock.SpeedupRatio, rcfg.Mode)
			printWorkers(out, workers)
			fmt.Fprintf(out, "\nNATS: %s (namespace %q)\n", natsURL, pf.namespace)
			url := s.URL()
			fmt.Fprintf(out, "\nDashboard: %s/ui\n", url)
			if generatedAdmin {
				fmt.Fprintf(out, "\nThe frontend listens beyond loopback, so changing the router's state (drain, thresholds, bookings) needs this admin token,\n"+
					"shown only now (type it in the dashboard's token field, or send \"Authorization: Bearer <token>\"; --admin-token sets your own):\n\n  %s\n", hf.access.AdminToken)
			}
			fmt.Fprintf(out, "\nSend OpenAI requests to %s (metrics: %s/metrics). For example:\n\n", url, url)
			auth := ""
			if hf.access.APIKey != "" {
				auth = "-H \"Authorization: Bearer $API_KEY\" "
			}
			fmt.Fprintf(out, "  curl %s/v1/chat/completions %s-H 'Content-Type: application/json' \\\n    -d '{\"model\": %q, \"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}], \"max_tokens\": 16, \"nvext\": {\"extra_fields\": [\"worker_id\"]}}'\n\n", url, auth, mock.Server.Model)
			fmt.Fprintln(out, "Ctrl-C stops everything.")
			<-signalled.Done()
			stop() // a second Ctrl-C ends the process at once
			fmt.Fprintln(out, "stopping")
			// Deregistered first, the engines get no new work from any
			// router on the plane while they finish what they have.
			stopAgents()
			return s.Shutdown(shutdownTimeout)
		},
	}
	fs := cmd.Flags()
	fs.IntVar(&migrationLimit, "migration-limit", 0, "how many times a stream broken off by its engine may continue on another engine (0: it ends with an error event)")
	rf.register(fs)
	lf.register(fs)
	hard.register(fs)
	pf.register(fs, true, 0)
	hf.register(fs)
	fs.StringVar(&host, "http-host", "127.0.0.1", "address the frontend listens on")
	fs.IntVar(&port, "http-port", 8000, "port the frontend listens on")
	fs.IntVar(&mock.NumWorkers, "workers", 4, "simulated engines")
	registerFleetFlag(fs, &mock.Specs)
	fs.IntVar(&prefillWorkers, "prefill-workers", 0, "disaggregated fleet: this many prefill engines (with --decode-workers; replaces --workers)")
	fs.IntVar(&decodeWorkers, "decode-workers", 0, "disaggregated fleet: this many decode engines (with --prefill-workers)")
	fs.Float64Var(&mock.Server.KVTransfer.Bandwidth, "kv-transfer-bandwidth", mock.Server.KVTransfer.Bandwidth, "disaggregated fleet: bytes per second of the link decode engines pull KV over")
	fs.IntVar(&mock.Server.KVTransfer.BytesPerToken, "kv-bytes-per-token", mock.Server.KVTransfer.BytesPerToken, "disaggregated fleet: KV bytes of one token over all layers, sizing a transfer")
	df.register(fs)
	lora.register(fs)
	fs.IntVar(&mock.DataParallelSize, "data-parallel-size", mock.DataParallelSize, "data-parallel ranks per engine")
	fs.Float64Var(&mock.SpeedupRatio, "speedup-ratio", mock.SpeedupRatio, "divide the engines' simulated step times by this")
	fs.IntVar(&mock.Engine.BlockSize, "block-size", mock.Engine.BlockSize, "tokens per KV block (engines and router)")
	registerKVCacheGroups(fs, &mock.Engine)
	registerHostTier(fs, &mock.Engine)
	fs.IntVar(&mock.Engine.NumGPUBlocks, "num-gpu-blocks", mock.Engine.NumGPUBlocks, "KV blocks per engine rank")
	fs.IntVar(&mock.Engine.MaxNumSeqs, "max-num-seqs", mock.Engine.MaxNumSeqs, "most requests running at once per rank")
	fs.IntVar(&mock.Engine.MaxNumBatchedTokens, "max-num-batched-tokens", mock.Engine.MaxNumBatchedTokens, "token budget of one scheduler step")
	fs.StringVar(&mock.Server.Model, "model-name", mock.Server.Model, "model the engines serve")
	fs.StringVar(&mock.Tokenizer, "tokenizer", "", "a Hugging Face tokenizer ("+tokenizerRef+") for the engines and the router alike: prompts are tokenized in process with a real vocabulary and chat template")
	registerModelPath(fs)
	fs.BoolVar(&verbose, "verbose", false, "log engines joining and leaving")
	registerZMQMaxMessageBytes(fs, &mock.ZMQMaxMessageBytes)
	registerDynamoAliases(fs)
	return cmd
}
