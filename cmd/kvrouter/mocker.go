package main

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/zeebo/xxh3"

	"github.com/kvrouter/kvrouter/adapters/vllmevents"
	"github.com/kvrouter/kvrouter/adapters/zmqevents"
	"github.com/kvrouter/kvrouter/internal/serve"
	"github.com/kvrouter/kvrouter/mocker/fleet"
	"github.com/kvrouter/kvrouter/mocker/server"
)

func newMockerCmd() *cobra.Command {
	cfg := fleet.DefaultConfig()
	encoding := "array"
	role := string(server.RoleBoth)
	var pf planeFlags
	var serveConfig string
	var loraModules []string
	var localIx bool
	cmd := &cobra.Command{
		Use:   "mocker",
		Short: "Run simulated vLLM engines: OpenAI HTTP API, vLLM metrics, KV events on ZMQ",
		Long: `Starts --num-workers simulated engines in one process. From outside each is a
vLLM server with KV events enabled: the OpenAI API (/v1/completions,
/v1/chat/completions, /v1/models, /tokenize, /health, /metrics with vLLM's
metric names) on --http-port + i, and for every data-parallel rank r a ZMQ PUB
socket of KV events (vLLM's msgpack batches, one per scheduler step) on
--kv-events-port + i × dp + r with a replay ROUTER socket on
--kv-events-replay-port + i × dp + r keeping the last --kv-events-buffer-steps
batches. Port 0 picks free ports. Beyond vLLM, GET /kv_events/dump?dp_rank=r
answers a rank's whole cache as one batch of single-block BlockStored events,
with the sequence number of the first batch it does not include in the
X-Kv-Events-Next-Seq header: give it to "kvrouter serve" as a worker's dump=
and a router that cannot replay the events it missed reloads the cache
instead.

Inside, each rank runs a vLLM-like scheduler (waiting/running queues, chunked
prefill, preemption) over a KV block manager with prefix caching, and times
each step with a model of an H100 (prefill: quadratic in new tokens; decode:
in KV usage), divided by --speedup-ratio. Generated tokens are deterministic;
their text comes from the mocker's own tokenizer (see mocker/tokenizer).

With --tokenizer the engines tokenize with a model's Hugging Face tokenizer
instead, as vLLM serving that model does: completion prompts with its special
tokens (add_special_tokens, default true), chat requests through the chat
template of the tokenizer_config.json beside tokenizer.json
(add_generation_prompt, tools and chat_template_kwargs honoured) without
them, and /tokenize alike, so the KV blocks hash the ids a router tokenizing
with the same files computes. Generated tokens are then ordinary tokens of
that vocabulary, each valid UTF-8 on its own.

With --nats-url (or NATS_SERVER) every engine also joins a kvrouter NATS
plane, as if a "kvrouter agent" ran next to it: routers started with
"kvrouter serve --nats-url ..." discover the engines and follow their events.

Disaggregated prefill/decode: engines speak vLLM's NixlConnector protocol
(kv_transfer_params in requests and responses), --role saying which half
they play (prefill, decode, or both as vLLM's kv_both); GET /role tells a
client. An engine given "kv_transfer_params": {"do_remote_decode": true}
answers the parameters a decode engine needs and holds the prompt's full
blocks until a decode engine pulls them or --kv-transfer-timeout passes. An
engine given those parameters pulls the blocks it does not cache from the
prefill engine (POST /kv_transfer/pull on the prefill's HTTP port), waits
blocks × block size × --kv-bytes-per-token ÷ --kv-transfer-bandwidth
(÷ --speedup-ratio), and decodes without prefilling them; if the pull fails
it prefills them itself. A request without the parameters is served whole,
as before, whatever the role.

LoRA adapters: --lora-modules name=path (repeatable) loads adapters at start,
as vLLM's flag does; GET /v1/models lists each with the base model as its
parent, and POST /v1/load_lora_adapter {"lora_name", "lora_path"} and POST
/v1/unload_lora_adapter {"lora_name"} answer as vLLM's (which serves them
only with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; the mocker always does). A
request whose model is a loaded adapter runs with its blocks keyed by the
adapter's name (their KV events carry it as lora_name); one naming an
adapter not loaded gets vLLM's 404.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := applyEnv(cmd.Flags()); err != nil {
				return err
			}
			if err := checkLocalIndexer(localIx); err != nil {
				return err
			}
			mods, err := mockerLoRAModules(loraModules)
			if err != nil {
				return err
			}
			cfg.Server.LoRAModules = mods
			switch encoding {
			case "array":
				cfg.Encoding = vllmevents.EncodingArray
			case "map":
				cfg.Encoding = vllmevents.EncodingMap
			case "map-batch":
				cfg.Encoding = vllmevents.EncodingMapBatch
			default:
				return fmt.Errorf("--kv-events-encoding must be array, map or map-batch, got %q", encoding)
			}
			if err := adoptOwnBlockSize(cmd.Flags(), &cfg.Engine, "block-size"); err != nil {
				return err
			}
			if err := fleetCount(cmd.Flags(), "num-workers", cfg.Specs, &cfg.NumWorkers); err != nil {
				return err
			}
			roles := strings.Split(role, ",")
			switch {
			case len(roles) == 1:
				cfg.Server.Role = server.Role(strings.TrimSpace(roles[0]))
			case len(roles) == cfg.NumWorkers:
				for _, r := range roles {
					cfg.Roles = append(cfg.Roles, server.Role(strings.TrimSpace(r)))
				}
			default:
				return fmt.Errorf("--role: %d roles for %d engines: give one for all, or one per engine", len(roles), cfg.NumWorkers)
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			log := slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), &slog.HandlerOptions{Level: slog.LevelWarn}))
			cfg.Logger = log
			f, err := fleet.Start(ctx, cfg)
			if err != nil {
				return err
			}
			if serveConfig != "" {
				if err := writeServeConfig(serveConfig, serve.FleetWorkers(f, cfg)); err != nil {
					f.Close()
					return err
				}
			}
			out := cmd.OutOrStdout()
			fmt.Fprintf(out, "kvrouter mocker: %d engine(s) × %d rank(s), model %q, speedup %g, %d blocks of %d tokens each\n\n",
				cfg.NumWorkers, cfg.DataParallelSize, cfg.Server.Model, cfg.SpeedupRatio, cfg.Engine.NumGPUBlocks, cfg.Engine.BlockSize)
			if len(cfg.Engine.KVCacheGroups) > 0 {
				fmt.Fprintf(out, "a hybrid model: KV-cache groups %s, by group_idx\n\n", kvCacheGroupsFlag{&cfg.Engine.KVCacheGroups})
			}
			if len(cfg.Specs) > 0 {
				fmt.Fprintf(out, "unequal engines: --fleet %s (COUNTxSPEED[:KV][:cpu])\n\n", fleet.SpecsString(cfg.Specs))
			}
			f.PrintTable(out)
			if pf.natsURL != "" {
				log := slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), &slog.HandlerOptions{Level: slog.LevelWarn}))
				nc, url, closeNATS, err := pf.connect(cmd.Flags(), "kvrouter-mocker", log)
				if err != nil {
					f.Close()
					return err
				}
				defer closeNATS()
				workers := serve.FleetWorkers(f, cfg)
				for i := range workers {
					// Unique across mocker processes sharing one NATS.
					workers[i].ID = max(1, xxh3.HashString(workers[i].URL)>>1)
				}
				stopAgents, err := startAgents(ctx, nc, &pf, workers, cfg.Engine.BlockSize, cfg.ZMQMaxMessageBytes, 0, log)
				if err != nil {
					f.Close()
					return err
				}
				defer stopAgents()
				fmt.Fprintf(out, "\nengines registered on NATS %s, namespace %q\n", url, pf.namespace)
			}
			fmt.Fprintf(out, "\ntry: curl %s/v1/completions -H 'Content-Type: application/json' -d '{\"prompt\": \"Hello\", \"max_tokens\": 8}'\n", f.Engines()[0].HTTPURL)
			<-ctx.Done()
			f.Close()
			tm := f.Timing()
			fmt.Fprintf(out, "\nstopped after %d steps; simulated step time %v, wall %v (drift %+.2f%%, %d lag resets)\n",
				tm.Steps, tm.Model.Round(time.Millisecond), tm.Actual.Round(time.Millisecond), 100*tm.Drift(), tm.LagResets)
			return f.PublishErr()
		},
	}
	fl := cmd.Flags()
	fl.IntVar(&cfg.NumWorkers, "num-workers", cfg.NumWorkers, "simulated engines in this process")
	fl.IntVar(&cfg.DataParallelSize, "data-parallel-size", cfg.DataParallelSize, "data-parallel ranks per engine, each with its own KV cache and event socket")
	registerFleetFlag(fl, &cfg.Specs)
	fl.Float64Var(&cfg.SpeedupRatio, "speedup-ratio", cfg.SpeedupRatio, "divide every simulated step time by this")
	fl.IntVar(&cfg.Engine.BlockSize, "block-size", cfg.Engine.BlockSize, "tokens per KV block")
	fl.IntVar(&cfg.Engine.NumGPUBlocks, "num-gpu-blocks", cfg.Engine.NumGPUBlocks, "KV blocks per rank")
	fl.IntVar(&cfg.Engine.MaxNumSeqs, "max-num-seqs", cfg.Engine.MaxNumSeqs, "most requests running at once per rank")
	fl.IntVar(&cfg.Engine.MaxNumBatchedTokens, "max-num-batched-tokens", cfg.Engine.MaxNumBatchedTokens, "token budget of one scheduler step")
	fl.BoolVar(&cfg.Engine.EnablePrefixCaching, "enable-prefix-caching", cfg.Engine.EnablePrefixCaching, "reuse cached blocks (and publish KV events)")
	registerKVCacheGroups(fl, &cfg.Engine)
	registerHostTier(fl, &cfg.Engine)
	fl.StringVar(&cfg.Server.Model, "model-name", cfg.Server.Model, "model name served on /v1/models and checked in requests")
	fl.StringArrayVar(&loraModules, "lora-modules", nil, "LoRA adapters every engine loads at start, as vLLM's --lora-modules: name=path (repeatable); more are loaded at run time through POST /v1/load_lora_adapter")
	fl.StringVar(&cfg.Tokenizer, "tokenizer", "", "Hugging Face tokenizer ("+tokenizerRef+"; .gz files accepted) to tokenize prompts, apply the chat template and spell generated tokens with, instead of the mocker's own tokenizer; announced in discovery with --nats-url")
	registerModelPath(fl)
	fl.IntVar(&cfg.Server.MaxModelLen, "max-model-len", cfg.Server.MaxModelLen, "longest prompt + completion accepted, in tokens")
	fl.IntVar(&cfg.Server.MMTokensPerItem, "mm-tokens-per-item", cfg.Server.MMTokensPerItem, "placeholder tokens each image or audio item of a chat expands to, as a LLaVA-1.5-style model's fixed count; 0 refuses media")
	fl.StringVar(&cfg.Host, "host", cfg.Host, "address to bind")
	fl.IntVar(&cfg.HTTPPort, "http-port", cfg.HTTPPort, "HTTP port of engine 0 (engine i uses port + i; 0 picks free ports)")
	fl.IntVar(&cfg.KVEventsPort, "kv-events-port", cfg.KVEventsPort, "KV-event PUB port of engine 0 rank 0 (engine i rank r uses port + i × dp + r)")
	fl.IntVar(&cfg.KVEventsReplayPort, "kv-events-replay-port", cfg.KVEventsReplayPort, "replay ROUTER port of engine 0 rank 0, numbered like --kv-events-port")
	fl.BoolVar(&cfg.NoKVEvents, "no-kv-events", false, "publish no KV events, as vLLM started without --kv-events-config (the sockets are still bound)")
	fl.IntVar(&cfg.ReplayBufferSize, "kv-events-buffer-steps", zmqevents.DefaultBufferSize, "KV-event batches each rank keeps for replay (vLLM's buffer_steps)")
	pf.register(fl, false, 0)
	registerZMQMaxMessageBytes(fl, &cfg.ZMQMaxMessageBytes)
	registerLocalIndexer(fl, &localIx)
	fl.StringVar(&role, "role", role, "disaggregated serving: prefill (hold the prompt's KV for decode engines to pull), decode (pull it from the prefill engine kv_transfer_params name) or both (either, as vLLM's kv_both; without kv_transfer_params every role serves a request whole); one role for every engine, or a comma-separated one per engine")
	fl.Float64Var(&cfg.Server.KVTransfer.Bandwidth, "kv-transfer-bandwidth", cfg.Server.KVTransfer.Bandwidth, "bytes per second of the link decode engines pull KV over; the default is one 200 Gb/s RDMA NIC, NIXL's usual fabric")
	fl.IntVar(&cfg.Server.KVTransfer.BytesPerToken, "kv-bytes-per-token", cfg.Server.KVTransfer.BytesPerToken, "KV bytes of one token over all layers, sizing a transfer; the default is Llama-3.1-8B in bf16: 32 layers × 8 KV heads × 128 dims × 2 (K and V) × 2 bytes")
	fl.DurationVar(&cfg.Server.KVTransfer.Timeout, "kv-transfer-timeout", cfg.Server.KVTransfer.Timeout, "how long a prefill engine holds KV blocks no decode engine pulls before it frees them; the default is vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT")
	fl.StringVar(&serveConfig, "serve-config", "", `once the engines listen, write their endpoints to this file as a "kvrouter serve --config" file ({"workers": [...]}), so ports picked with 0 can be found`)
	fl.StringVar(&encoding, "kv-events-encoding", encoding, "KV event encoding: array (positional events), map (events as maps) or map-batch (vLLM ≥ 0.11: the batch as a map too)")
	return cmd
}

// writeServeConfig writes workers as serve's --config file. It appears
// whole or not at all (written beside, then renamed), so a process waiting
// for it never reads half of it.
func writeServeConfig(path string, workers []serve.WorkerSpec) error {
	b, err := json.MarshalIndent(struct {
		Workers []serve.WorkerSpec `json:"workers"`
	}{workers}, "", "  ")
	if err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("--serve-config: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("--serve-config: %w", err)
	}
	return nil
}
