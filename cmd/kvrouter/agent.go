package main

import (
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"
	"github.com/zeebo/xxh3"

	"github.com/kvrouter/kvrouter/adapters/natsplane"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/internal/agent"
)

func newAgentCmd() *cobra.Command {
	var (
		pf       planeFlags
		inst     natsplane.Instance
		events   string
		replay   string
		interval = agent.DefaultReportInterval
		zmqMax   int64
		localIx  bool
	)
	cmd := &cobra.Command{
		Use:   "agent",
		Short: "Sidecar that puts one engine (vLLM, SGLang, mocker) on the NATS plane",
		Long: `Runs next to one engine: registers it in discovery under a lease kept alive
by heartbeats, follows its ZMQ KV events (with replay) and republishes them on
the NATS event plane, numbered per dp rank and recoverable by routers, and
publishes the load the engine reports on /metrics. Routers started with the
same --nats-url and --namespace route to the engine as long as the agent runs.

  kvrouter agent --engine-url http://10.0.0.5:8000 --events tcp://10.0.0.5:5557 \
    --replay tcp://10.0.0.5:5558 --model llama --nats-url nats://10.0.0.1:4222

A NATS that requires credentials gets them with --nats-token, --nats-user and
--nats-password, --nats-nkey-seed or --nats-creds, and TLS with --nats-tls-ca
(docs/scale-out.md, "Securing the plane").`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := applyEnv(cmd.Flags()); err != nil {
				return err
			}
			if err := checkLocalIndexer(localIx); err != nil {
				return err
			}
			log := slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), nil))
			if inst.URL == "" {
				return fmt.Errorf("--engine-url is required")
			}
			if pf.natsURL == "" {
				return fmt.Errorf("--nats-url (or NATS_SERVER) is required: the agent joins the routers' NATS")
			}
			if _, err := router.ParseDevice(inst.Device); err != nil {
				return fmt.Errorf("--device: %w", err)
			}
			if inst.Name == "" {
				inst.Name = inst.URL
			}
			if inst.WorkerID == 0 {
				// Stable across restarts of the same engine.
				inst.WorkerID = max(1, xxh3.HashString(inst.Name)>>1)
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			nc, _, closeNATS, err := pf.connect(cmd.Flags(), "kvrouter-agent "+inst.Name, log)
			if err != nil {
				return err
			}
			defer closeNATS()
			a, err := agent.Start(ctx, nc, agent.Config{
				Names: pf.names(), Instance: inst, Events: events, Replay: replay,
				LeaseTTL: pf.leaseTTL, ReportInterval: interval, Logger: log, ZMQMaxMessageBytes: zmqMax,
			})
			if err != nil {
				return stoppedDuringStart(ctx, err)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "kvrouter agent: engine %s (worker id %d, %d rank(s)) registered on %s\n", inst.Name, inst.WorkerID, inst.DPSize, natsplane.RedactURL(nc.ConnectedUrl()))
			<-ctx.Done()
			a.Close()
			return nil
		},
	}
	fs := cmd.Flags()
	pf.register(fs, false, 0)
	fs.StringVar(&inst.URL, "engine-url", "", "the engine's OpenAI HTTP base URL (also where /metrics is read)")
	fs.StringVar(&events, "events", "", "the engine's KV-event ZMQ PUB endpoint of rank 0 (rank r: port + r)")
	fs.StringVar(&replay, "replay", "", "the engine's KV-event replay endpoint of rank 0, if any")
	fs.StringVar(&inst.Name, "name", "", "the engine's name (default: its URL)")
	fs.Uint64Var(&inst.WorkerID, "worker-id", 0, "the engine's worker id (default: a hash of its name)")
	fs.StringVar(&inst.Model, "model", "", "the model the engine serves")
	fs.IntVar(&inst.BlockSize, "block-size", 16, "the engine's KV block size in tokens, announced to routers until its KV events say otherwise")
	fs.IntVar(&inst.DPSize, "data-parallel-size", 1, "the engine's data-parallel ranks")
	fs.StringVar(&inst.Role, "role", "both", "both, prefill or decode")
	fs.StringVar(&inst.Device, "device", "", "what the engine computes on: cpu, or an accelerator such as cuda (the default), for routers in --router-mode device-aware-weighted")
	fs.StringVar(&inst.Tokenizer, "tokenizer", "", "the model's Hugging Face tokenizer, announced to routers, which resolve it on their machine and tokenize the model's prompts in process: a model id (org/name) in their local Hugging Face cache or a path valid there; one they cannot load leaves the model to the engine's /tokenize")
	registerModelPath(fs)
	fs.IntVar(&inst.TotalKVBlocks, "num-gpu-blocks", 0, "the engine's KV blocks per rank (for busy detection; 0: unknown)")
	fs.IntVar(&inst.MaxNumBatchedTokens, "max-num-batched-tokens", 0, "the engine's token budget per step (for the queue; 0: unknown)")
	fs.DurationVar(&interval, "report-interval", interval, "how often load and last event ids are published")
	registerZMQMaxMessageBytes(fs, &zmqMax)
	registerLocalIndexer(fs, &localIx)
	return cmd
}
