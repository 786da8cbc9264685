package sim

import (
	"fmt"
	"math/rand/v2"
	"os"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/lab/trace"
	"github.com/kvrouter/kvrouter/lab/workload"
)

// Engines that name their blocks by sequence hashes, handed their
// prompts' hashes by the loop, give the results of engines that hash
// every block themselves, and of engines of ids of their own (ids are
// opaque), at the trace's block size and at the router's default.
func TestBlockIDsChangeNothing(t *testing.T) {
	w := conversations(t, 600)
	for _, bs := range []int{trace.BlockTokens, 16} {
		for _, tc := range []struct {
			name string
			mode string
			set  func(*Config)
		}{
			{"kv", "kv", func(*Config) {}},
			{"kv, evicting", "kv", func(c *Config) { c.Engine.NumGPUBlocks = 24 * trace.BlockTokens / c.Engine.BlockSize }},
			{"kv, events at once", "kv", func(c *Config) { c.KVEventDelay = 0 }},
			{"data-parallel ranks", "kv", func(c *Config) { c.Workers, c.DPSize = 2, 2 }},
			{"round-robin", "round-robin", func(*Config) {}},
		} {
			t.Run(fmt.Sprintf("%s, %d-token blocks", tc.name, bs), func(t *testing.T) {
				run := func(set func(*Config)) (Point, blockHashes) {
					cfg := smallConfig()
					cfg.Engine.BlockSize, cfg.Engine.NumGPUBlocks = bs, 64*trace.BlockTokens/bs
					cfg.Router.BlockSize = bs
					tc.set(&cfg)
					set(&cfg)
					s, err := newSim(cfg, tc.mode, w, 1)
					if err != nil {
						t.Fatal(err)
					}
					if err := s.run(); err != nil {
						t.Fatal(err)
					}
					return s.point(), s.ids
				}
				want, _ := run(func(c *Config) { c.ownBlockIDs = true })
				hashed, _ := run(func(c *Config) { c.noBlockIDs = true })
				got, memo := run(func(*Config) {})
				if hashed != want {
					t.Fatalf("engines of sequence-hash ids:\n%+v\nof their own ids:\n%+v", hashed, want)
				}
				if got != want {
					t.Fatalf("hashes handed over:\n%+v\nengines of their own ids:\n%+v", got, want)
				}
				if memo.hits == 0 || memo.misses == 0 {
					t.Fatalf("%d blocks' hashes taken, %d hashed", memo.hits, memo.misses)
				}
				if !memo.router {
					t.Fatal("the router was handed no local hashes")
				}
			})
		}
	}
}

// Every hash the loop hands over is the router's, for requests hashed in
// any order, on a trace whose ids recur under other parents and at the
// root, at block sizes that divide a hash id's tokens and one that does
// not: a memo that ignored the parent, or shared a block that straddles
// the last shared hash id, would hand over another block's hash. Salted
// prompts are hashed under their salt, and their hashes never taken.
func TestHandedHashesAreTheRouters(t *testing.T) {
	prompts := [][]uint64{{1, 2, 3}, {4, 2, 3}, {1, 2, 5}, {2, 3}, {1, 2, 3, 6}, {4, 2}, {2}, {7, 1, 2}, {1, 2, 3, 6, 8}}
	tr := &trace.Trace{}
	for i, ids := range prompts {
		tr.Requests = append(tr.Requests, trace.Request{Timestamp: int64(i), InputLength: len(ids)*trace.BlockTokens - 7*i, OutputLength: 1, HashIDs: ids})
	}
	w, err := FromTrace(tr, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, bs := range []int{trace.BlockTokens, 16, 48} {
		rng := rand.New(rand.NewPCG(1, uint64(bs)))
		hits := 0
		for range 200 {
			cfg := smallConfig()
			cfg.Engine.BlockSize = bs
			s, err := newSim(cfg, "kv", w, 1)
			if err != nil {
				t.Fatal(err)
			}
			for _, i := range rng.Perm(w.Len()) {
				req := workload.FromTraceRequest(&w.reqs[i])
				if rng.IntN(6) == 0 {
					req.CacheSalt = "s"
				}
				if rng.IntN(2) == 0 {
					s.startHashes(i, &req)
				}
				local, seq := s.hashes(i, &req)
				wantLocal, wantSeq := blockhash.NewKeyed(bs, "", req.CacheSalt).Hashes(req.Tokens)
				if !slices.Equal(local, wantLocal) || !slices.Equal(seq, wantSeq) {
					t.Fatalf("%d-token blocks, request %d: hashes %x %x, the router's %x %x", bs, i, local, seq, wantLocal, wantSeq)
				}
			}
			hits += s.ids.hits
		}
		if hits == 0 {
			t.Fatalf("%d-token blocks: no hash was taken", bs)
		}
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

// BenchmarkBlockIDs: the hashes of a conversation turn's prompt (5.75
// blocks of 512 tokens on average) at 16-token blocks, taken from the
// turn before where they share a prefix (memo) or all computed (hashed).
func BenchmarkBlockIDs(b *testing.B) {
	w := conversations(b, 2000)
	reqs := make([]workload.Request, w.Len())
	for i := range reqs {
		reqs[i] = workload.FromTraceRequest(&w.reqs[i])
	}
	b.Run("memo", func(b *testing.B) {
		var s *sim
		i := 0
		for b.Loop() {
			if i == 0 {
				b.StopTimer()
				var err error
				if s, err = newSim(smallConfig(), "kv", w, 1); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
			s.startHashes(i, &reqs[i])
			i = (i + 1) % len(reqs)
		}
	})
	b.Run("hashed", func(b *testing.B) {
		h := blockhash.New(16, "")
		i := 0
		for b.Loop() {
			h.Hashes(reqs[i].Tokens)
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
	w := benchTrace(b)
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

// benchTrace is the trace the file KVROUTER_TRACE names, for the
// benchmarks that run one whole; they skip without it.
func benchTrace(b *testing.B) *Trace {
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
	return w
}

// A turn takes its previous turn's hash lists over when that turn's
// engine is done with them and no other turn takes them, and the runs
// that do give the results of runs whose turns copy them (the engines
// hashing every block themselves).
func TestMovedHashesChangeNothing(t *testing.T) {
	w := conversations(t, 300)
	for _, tc := range lazyCases(t) {
		t.Run(tc.name, func(t *testing.T) {
			for _, fill := range []skippedTokens{leaveSkipped, poisonSkipped} {
				hashed := tc
				hashed.set = func(c *Config) { tc.set(c); c.noBlockIDs = true }
				want, _ := runMoving(t, w, hashed, fill)
				got, moved := runMoving(t, w, tc, fill)
				if !reflect.DeepEqual(got, want) {
					t.Fatalf("skipped blocks %d, moved hash lists:\n%+v\nengines hashing:\n%+v", fill, got, want)
				}
				if tc.name == "kv, 16-token blocks" && moved < w.Len()/20 {
					t.Fatalf("%d hash lists of %d requests taken over", moved, w.Len())
				}
			}
		})
	}
}

// runMoving runs w under tc with the skipped blocks filled as fill says,
// and returns the run's point and how many hash lists its turns took
// over.
func runMoving(t *testing.T, w Workload, tc lazyCase, fill skippedTokens) (Point, int) {
	t.Helper()
	s := newLazyRun(t, w, tc, fill)
	if err := s.run(); err != nil {
		t.Fatal(err)
	}
	return s.point(), s.ids.moved
}

// BenchmarkTraceMovedHashes runs a small sweep of a Mooncake trace (the
// file KVROUTER_TRACE names; skipped without one) one run after another,
// as `kvrouter sim` runs each mode's, alternately with turns that take
// their previous turn's hash lists over and turns that copy them, and
// reports the sweeps' mean times (moved-ns/sweep, copied-ns/sweep).
func BenchmarkTraceMovedHashes(b *testing.B) {
	w := benchTrace(b)
	var took [2]time.Duration
	n := 0
	for b.Loop() {
		// Either first, by turns: the first of a pair finds the heap
		// holding the other's garbage.
		for j := range 2 {
			k := (j + n) % 2
			start := time.Now()
			for _, mode := range []string{"kv", "round-robin", "sglang-cache-aware"} {
				for _, speedup := range []float64{1, 4, 12} {
					cfg := DefaultConfig()
					cfg.copyHashes = k == 1
					if _, err := Run(cfg, mode, w, speedup); err != nil {
						b.Fatal(err)
					}
				}
			}
			took[k] += time.Since(start)
		}
		n++
	}
	b.ReportMetric(float64(took[0].Nanoseconds())/float64(n), "moved-ns/sweep")
	b.ReportMetric(float64(took[1].Nanoseconds())/float64(n), "copied-ns/sweep")
}
