package sim

import (
	"math/rand/v2"
	"os"
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/lab/trace"
	"github.com/kvrouter/kvrouter/lab/workload"
	"github.com/kvrouter/kvrouter/mocker/engine"
)

// At the trace's block size, engines handed their prompts' block ids by
// the loop give the results of engines that hash every block themselves.
func TestBlockIDsChangeNothing(t *testing.T) {
	w := conversations(t, 600)
	for _, tc := range []struct {
		name string
		mode string
		set  func(*Config)
	}{
		{"kv", "kv", func(*Config) {}},
		{"kv, evicting", "kv", func(c *Config) { c.Engine.NumGPUBlocks = 24 }},
		{"kv, events at once", "kv", func(c *Config) { c.KVEventDelay = 0 }},
		{"data-parallel ranks", "kv", func(c *Config) { c.Workers, c.DPSize = 2, 2 }},
		{"round-robin", "round-robin", func(*Config) {}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			run := func(ids bool) (Point, blockIDMemo) {
				cfg := smallConfig()
				cfg.Engine.BlockSize, cfg.Engine.NumGPUBlocks = trace.BlockTokens, 64
				tc.set(&cfg)
				cfg.noBlockIDs = !ids
				s, err := newSim(cfg, tc.mode, w, 1)
				if err != nil {
					t.Fatal(err)
				}
				if err := s.run(); err != nil {
					t.Fatal(err)
				}
				return s.point(), s.ids
			}
			want, _ := run(false)
			got, memo := run(true)
			if got != want {
				t.Fatalf("block ids handed over:\n%+v\nhashed by the engines:\n%+v", got, want)
			}
			if memo.hits == 0 || memo.misses == 0 {
				t.Fatalf("%d blocks' ids taken, %d hashed", memo.hits, memo.misses)
			}
			if memo.local == nil {
				t.Fatal("the router was handed no local hashes")
			}
		})
	}
}

// Every id the loop hands over is the one the engine's own chain gives,
// on a trace whose ids recur under other parents and at the root, sent to
// engines in turn: a slot that ignored the parent or the engine would
// hand over another block's id.
func TestBlockIDsMatchTheEnginesChain(t *testing.T) {
	prompts := [][]uint64{{1, 2, 3}, {4, 2, 3}, {1, 2, 5}, {2, 3}, {1, 2, 3, 6}, {4, 2}, {2}, {7, 1, 2}}
	tr := &trace.Trace{}
	for i, ids := range prompts {
		tr.Requests = append(tr.Requests, trace.Request{Timestamp: int64(i), InputLength: len(ids)*trace.BlockTokens + 7, OutputLength: 1, HashIDs: ids})
	}
	w, err := FromTrace(tr, 0)
	if err != nil {
		t.Fatal(err)
	}
	cfg := smallConfig()
	cfg.Engine.BlockSize = trace.BlockTokens
	s, err := newSim(cfg, "kv", w, 1)
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for range 2000 {
		i, e := rng.IntN(w.Len()), rng.IntN(len(s.engines))
		req := workload.FromTraceRequest(&w.reqs[i])
		seed := s.engines[e].eng.Config().Seed
		if i > 0 && rng.IntN(2) == 0 {
			// Most turns follow their conversation's previous one.
			if p := s.ids.prev[i]; p >= 0 && s.ids.engine[p] > 0 {
				e = int(s.ids.engine[p]) - 1
				seed = s.engines[e].eng.Config().Seed
			}
		}
		got := s.blockIDs(i, e, req.Tokens, "")
		var parent uint64
		for j := range len(req.Tokens) / trace.BlockTokens {
			parent = engine.BlockID(seed, parent, req.Tokens[j*trace.BlockTokens:(j+1)*trace.BlockTokens])
			if got[j] != parent {
				t.Fatalf("request %d on engine %d, block %d: id %x, the engine's chain gives %x", i, e, j, got[j], parent)
			}
		}
	}
	if s.ids.hits == 0 {
		t.Fatal("no id was taken")
	}
	h := blockhash.NewKeyed(trace.BlockTokens, "", "")
	for range 2000 {
		i := rng.IntN(w.Len())
		req := workload.FromTraceRequest(&w.reqs[i])
		got := s.localHashes(i, req.Tokens, "")
		if want := h.AppendLocalHashes(nil, req.Tokens); !slices.Equal(got, want) {
			t.Fatalf("request %d: local hashes %x, the router's %x", i, got, want)
		}
		// A Stored event of any run of the prompt's blocks, and one
		// that runs past them into generated tokens.
		first := rng.IntN(len(got) + 1)
		n := 1 + rng.IntN(len(got)+2-first)
		ev := engine.BlockEvent{Kind: engine.Stored, BlockHashes: make([]uint64, n), Tag: int32(i + 1), First: int32(first)}
		sl := s.storedLocal(&ev, "")
		if want := got[first:min(first+n, len(got))]; !slices.Equal(sl, want) {
			t.Fatalf("request %d, blocks %d+%d: stored local hashes %x, want %x", i, first, n, sl, want)
		}
		if s.storedLocal(&ev, "salt") != nil {
			t.Fatal("local hashes for a salted event")
		}
	}
	if s.localHashes(0, workload.FromTraceRequest(&w.reqs[0]).Tokens, "salt") != nil {
		t.Fatal("local hashes for a salted prompt")
	}
	if s.blockIDs(0, 0, workload.FromTraceRequest(&w.reqs[0]).Tokens, "salt") != nil {
		t.Fatal("ids for a salted prompt")
	}
}

// A trace read from JSON numbers its ids as Parse did, one built in memory
// gets them numbered by the loop, and both give equal ids equal numbers.
func TestTraceDenseIDs(t *testing.T) {
	w := conversations(t, 200)
	seen := map[uint64]uint32{}
	for i, r := range w.reqs {
		if len(w.dense[i]) != len(r.HashIDs) {
			t.Fatalf("request %d: %d dense ids for %d hash ids", i, len(w.dense[i]), len(r.HashIDs))
		}
		for k, id := range r.HashIDs {
			d := w.dense[i][k]
			if prev, ok := seen[id]; ok && prev != d {
				t.Fatalf("id %d numbered %d and %d", id, prev, d)
			}
			seen[id] = d
			if int(d) >= w.numIDs {
				t.Fatalf("dense id %d of %d", d, w.numIDs)
			}
		}
	}
	if len(seen) != w.numIDs {
		t.Fatalf("%d distinct ids, numIDs %d", len(seen), w.numIDs)
	}
}

// BenchmarkBlockIDs: the ids of a conversation turn's prompt (5.75 blocks
// of 512 tokens on average) on the engine that ran the turn before.
func BenchmarkBlockIDs(b *testing.B) {
	w := conversations(b, 2000)
	cfg := smallConfig()
	cfg.Engine.BlockSize = trace.BlockTokens
	s, err := newSim(cfg, "kv", w, 1)
	if err != nil {
		b.Fatal(err)
	}
	reqs := make([]workload.Request, w.Len())
	for i := range reqs {
		reqs[i] = workload.FromTraceRequest(&w.reqs[i])
	}
	b.Run("memo", func(b *testing.B) {
		i := 0
		for b.Loop() {
			s.blockIDs(i, 0, reqs[i].Tokens, "")
			i = (i + 1) % len(reqs)
		}
	})
	b.Run("hashed", func(b *testing.B) {
		i := 0
		for b.Loop() {
			toks := reqs[i].Tokens
			var parent uint64
			for j := range len(toks) / trace.BlockTokens {
				parent = engine.BlockID(1, parent, toks[j*trace.BlockTokens:(j+1)*trace.BlockTokens])
			}
			i = (i + 1) % len(reqs)
		}
	})
}

// BenchmarkTrace512 runs a Mooncake trace (the file KVROUTER_TRACE names;
// skipped without one) at 512-token blocks in kv mode, as `kvrouter bench
// sim --kv-cache-block-size 512 --num-gpu-blocks 4096` does, with the
// prompts' block ids and local hashes handed over (memo) and without
// (hashed). Run with -count for the two to alternate.
func BenchmarkTrace512(b *testing.B) {
	path := os.Getenv("KVROUTER_TRACE")
	if path == "" {
		b.Skip("KVROUTER_TRACE names no trace")
	}
	tr, err := trace.Load(path)
	if err != nil {
		b.Fatal(err)
	}
	w, err := FromTrace(tr, 0)
	if err != nil {
		b.Fatal(err)
	}
	for _, memo := range []bool{true, false} {
		b.Run(map[bool]string{true: "memo", false: "hashed"}[memo], func(b *testing.B) {
			for b.Loop() {
				cfg := DefaultConfig()
				cfg.Engine.BlockSize, cfg.Engine.NumGPUBlocks = trace.BlockTokens, 4096
				cfg.noBlockIDs = !memo
				if _, err := Run(cfg, "kv", w, 1); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
