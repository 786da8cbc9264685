package main

import (
	"context"
	"fmt"
	"io"
	"runtime"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/kvrouter/kvrouter/adapters/modeltok"
	"github.com/kvrouter/kvrouter/lab/bench"
	"github.com/kvrouter/kvrouter/lab/workload"
)

func newBenchTokenizeCmd() *cobra.Command {
	var (
		specs                  []string
		paragraphs, iterations int
		messages               int
		quiet, asJSON          bool
		jsRef                  string
	)
	cmd := &cobra.Command{
		Use:   "tokenize",
		Short: "Time in-process tokenization and chat template rendering on one core",
		Long: `For each --tokenizer (NAME=PATH or PATH, repeatable), encodes a text of
English prose and Go code (--paragraphs, about 111 Llama-3 tokens each; 74
make about 8,200 tokens) --iterations times on one core, after a first
encode with nothing cached, and renders a conversation of --messages
messages with the model's chat template. Reports milliseconds per encode,
MB/s and tokens/s, and microseconds per render.

With --js-reference DIR (scripts/tokenizer-goldens after npm ci there), each
tokenizer's files are also timed with the JavaScript reference
(@lenml/tokenizers under node, DIR/bench.mjs) on the same text, the same
number of encodes after a warm-up; the token counts must agree. Without
node or DIR's node_modules the reference is skipped with a note. Only this
process is limited to one core (GOMAXPROCS 1); node has its own helper
threads, so pin both with taskset -c N to compare one core with one core.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if len(specs) == 0 {
				return fmt.Errorf("give at least one --tokenizer")
			}
			text := workload.ProseAndCode(paragraphs)
			run := func(ctx context.Context, progress io.Writer) ([]bench.TokenizeResult, error) {
				// One core: the figure is a per-core throughput.
				defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
				var out []bench.TokenizeResult
				for _, spec := range specs {
					name, path, ok := strings.Cut(spec, "=")
					if !ok {
						name, path = spec, spec
					}
					m, err := modeltok.Load(path)
					if err != nil {
						return nil, err
					}
					fmt.Fprintf(progress, "tokenizing with %s\n", name)
					r, err := bench.RunTokenize(name, m, text, iterations, messages)
					if err != nil {
						return nil, fmt.Errorf("%s: %w", name, err)
					}
					if jsRef != "" {
						fmt.Fprintf(progress, "tokenizing with %s: JavaScript reference\n", name)
						if r.JS, r.JSSkipped, err = bench.RunJSReference(ctx, jsRef, path, text, r.Tokens, iterations); err != nil {
							return nil, fmt.Errorf("%s: %w", name, err)
						}
					}
					out = append(out, r)
				}
				return out, nil
			}
			return runBench(cmd, quiet, asJSON, run, func(w io.Writer, rs []bench.TokenizeResult) error {
				tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
				header := "tokenizer\ttokens\tfirst ms\tencode ms p50\tp99\tMB/s\ttokens/s\tchat render µs p50\tp99"
				if jsRef != "" {
					header += "\tJS encode ms p50\tp99\tJS MB/s\tJS tokens/s\tGo/JS"
				}
				fmt.Fprintln(tw, header)
				var notes []string
				for _, r := range rs {
					chat := "-\t-"
					if r.ChatRenderUS != nil {
						chat = fmt.Sprintf("%.0f\t%.0f", r.ChatRenderUS.P50, r.ChatRenderUS.P99)
					}
					fmt.Fprintf(tw, "%s\t%d\t%.2f\t%.3f\t%.3f\t%.1f\t%.0f\t%s", r.Tokenizer, r.Tokens, r.FirstMS, r.EncodeMS.P50, r.EncodeMS.P99, r.MBPerS, r.TokensPerS, chat)
					switch {
					case r.JS != nil:
						fmt.Fprintf(tw, "\t%.3f\t%.3f\t%.1f\t%.0f\t%.1f×", r.JS.EncodeMS.P50, r.JS.EncodeMS.P99, r.JS.MBPerS, r.JS.TokensPerS, r.MBPerS/r.JS.MBPerS)
					case jsRef != "":
						fmt.Fprint(tw, "\t-\t-\t-\t-\t-")
						notes = append(notes, fmt.Sprintf("%s: JavaScript reference skipped: %s", r.Tokenizer, r.JSSkipped))
					}
					fmt.Fprintln(tw)
				}
				if err := tw.Flush(); err != nil {
					return err
				}
				for _, r := range rs {
					if r.JS != nil {
						fmt.Fprintf(w, "JavaScript reference: %s on node %s, %d encodes after %d warm-up\n", r.JS.Reference, r.JS.Node, iterations, r.JS.Warmup)
						break
					}
				}
				for _, n := range notes {
					fmt.Fprintln(w, n)
				}
				return nil
			})
		},
	}
	f := cmd.Flags()
	f.StringArrayVar(&specs, "tokenizer", nil, "NAME=PATH or PATH of a Hugging Face tokenizer (repeatable)")
	f.IntVar(&paragraphs, "paragraphs", 74, "paragraphs of the text (74: about 8,200 Llama-3 tokens)")
	f.IntVar(&iterations, "iterations", 200, "encodes (and renders) timed per tokenizer")
	f.IntVar(&messages, "messages", 20, "messages of the conversation rendered with the chat template")
	f.StringVar(&jsRef, "js-reference", "", "directory of the JavaScript reference's bench.mjs and node_modules (scripts/tokenizer-goldens): time it on the same text")
	f.BoolVar(&quiet, "quiet", false, "no progress on stderr")
	f.BoolVar(&asJSON, "json", false, "print the results as JSON")
	return cmd
}
