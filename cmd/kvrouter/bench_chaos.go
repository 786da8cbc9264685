package main

import (
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/spf13/cobra"

	"github.com/kvrouter/kvrouter/lab/chaos"
)

func newBenchChaosCmd() *cobra.Command {
	var (
		cfg            = chaos.DefaultConfig()
		faults         string
		migrationLimit int
		routerArgs     []string
		out            string
		jsonOut        bool
		quiet          bool
	)
	cmd := &cobra.Command{
		Use:   "chaos",
		Short: "Run streaming traffic through the router while killing and restarting its parts, then check it recovered cleanly",
		Long: `Starts --engines simulated engines (in this process, each restartable on its
ports, their KV-event and replay sockets behind cuttable TCP proxies), the
router as a child process ("kvrouter serve", so that a crash is a real
SIGKILL and its RSS is its own) and --clients closed-loop streaming clients
with shared-prefix prompts. For --duration, faults are injected on a
schedule, one every --fault-every on average, cycling through --faults:

  engine-kill   an engine (and, on NATS, its agent) dies; restarted empty after --fault-pause
  event-cut     every KV-event and replay connection is cut, refused for --fault-pause
  router-kill   SIGKILL of the router, restarted after --fault-pause
  router-term   SIGTERM (the router drains), restarted after --fault-pause
  nats-restart  (--plane nats) the NATS server stops, restarted after --fault-pause

Each fault has a window, from its injection until the system has recovered
plus --grace; a client error is accounted for when it ends in the window of
a fault that can cause it (an event cut explains none). After the traffic
and --quiet-period without either, the router's active loads must be zero
and its index equal to the engines' caches (polled for up to --settle), and
its RSS flat over the second half. Any unexplained error or failed check
makes the command fail.

Writes DIR/report.md, DIR/results.json, DIR/chaos.png and DIR/router.log.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if out == "" {
				return fmt.Errorf("--out DIR is required")
			}
			cfg.Faults = nil
			for _, name := range strings.Split(faults, ",") {
				if name = strings.TrimSpace(name); name == "" {
					continue
				}
				k, err := chaos.ParseFaultKind(name)
				if err != nil {
					return err
				}
				cfg.Faults = append(cfg.Faults, k)
			}
			exe, err := os.Executable()
			if err != nil {
				return err
			}
			cfg.RouterBinary, cfg.WorkDir = exe, out
			cfg.RouterArgs = append([]string{fmt.Sprintf("--migration-limit=%d", migrationLimit)}, routerArgs...)
			if !quiet {
				cfg.Progress = cmd.ErrOrStderr()
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			res, err := chaos.Run(ctx, cfg)
			if err != nil {
				return err
			}
			res.Config.Command = "kvrouter " + strings.Join(os.Args[1:], " ")
			if err := chaos.WriteReport(out, res); err != nil {
				return err
			}
			if jsonOut {
				b, err := os.ReadFile(out + "/results.json")
				if err != nil {
					return err
				}
				cmd.OutOrStdout().Write(b)
			} else {
				fmt.Fprint(cmd.OutOrStdout(), chaos.Summary(res))
				fmt.Fprintf(cmd.OutOrStdout(), "\nreport: %s/report.md\n", out)
			}
			if !res.Pass {
				return fmt.Errorf("chaos: %s", strings.Join(res.Failures, "; "))
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.DurationVar(&cfg.Duration, "duration", cfg.Duration, "traffic and faults; the schedule scales with it")
	f.IntVar(&cfg.Clients, "clients", cfg.Clients, "closed-loop streaming clients")
	f.IntVar(&cfg.Engines, "engines", cfg.Engines, "simulated engines")
	f.StringVar(&cfg.Plane, "plane", cfg.Plane, "zmq: the router subscribes to the engines; nats: agents and an embedded NATS server")
	f.StringVar(&faults, "faults", "", "comma-separated faults to cycle through (default: all of the plane's)")
	f.DurationVar(&cfg.FaultEvery, "fault-every", cfg.FaultEvery, "mean time between faults")
	f.DurationVar(&cfg.Pause, "fault-pause", cfg.Pause, "how long a killed component stays down, or event connections stay cut")
	f.DurationVar(&cfg.Grace, "grace", cfg.Grace, "client errors are explained by a fault until this long after its recovery")
	f.DurationVar(&cfg.Quiet, "quiet-period", cfg.Quiet, "time without traffic or faults before the end checks")
	f.DurationVar(&cfg.Settle, "settle", cfg.Settle, "how long the end checks wait for loads and index to converge")
	f.Uint64Var(&cfg.Seed, "seed", cfg.Seed, "seed of the schedule and the prompts")
	f.IntVar(&migrationLimit, "migration-limit", 3, "the router's --migration-limit: broken streams continue on another engine")
	f.StringArrayVar(&routerArgs, "router-arg", nil, "extra flag for the router's serve command (repeatable), e.g. --router-arg=--router-mode=kv")
	f.Float64Var(&cfg.Fleet.SpeedupRatio, "speedup-ratio", cfg.Fleet.SpeedupRatio, "engines' speedup over their timing model")
	f.IntVar(&cfg.Fleet.Engine.NumGPUBlocks, "num-gpu-blocks", cfg.Fleet.Engine.NumGPUBlocks, "KV blocks per engine")
	f.IntVar(&cfg.Fleet.ReplayBufferSize, "kv-events-buffer-steps", cfg.Fleet.ReplayBufferSize, "event batches each engine keeps for replay (0: the mocker's default); a small ring makes a restarted router lose the engines' history, so that it rebuilds their index from traffic")
	f.IntVar(&cfg.Workload.Groups, "groups", cfg.Workload.Groups, "distinct system prompts")
	f.IntVar(&cfg.Workload.SystemTokens, "system-tokens", cfg.Workload.SystemTokens, "tokens per system prompt")
	f.IntVar(&cfg.Workload.QuestionTokens, "question-tokens", cfg.Workload.QuestionTokens, "new tokens per prompt")
	f.IntVar(&cfg.Workload.OutputTokens, "output-tokens", cfg.Workload.OutputTokens, "tokens generated per request")
	f.StringVar(&out, "out", "", "directory for report.md, results.json, chaos.png and router.log")
	f.BoolVar(&jsonOut, "json", false, "print results.json instead of the tables")
	f.BoolVar(&quiet, "quiet", false, "no progress on stderr")
	return cmd
}
