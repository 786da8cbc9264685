package sim

import (
	"fmt"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/sched"
	"github.com/kvrouter/kvrouter/lab/trace"
)

// lazyCase is one configuration of a run over a conversation trace.
type lazyCase struct {
	name    string
	mode    string
	speedup float64
	set     func(*Config)
	// lazy: the run's prompts skip blocks.
	lazy bool
}

func lazyCases(t *testing.T) []lazyCase {
	tight := 0.5
	cases := []lazyCase{
		{"kv, 16-token blocks", "kv", 1, func(*Config) {}, true},
		{"kv, 512-token blocks", "kv", 1, func(c *Config) { c.Engine.BlockSize = 512; c.Engine.NumGPUBlocks = 64 }, true},
		{"kv, 64-token blocks, small caches", "kv", 2, func(c *Config) { c.Engine.BlockSize = 64; c.Engine.NumGPUBlocks = 160 }, true},
		{"kv, events at once", "kv", 1, func(c *Config) { c.KVEventDelay = 0 }, true},
		{"kv, slow events", "kv", 1, func(c *Config) { c.KVEventDelay *= 50 }, true},
		{"kv, admission queue", "kv", 4, func(c *Config) { c.Router.QueueThreshold = &tight }, true},
		{"kv, host tier", "kv", 2, func(c *Config) { c.Engine.NumGPUBlocks = 300; c.Engine.NumCPUBlocks = 600 }, true},
		{"kv, unequal fleet, learned prefill model", "kv", 2, func(c *Config) {
			c.Workers = 8
			c.Specs = mustSpecs(t, "4x1,4x1:0.5")
			c.Router.PrefillLoadModel = "learned"
		}, true},
		{"data-parallel ranks", "kv", 1, func(c *Config) { c.Workers, c.DPSize = 2, 2 }, true},
		{"dynamo-kv", "dynamo-kv", 1, func(*Config) {}, true},
		// Readers of the skipped tokens: the prompts are generated whole.
		{"kv, router ignores cache salts", "kv", 1, func(c *Config) { c.IgnoreCacheSalt = true }, false},
		{"kv, engines keep their blocks' tokens", "kv", 1, func(c *Config) { c.listsBlocks = true }, false},
		{"kv, engines hash their blocks", "kv", 1, func(c *Config) { c.noBlockIDs = true }, false},
		{"kv, dropped prompts", "kv", 1, func(c *Config) { c.prompts = dropPrompts }, false},
	}
	for _, m := range sched.Modes() {
		// Direct routing needs requests that name their worker.
		if m != sched.ModeKV && m != sched.ModeDirect {
			cases = append(cases, lazyCase{string(m), string(m), 1, func(*Config) {}, !m.ReadsPrompt()})
		}
	}
	return cases
}

// runSkipping runs w under tc with the skipped blocks filled as fill says,
// and returns the run's point and how many blocks its prompts skipped.
func runSkipping(t *testing.T, w Workload, tc lazyCase, fill skippedTokens, force bool) (Point, int) {
	t.Helper()
	s := newLazyRun(t, w, tc, fill)
	if force {
		s.prompts.lazy = s.prompts.tr != nil && s.ids.on && s.ids.prev != nil
	}
	if err := s.run(); err != nil {
		t.Fatal(err)
	}
	return s.point(), s.prompts.skipped
}

// newLazyRun is a run of w under tc with the skipped blocks filled as
// fill says.
func newLazyRun(t *testing.T, w Workload, tc lazyCase, fill skippedTokens) *sim {
	t.Helper()
	cfg := smallConfig()
	cfg.Engine.NumGPUBlocks = 1024
	tc.set(&cfg)
	cfg.skipped = fill
	s, err := newSim(cfg, tc.mode, w, tc.speedup)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// A run that does not generate the tokens of the blocks a prompt shares
// with its previous turn gives the results of one that generates every
// token, whatever those blocks hold (an earlier prompt's tokens, tokens
// of no prompt, other tokens of the vocabulary): nothing reads them. A
// run with a reader of them generates them.
func TestSkippedTokensAreReadByNothing(t *testing.T) {
	w := conversations(t, 300)
	for _, tc := range lazyCases(t) {
		t.Run(tc.name, func(t *testing.T) {
			want, n := runSkipping(t, w, tc, generateSkipped, false)
			if n != 0 {
				t.Fatalf("%d blocks skipped in a run that generates every token", n)
			}
			for _, fill := range []skippedTokens{leaveSkipped, poisonSkipped, scrambleSkipped} {
				got, skipped := runSkipping(t, w, tc, fill, false)
				if got != want {
					t.Fatalf("skipped blocks filled as %d:\n%+v\nevery token generated:\n%+v", fill, got, want)
				}
				if !tc.lazy {
					if skipped != 0 {
						t.Fatalf("%d blocks skipped in a run that reads them", skipped)
					}
					continue
				}
				// The trace's turns share most of their blocks.
				if skipped < w.Len() {
					t.Fatalf("%d blocks skipped in %d prompts", skipped, w.Len())
				}
			}
		})
	}
}

// The check above can fail: where something reads the shared blocks,
// skipping them changes the results.
func TestSkippedTokensThatAreReadChangeResults(t *testing.T) {
	w := conversations(t, 600)
	for _, tc := range []lazyCase{
		{"router hashes the Stored events' tokens", "kv", 1, func(c *Config) { c.IgnoreCacheSalt = true }, false},
		{"policy of its own view of the prompts", string(sched.ModeSGLangCacheAware), 1, func(*Config) {}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			want, _ := runSkipping(t, w, tc, generateSkipped, false)
			got, skipped := runSkipping(t, w, tc, poisonSkipped, true)
			if skipped == 0 {
				t.Fatal("no block skipped")
			}
			if got == want {
				t.Fatalf("poisoned blocks that are read changed nothing:\n%+v", got)
			}
		})
	}
}

// BenchmarkTraceSkipped runs a Mooncake trace (the file KVROUTER_TRACE
// names; skipped without one) as `kvrouter bench sim` does, at 512- and
// 16-token blocks, alternately with the prompts' shared blocks left
// ungenerated and generated, and reports the runs' mean times
// (skipped-ns/run, generated-ns/run).
func BenchmarkTraceSkipped(b *testing.B) {
	w := benchTrace(b)
	for _, bs := range []int{trace.BlockTokens, 16} {
		b.Run(fmt.Sprint(bs), func(b *testing.B) {
			var took [2]time.Duration
			n := 0
			for b.Loop() {
				for k, fill := range []skippedTokens{leaveSkipped, generateSkipped} {
					cfg := DefaultConfig()
					if bs == trace.BlockTokens {
						cfg.Engine.BlockSize, cfg.Engine.NumGPUBlocks = bs, 4096
					}
					cfg.skipped = fill
					start := time.Now()
					if _, err := Run(cfg, "kv", w, 1); err != nil {
						b.Fatal(err)
					}
					took[k] += time.Since(start)
				}
				n++
			}
			b.ReportMetric(float64(took[0].Nanoseconds())/float64(n), "skipped-ns/run")
			b.ReportMetric(float64(took[1].Nanoseconds())/float64(n), "generated-ns/run")
		})
	}
}
