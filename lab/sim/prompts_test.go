package sim

import (
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/kvrouter/kvrouter/lab/trace"
	"github.com/kvrouter/kvrouter/lab/workload"
)

// conversations is a trace of multi-turn conversations: each turn's
// prompt is the previous turns' hash ids and new ones, its last block cut.
func conversations(t testing.TB, n int) *Trace {
	t.Helper()
	rng := rand.New(rand.NewPCG(7, 11))
	tr := &trace.Trace{}
	var convs [][]uint64
	next := uint64(1)
	for i := range n {
		// Turns continue one of the latest conversations, up to 12 blocks.
		k := len(convs) - 1 - rng.IntN(min(len(convs), 8)+1)
		if k < 0 || len(convs[k]) > 9 {
			convs = append(convs, nil)
			k = len(convs) - 1
		}
		for range 1 + rng.IntN(3) {
			convs[k] = append(convs[k], next)
			next++
		}
		ids := convs[k]
		tr.Requests = append(tr.Requests, trace.Request{
			Timestamp:    int64(i) * 100,
			InputLength:  (len(ids)-1)*trace.BlockTokens + 1 + rng.IntN(trace.BlockTokens),
			OutputLength: 1 + rng.IntN(60),
			HashIDs:      append([]uint64(nil), ids...),
		})
	}
	w, err := FromTrace(tr, 0)
	if err != nil {
		t.Fatal(err)
	}
	return w
}

// A run that builds prompts in the finished requests' prompts gives the
// results of one that allocates each afresh, and so does one that
// overwrites each finished prompt instead: nothing reads a prompt once
// the loop frees it, and no event still points into it.
func TestReusedPromptsChangeNothing(t *testing.T) {
	w := conversations(t, 600)
	tight := 0.5
	for _, tc := range []struct {
		name    string
		mode    string
		speedup float64
		set     func(*Config)
	}{
		{"kv, 16-token blocks", "kv", 1, func(*Config) {}},
		{"kv, events at once", "kv", 1, func(c *Config) { c.KVEventDelay = 0 }},
		{"kv, slow events", "kv", 1, func(c *Config) { c.KVEventDelay *= 50 }},
		{"kv, 512-token blocks", "kv", 1, func(c *Config) { c.Engine.BlockSize = 512; c.Engine.NumGPUBlocks = 64 }},
		{"kv, admission queue", "kv", 4, func(c *Config) { c.Router.QueueThreshold = &tight }},
		{"data-parallel ranks", "kv", 1, func(c *Config) { c.Workers, c.DPSize = 2, 2 }},
		{"round-robin", "round-robin", 1, func(*Config) {}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			run := func(how promptDisposal) (Point, int, int) {
				cfg := smallConfig()
				cfg.Engine.NumGPUBlocks = 1024
				tc.set(&cfg)
				cfg.prompts = how
				s, err := newSim(cfg, tc.mode, w, tc.speedup)
				if err != nil {
					t.Fatal(err)
				}
				if err := s.run(); err != nil {
					t.Fatal(err)
				}
				return s.point(), s.prompts.reused, s.ids.reused
			}
			want, _, _ := run(dropPrompts)
			got, reused, hashes := run(reusePrompts)
			if got != want {
				t.Fatalf("reused prompts:\n%+v\nfresh prompts:\n%+v", got, want)
			}
			if strings.Contains(tc.name, "queue") && got.Queued == 0 {
				t.Fatal("no request waited in the router's queue")
			}
			if reused < w.Len()/2 {
				t.Fatalf("%d of %d prompts built in a free one", reused, w.Len())
			}
			if hashes < w.Len()/2 {
				t.Fatalf("%d block hash lists of %d prompts' taken from free ones", hashes, 2*w.Len())
			}
			if got, _, _ := run(poisonPrompts); got != want {
				t.Fatalf("overwritten prompts:\n%+v\nfresh prompts:\n%+v", got, want)
			}
		})
	}
}

func BenchmarkTracePrompts(b *testing.B) {
	w := conversations(b, 2000)
	b.Run("fresh", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			_ = w.Request(i % w.Len())
		}
	})
	b.Run("reused", func(b *testing.B) {
		var buf []uint32
		for i := 0; i < b.N; i++ {
			buf = workload.FromTraceRequestInto(&w.reqs[i%w.Len()], buf).Tokens
		}
	})
}

// A run that hands every applied batch of KV events back to its engine
// gives the results of one that keeps them: nothing reads a batch once
// the router has applied it.
func TestRecycledEventsChangeNothingInSim(t *testing.T) {
	w := conversations(t, 600)
	for _, tc := range []struct {
		name string
		set  func(*Config)
	}{
		{"16-token blocks", func(*Config) {}},
		{"events at once", func(c *Config) { c.KVEventDelay = 0 }},
		{"slow events", func(c *Config) { c.KVEventDelay *= 50 }},
		{"512-token blocks", func(c *Config) { c.Engine.BlockSize = 512; c.Engine.NumGPUBlocks = 64 }},
		{"data-parallel ranks", func(c *Config) { c.Workers, c.DPSize = 2, 2 }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			run := func(recycle bool) Point {
				cfg := smallConfig()
				cfg.Engine.NumGPUBlocks = 1024
				tc.set(&cfg)
				s, err := newSim(cfg, "kv", w, 1)
				if err != nil {
					t.Fatal(err)
				}
				if !s.recycleEvents {
					t.Fatal("this fleet should recycle its events")
				}
				s.recycleEvents = recycle
				if err := s.run(); err != nil {
					t.Fatal(err)
				}
				return s.point()
			}
			if got, want := run(true), run(false); got != want {
				t.Fatalf("recycled events:\n%+v\nkept events:\n%+v", got, want)
			}
		})
	}
}

// A prompt the router's queue holds is not kept meanwhile: an overloaded
// run, whose queue holds most of its requests at once, builds its
// prompts in the memory of a few, and gives the results of a run that
// keeps every prompt it builds.
func TestQueuedPromptsAreNotKept(t *testing.T) {
	w := conversations(t, 600)
	tight := 0.5
	run := func(how promptDisposal) (Point, *sim) {
		cfg := smallConfig()
		cfg.Engine.NumGPUBlocks = 1024
		cfg.Router.QueueThreshold = &tight
		cfg.prompts = how
		s, err := newSim(cfg, "kv", w, 16)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.run(); err != nil {
			t.Fatal(err)
		}
		return s.point(), s
	}
	want, _ := run(dropPrompts)
	got, s := run(reusePrompts)
	if got != want {
		t.Fatalf("queued prompts given back:\n%+v\nfresh prompts:\n%+v", got, want)
	}
	if !s.prompts.lazy {
		t.Fatal("the run should skip its prompts' shared blocks")
	}
	if got.Queued < uint64(w.Len()/2) {
		t.Fatalf("%d of %d requests waited in the router's queue", got.Queued, w.Len())
	}
	if s.prompts.made > w.Len()/4 {
		t.Fatalf("%d of %d prompts built in fresh memory (%d queued)", s.prompts.made, w.Len(), got.Queued)
	}
	if got, _ := run(poisonPrompts); got != want {
		t.Fatalf("overwritten prompts:\n%+v\nfresh prompts:\n%+v", got, want)
	}
}

// BenchmarkOverloaded runs conversations whose router queue holds most of
// their requests at once (kv mode, arrival speedup 16, a tight queue):
// the path where queued requests keep no prompt.
func BenchmarkOverloaded(b *testing.B) {
	w := conversations(b, 2000)
	tight := 0.5
	b.ReportAllocs()
	for b.Loop() {
		cfg := smallConfig()
		cfg.Router.QueueThreshold = &tight
		if _, err := Run(cfg, "kv", w, 16); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkTraceOverloaded runs a Mooncake trace (the file KVROUTER_TRACE
// names; skipped without one) past the fleet's capacity, as `kvrouter
// bench sim --arrival-speedup 16` does, in the modes whose overloaded
// runs cost most.
func BenchmarkTraceOverloaded(b *testing.B) {
	w := benchTrace(b)
	for _, mode := range []string{"kv", "round-robin", "dynamo-kv"} {
		b.Run(mode, func(b *testing.B) {
			for b.Loop() {
				if _, err := Run(DefaultConfig(), mode, w, 16); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
