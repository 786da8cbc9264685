package main

import (
	"encoding/json"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"github.com/spf13/cobra"

	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/internal/doctor"
)

func newDoctorCmd() *cobra.Command {
	var (
		specs      []string
		configPath string
		window     time.Duration
		probe      bool
		noEvents   bool
		blockSize  int
		asJSON     bool
		zmqMax     int64
	)
	cmd := &cobra.Command{
		Use:   "doctor",
		Short: "Check that engines are set up as serve needs them, and say what to fix",
		Long: `Connects to each engine as "kvrouter serve" would and reports, one line per
check (ok, warn, fail) with what to change:

  http        GET /health answers 200 (serve routes only to engines that do)
  models      GET /v1/models, and whether model= is among the models served
  tokenize    POST /tokenize (serve tokenizes text and chat prompts with it)
  probe       with --probe-request: one small completion, so that an idle
              engine stores new blocks and publishes their events
  events      KV-event batches arriving on each rank's endpoint during
              --duration (rank r publishes on the events port + r)
  replay      the replay endpoint answering, with how many batches it holds
  block_size  the block size the events carry, against --kv-cache-block-size,
              and token counts that fit it
  metrics     the vLLM load metrics kvrouter reads from /metrics
  dp_ranks    the data-parallel ranks the events and /metrics name, against dp=

Engines are given as for serve: --worker (repeatable) or --config. With
--no-router-kv-events, as for serve, the events are not checked. The
command exits non-zero when a check fails; --json prints the checks as JSON.
docs/engines.md has each engine's flags.`,
		Example: `  kvrouter doctor --probe-request \
    --worker url=http://10.0.0.5:8000,events=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558,model=llama`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := applyEnv(cmd.Flags()); err != nil {
				return err
			}
			if window <= 0 {
				return fmt.Errorf("--duration must be positive, got %v", window)
			}
			workers, err := loadWorkers(configPath, specs)
			if err != nil {
				return err
			}
			if len(workers) == 0 {
				return fmt.Errorf("no engine to check: give --worker or --config")
			}
			engines := make([]doctor.Engine, len(workers))
			for i, w := range workers {
				name := w.Name
				if name == "" {
					name = "worker-" + strconv.FormatUint(w.ID, 10)
				}
				engines[i] = doctor.Engine{Name: name, URL: w.URL, Events: w.Events, Replay: w.Replay, Model: w.Model, DPSize: w.DPSize}
			}
			report := doctor.Run(cmd.Context(), doctor.Config{
				Engines: engines, Window: window, Probe: probe, NoEvents: noEvents, BlockSize: blockSize, MaxMessageBytes: zmqMax,
				Logger: slog.New(slog.NewTextHandler(cmd.ErrOrStderr(), nil)),
			})
			if asJSON {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				err = enc.Encode(report)
			} else {
				err = report.WriteText(cmd.OutOrStdout())
			}
			if err != nil {
				return err
			}
			if n := report.Count(doctor.Fail); n > 0 {
				return fmt.Errorf("%d check(s) failed", n)
			}
			return nil
		},
	}
	fs := cmd.Flags()
	fs.StringArrayVar(&specs, "worker", nil, "an engine, as for serve: url=...,events=...,replay=...,dp=N,model=M (repeatable)")
	fs.StringVar(&configPath, "config", "", "JSON file with {\"workers\": [...]}, as for serve")
	fs.DurationVar(&window, "duration", doctor.DefaultWindow, "how long each rank's KV events are watched")
	fs.BoolVar(&probe, "probe-request", false, "send one small completion to each engine, so that an idle engine publishes KV events")
	fs.BoolVar(&noEvents, "no-router-kv-events", false, "the engines are routed without KV events (serve's approximate mode): do not check them")
	fs.IntVar(&blockSize, "kv-cache-block-size", router.DefaultConfig().BlockSize, "the router's tokens per KV block, which the events must carry")
	fs.BoolVar(&asJSON, "json", false, "print the checks as JSON")
	registerZMQMaxMessageBytes(fs, &zmqMax)
	return cmd
}
