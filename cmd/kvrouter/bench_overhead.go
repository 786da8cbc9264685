package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/kvrouter/kvrouter/lab/bench"
)

func newBenchOverheadCmd() *cobra.Command {
	var (
		cfg                    = bench.DefaultOverheadConfig()
		asJSON                 bool
		quiet                  bool
		cpuProfile, memProfile string
		mutexProfile           string
		engines                = "process"
		engineProc             = bench.EngineProcess{Nice: 10}
		clients                = "in-process"
		clientProc             bench.ClientProcess
	)
	cmd := &cobra.Command{
		Use:   "overhead",
		Short: "Measure what the router's frontend adds to TTFT and how many requests/s it carries",
		Long: `Starts --workers simulated engines (a kvrouter mocker child process at a lower
CPU priority; --engines in-process runs them in this process) and the router's
frontend (kv mode, live KV events), then runs the same load twice: straight to the
engines (round-robin) and through the router. --concurrency clients each keep
one streaming completion of --isl unique prompt tokens and --osl output
tokens open; after --warmup, time to first token and end-to-end latency are
measured for --duration. Prompts never share a prefix, so the router's
choices cannot change the engines' work: the TTFT difference is the
frontend's overhead (parsing, hashing, routing, proxying the stream). A
second pair of phases measures requests/s of short non-streamed completions
(--short-isl tokens, one output token) with --short-concurrency clients.

--prompt text or chat (with --tokenizer PATH, a Hugging Face tokenizer the
engines tokenize with too) sends the same loads as text: a completion
prompt, or the same text as a chat user message, of about --isl (and
--short-isl) tokens, unique per request. The routed phases then run twice,
each on a fresh frontend: one tokenizing in process, one without a
tokenizer, asking an engine's /tokenize for every prompt. Each run's
kvrouter_frontend_tokenize_total must show only its own path, or the
command fails.

--clients process runs each phase's clients in a child process (at
--clients-nice) instead of as goroutines of this one, as a router's clients
run on machines of their own. Each routed phase also splits the time the
frontend held a request into reading the body, tokenizing, routing (and
find_matches within it) and the rest.

--epp runs the routed loads a third time through a gateway in front of
the engines that asks kvrouter's endpoint picker for each request's engine
over ext_proc (FULL_DUPLEX_STREAMED, every response chunk through the
picker), as a Gateway API Inference Extension gateway does, and reports
the picker's answer time as the gateway sees it.

--ui-page keeps a simulated dashboard open through the routed phases (a
client polling /ui/api/state every second, as the /ui page does), so that
a run with it against one without shows what feeding the page costs.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			progress := io.Discard
			if !quiet {
				progress = cmd.ErrOrStderr()
			}
			exe, err := os.Executable()
			if err != nil {
				return err
			}
			switch engines {
			case "in-process":
			case "process":
				if engineProc.Binary == "" {
					engineProc.Binary = exe
				}
				cfg.EngineProcess = &engineProc
			default:
				return fmt.Errorf("--engines must be process or in-process, got %q", engines)
			}
			switch clients {
			case "in-process":
			case "process":
				clientProc.Binary = exe
				cfg.ClientProcess = &clientProc
			default:
				return fmt.Errorf("--clients must be process or in-process, got %q", clients)
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt)
			defer stop()
			var profErr error
			if cpuProfile != "" || memProfile != "" || mutexProfile != "" {
				cfg.ProfileRouted = func() func() {
					if mutexProfile != "" {
						runtime.SetMutexProfileFraction(10)
					}
					stopCPU, err := startCPUProfile(cpuProfile)
					if err != nil {
						profErr = err
						return func() {}
					}
					return func() {
						stopCPU()
						if memProfile != "" {
							profErr = writeAllocsProfile(memProfile)
						}
						if mutexProfile != "" {
							runtime.SetMutexProfileFraction(0)
							if err := writeProfile("mutex", mutexProfile); err != nil {
								profErr = err
							}
						}
					}
				}
			}
			res, err := bench.RunOverhead(ctx, cfg, progress)
			if err == nil {
				err = profErr
			}
			if err != nil {
				return err
			}
			if asJSON {
				enc := json.NewEncoder(cmd.OutOrStdout())
				enc.SetIndent("", "  ")
				return enc.Encode(res)
			}
			w := cmd.OutOrStdout()
			tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
			fmt.Fprintln(tw, "phase\trequests\terrors\treq/s\tTTFT p50 ms\tTTFT p99 ms\te2e p50 ms\tfrontend p50 ms\tfrontend p99 ms\tengine drift\t")
			routed, short := "routed", "short routed"
			if res.RoutedEngine != nil {
				routed, short = "routed, tokenized in-process", "short routed, tokenized in-process"
			}
			rows := []struct {
				name string
				p    *bench.Phase
			}{{"direct", &res.Direct}, {routed, &res.Routed}, {"routed, engine /tokenize", res.RoutedEngine},
				{"short direct", &res.ShortDirect}, {short, &res.ShortRouted}, {"short routed, engine /tokenize", res.ShortRoutedEngine}}
			for _, r := range rows {
				if r.p == nil {
					continue
				}
				frontend := "-\t-"
				if r.p != &res.Direct && r.p != &res.ShortDirect {
					frontend = fmt.Sprintf("%.3f\t%.3f", r.p.FrontendP50ms, r.p.FrontendP99ms)
				}
				fmt.Fprintf(tw, "%s\t%d\t%d\t%.0f\t%.2f\t%.2f\t%.2f\t%s\t%+.1f%%\t\n", r.name, r.p.Requests, r.p.Errors, r.p.RequestsPS, r.p.TTFTp50ms, r.p.TTFTp99ms, r.p.E2Ep50ms, frontend, 100*r.p.EngineDrift)
			}
			tw.Flush()
			fmt.Fprintf(w, "\nTTFT through the router minus direct: %+.2f ms at p50, %+.2f ms at p99\n", res.AddedP50ms, res.AddedP99ms)
			fmt.Fprintf(w, "time the frontend held a request before the engine got it: p50 %.3f ms, p99 %.3f ms (streamed), p50 %.3f ms, p99 %.3f ms (short)\n",
				res.Routed.FrontendP50ms, res.Routed.FrontendP99ms, res.ShortRouted.FrontendP50ms, res.ShortRouted.FrontendP99ms)
			fmt.Fprintf(w, "of it, waiting in the admission queue for an engine with room: p50 %.3f ms, p99 %.3f ms (streamed); the frontend's own time: p50 %.3f ms, p99 %.3f ms (streamed), p50 %.3f ms, p99 %.3f ms (short)\n",
				res.Routed.QueueP50ms, res.Routed.QueueP99ms, res.Routed.FrontendOwnP50ms, res.Routed.FrontendOwnP99ms, res.ShortRouted.FrontendOwnP50ms, res.ShortRouted.FrontendOwnP99ms)
			for _, r := range []struct {
				name string
				s    *bench.FrontendSplit
			}{{"streamed", res.Routed.FrontendSplit}, {"short", res.ShortRouted.FrontendSplit}} {
				if s := r.s; s != nil {
					fmt.Fprintf(w, "the frontend's time by part (%s), p50 / p99 ms: reading the body %.3f / %.3f, tokenizing %.3f / %.3f, routing %.3f / %.3f (of it hashing %.3f / %.3f, find_matches %.3f / %.3f, scheduling %.3f / %.3f), the rest %.3f / %.3f\n",
						r.name, s.ReadP50ms, s.ReadP99ms, s.TokenizeP50ms, s.TokenizeP99ms, s.RoutingP50ms, s.RoutingP99ms, s.HashP50ms, s.HashP99ms, s.FindP50ms, s.FindP99ms, s.ScheduleP50ms, s.ScheduleP99ms, s.OtherP50ms, s.OtherP99ms)
				}
			}
			if e := res.EPP; e != nil {
				fmt.Fprintf(w, "\nthrough a gateway asking the endpoint picker (ext_proc, FULL_DUPLEX_STREAMED):\n")
				tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
				fmt.Fprintln(tw, "phase\trequests\terrors\treq/s\tTTFT p50 ms\tTTFT p99 ms\te2e p50 ms\tpick p50 ms\tpick p99 ms\tengine drift\t")
				fmt.Fprintf(tw, "epp\t%d\t%d\t%.0f\t%.2f\t%.2f\t%.2f\t%.3f\t%.3f\t%+.1f%%\t\n", e.Streamed.Requests, e.Streamed.Errors, e.Streamed.RequestsPS, e.Streamed.TTFTp50ms, e.Streamed.TTFTp99ms, e.Streamed.E2Ep50ms, e.PickP50ms, e.PickP99ms, 100*e.Streamed.EngineDrift)
				fmt.Fprintf(tw, "short epp\t%d\t%d\t%.0f\t%.2f\t%.2f\t%.2f\t%.3f\t%.3f\t%+.1f%%\t\n", e.Short.Requests, e.Short.Errors, e.Short.RequestsPS, e.Short.TTFTp50ms, e.Short.TTFTp99ms, e.Short.E2Ep50ms, e.ShortPickP50ms, e.ShortPickP99ms, 100*e.Short.EngineDrift)
				tw.Flush()
				fmt.Fprintf(w, "TTFT through the gateway and the picker minus direct: %+.2f ms at p50, %+.2f ms at p99 (the frontend's: %+.2f, %+.2f)\n", e.AddedP50ms, e.AddedP99ms, res.AddedP50ms, res.AddedP99ms)
				fmt.Fprintf(w, "the picker's answer as the gateway waits for it: p50 %.3f ms, p99 %.3f ms (streamed), p50 %.3f ms, p99 %.3f ms (short); the frontend's own time before the engine: p50 %.3f ms, p99 %.3f ms (streamed), p50 %.3f ms, p99 %.3f ms (short)\n",
					e.PickP50ms, e.PickP99ms, e.ShortPickP50ms, e.ShortPickP99ms, res.Routed.FrontendOwnP50ms, res.Routed.FrontendOwnP99ms, res.ShortRouted.FrontendOwnP50ms, res.ShortRouted.FrontendOwnP99ms)
				fmt.Fprintf(w, "a response chunk's round trip through the picker: p50 %.3f ms, p99 %.3f ms (streamed)\n", e.ChunkP50ms, e.ChunkP99ms)
			}
			if cfg.UIPage {
				fmt.Fprintf(w, "dashboard open during the routed phases: %d polls, %d decisions sent\n", res.UIPolls, res.UIDecisions)
			}
			if e := res.RoutedEngine; e != nil {
				fmt.Fprintf(w, "%s prompts of %d tokens (short: %d); engine /tokenize minus in-process: TTFT %+.2f ms at p50, %+.2f ms at p99; frontend %+.3f ms at p50, %+.3f ms at p99\n",
					cfg.Prompt, res.PromptTokens, res.ShortPromptTokens, e.TTFTp50ms-res.Routed.TTFTp50ms, e.TTFTp99ms-res.Routed.TTFTp99ms, e.FrontendP50ms-res.Routed.FrontendP50ms, e.FrontendP99ms-res.Routed.FrontendP99ms)
				for _, where := range []string{"in_process", "engine"} {
					fmt.Fprintf(w, "kvrouter_frontend_tokenize_total of the %s run: %v\n", where, res.Tokenized[where])
				}
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.IntVar(&cfg.Workers, "workers", cfg.Workers, "simulated engines")
	f.Float64Var(&cfg.Speedup, "speedup", cfg.Speedup, "speedup ratio of the engines")
	f.IntVar(&cfg.Concurrency, "concurrency", cfg.Concurrency, "streams kept open")
	f.IntVar(&cfg.ISL, "isl", cfg.ISL, "prompt tokens of the streamed requests")
	f.IntVar(&cfg.OSL, "osl", cfg.OSL, "output tokens of the streamed requests")
	f.DurationVar(&cfg.Duration, "duration", cfg.Duration, "measured time per phase")
	f.DurationVar(&cfg.Warmup, "warmup", cfg.Warmup, "load before measuring, per phase")
	f.IntVar(&cfg.ShortISL, "short-isl", cfg.ShortISL, "prompt tokens of the short completions")
	f.IntVar(&cfg.ShortConcurrency, "short-concurrency", cfg.ShortConcurrency, "clients of the short-completion phases")
	f.Uint64Var(&cfg.Seed, "seed", cfg.Seed, "seed of the prompts")
	f.StringVar(&cfg.Prompt, "prompt", cfg.Prompt, "what requests carry: tokens (ids), text (a completion prompt) or chat (a user message)")
	f.StringVar(&cfg.Tokenizer, "tokenizer", "", "Hugging Face tokenizer (directory or tokenizer.json) of text and chat prompts, for the engines and the in-process run")
	f.StringVar(&cpuProfile, "cpuprofile", "", "write a CPU profile of the streamed routed phase to this file (pprof label part: frontend, engines or clients)")
	f.StringVar(&memProfile, "memprofile", "", "write an allocation profile to this file at the end of the streamed routed phase")
	f.StringVar(&mutexProfile, "mutexprofile", "", "write a mutex contention profile of the streamed routed phase to this file")
	f.StringVar(&engines, "engines", engines, "where the simulated engines run: process (a kvrouter mocker child process at --engines-nice, as real engines run on hardware of their own) or in-process (sharing this process's cores with the frontend as goroutines)")
	f.IntVar(&engineProc.Nice, "engines-nice", engineProc.Nice, "niceness of the engines' child process (nice(1))")
	f.StringVar(&engineProc.Binary, "engines-binary", "", "kvrouter binary the engines' child process runs (default: this one)")
	f.StringVar(&clients, "clients", clients, "where the load's clients run: in-process (goroutines beside the frontend's) or process (a child process per phase, as clients run on machines of their own)")
	f.IntVar(&clientProc.Nice, "clients-nice", 0, "niceness of the clients' child process (nice(1))")
	f.BoolVar(&cfg.EPP, "epp", false, "also run the routed loads through the endpoint picker: a gateway in front of the engines asks kvrouter's ext_proc picker for each request's engine, as a Gateway API Inference Extension gateway does (docs/epp.md)")
	f.BoolVar(&cfg.UIPage, "ui-page", false, "keep a simulated /ui dashboard open during the routed phases (polling /ui/api/state every second), to measure what feeding it costs")
	f.BoolVar(&asJSON, "json", false, "print the result as JSON")
	f.BoolVar(&quiet, "quiet", false, "no progress lines on stderr")
	return cmd
}

// newBenchOverheadClientsCmd is the clients' child process of bench
// overhead --clients process: it reads a bench.LoadSpec on stdin, runs
// that load and prints the phase it measured as JSON.
func newBenchOverheadClientsCmd() *cobra.Command {
	return &cobra.Command{
		Use:    "overhead-clients",
		Short:  "Run one phase of bench overhead's load (its clients' child process)",
		Hidden: true,
		Args:   cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var spec bench.LoadSpec
			if err := json.NewDecoder(cmd.InOrStdin()).Decode(&spec); err != nil {
				return fmt.Errorf("load spec on stdin: %w", err)
			}
			ph, err := bench.RunLoad(cmd.Context(), spec)
			if err != nil {
				return err
			}
			return json.NewEncoder(cmd.OutOrStdout()).Encode(ph)
		},
	}
}
