package sim

import (
	"reflect"
	"sync"
	"testing"
	"time"
	"unsafe"
)

// spareRun is a run that ends as Run's do, handing its prompts and hash
// lists on to store, and what it took from it.
type spareRun struct {
	p               Point
	prompts, hashes int // lists taken from store
	made, moved     int
	// pooled: the run pools its prompts; recycles: and its hash lists.
	pooled, recycles bool
}

func runSpare(t *testing.T, w Workload, tc lazyCase, fill skippedTokens, store *spareStore) spareRun {
	t.Helper()
	cfg := smallConfig()
	cfg.Engine.NumGPUBlocks = 1024
	tc.set(&cfg)
	cfg.skipped, cfg.spares = fill, store
	s, err := newSim(cfg, tc.mode, w, tc.speedup)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.run(); err != nil {
		t.Fatal(err)
	}
	r := spareRun{prompts: s.prompts.handed, hashes: s.ids.handed, made: s.prompts.made, moved: s.ids.moved,
		pooled: s.prompts.given != nil, recycles: s.ids.recycles}
	r.p = s.end()
	return r
}

// A run that builds its prompts and hashes in the lists of earlier runs
// of the process gives the results of one that starts with none, in any
// configuration and mode, on a trace and on generated workloads: nothing
// reads what it did not write. The earlier runs poison what they hand on
// (their skipped blocks are poisoned), so a run that read it would see
// tokens and hashes of no block; they run another mode at another load
// and block size, as a sweep's do.
func TestHandedOnListsChangeNothing(t *testing.T) {
	workloads := map[string]Workload{"trace": conversations(t, 300)}
	for name, w := range generated(t) {
		workloads[name] = w
	}
	earlier := []lazyCase{
		{"round-robin, overloaded", "round-robin", 8, func(*Config) {}, true},
		{"kv, 64-token blocks", "kv", 2, func(c *Config) { c.Engine.BlockSize = 64; c.Engine.NumGPUBlocks = 160 }, true},
		{"kv, 512-token blocks", "kv", 1, func(c *Config) { c.Engine.BlockSize = 512; c.Engine.NumGPUBlocks = 64 }, true},
	}
	for name, w := range workloads {
		// Each run takes from what the earlier runs and the earlier
		// cases handed on.
		store := &spareStore{max: 1 << 30}
		for _, e := range earlier {
			runSpare(t, w, e, poisonSkipped, store)
		}
		if store.bytes == 0 {
			t.Fatal("the earlier runs handed on nothing")
		}
		for _, tc := range lazyCases(t) {
			t.Run(name+", "+tc.name, func(t *testing.T) {
				for _, fill := range []skippedTokens{leaveSkipped, poisonSkipped} {
					want := runSpare(t, w, tc, fill, &spareStore{})
					if want.prompts != 0 || want.hashes != 0 {
						t.Fatalf("an empty store handed out %d prompts and %d hash lists", want.prompts, want.hashes)
					}
					got := runSpare(t, w, tc, fill, store)
					if !reflect.DeepEqual(got.p, want.p) {
						t.Fatalf("skipped blocks %d, handed-on lists:\n%+v\nnone:\n%+v", fill, got.p, want.p)
					}
					if got.pooled && (got.prompts == 0 || got.made > want.made/2) {
						t.Fatalf("%d prompts taken from the store, %d made; %d made without it", got.prompts, got.made, want.made)
					}
					if got.recycles && tc.mode == "kv" && got.hashes == 0 {
						t.Fatal("no hash list taken from the store")
					}
				}
			})
		}
	}
}

// Two runs at once, as a sweep's, share the store: each gives its
// results, whichever lists it gets.
func TestConcurrentRunsShareSpares(t *testing.T) {
	w := conversations(t, 300)
	cases := []lazyCase{
		{"round-robin, overloaded", "round-robin", 8, func(*Config) {}, true},
		{"kv", "kv", 2, func(*Config) {}, true},
		{"sglang-cache-aware", "sglang-cache-aware", 4, func(*Config) {}, false},
		{"kv, 512-token blocks", "kv", 1, func(c *Config) { c.Engine.BlockSize = 512; c.Engine.NumGPUBlocks = 64 }, true},
	}
	want := make([]Point, len(cases))
	for i, tc := range cases {
		want[i] = runSpare(t, w, tc, leaveSkipped, &spareStore{}).p
	}
	store := &spareStore{max: 1 << 30}
	got := make([]Point, 3*len(cases))
	var wg sync.WaitGroup
	sem := make(chan struct{}, 2)
	for k := range got {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			got[k] = runSpare(t, w, cases[k%len(cases)], leaveSkipped, store).p
		})
	}
	wg.Wait()
	for k, p := range got {
		if tc := cases[k%len(cases)]; !reflect.DeepEqual(p, want[k%len(cases)]) {
			t.Fatalf("%s, run %d:\n%+v\nalone:\n%+v", tc.name, k, p, want[k%len(cases)])
		}
	}
}

// The store keeps lists up to its bound, the rest left to the garbage
// collector, and hands out empty lists of the class asked for.
func TestSpareStoreBound(t *testing.T) {
	s := &spareStore{max: 10_000}
	tokens := [][]uint32{make([]uint32, 5, 1024), make([]uint32, 0, 256), make([]uint32, 0, 100), make([]uint32, 3, 512), make([]uint32, 0, 256)}
	hashes := [][]uint64{make([]uint64, 7, 128), nil, make([]uint64, 0, 1000), make([]uint64, 0, 512)}
	s.put(tokens, hashes)
	// Hash lists of 1 KB and 4 KB, and a prompt of 4 KB: the other
	// prompts' 1 KB and 2 KB would pass the bound, and lists whose
	// capacity is not a power of two are not the pools'.
	if s.bytes != 9216 {
		t.Fatalf("%d bytes kept, bound %d", s.bytes, s.max)
	}
	for c := range s.tokens {
		if n := len(s.tokens[c]); n != 0 && c != 10 || c == 10 && n != 1 {
			t.Fatalf("%d prompts of class %d kept", n, c)
		}
		if n := len(s.hashes[c]); n != 0 && c != 7 && c != 9 || (c == 7 || c == 9) && n != 1 {
			t.Fatalf("%d hash lists of class %d kept", n, c)
		}
	}
	if l := s.takeTokens(8); l != nil {
		t.Fatalf("a prompt of capacity %d for a class that holds none", cap(l))
	}
	if l := s.takeHashes(10); l != nil {
		t.Fatalf("a hash list of capacity %d for a class that holds none", cap(l))
	}
	before := s.bytes
	if l := s.takeTokens(10); len(l) != 0 || cap(l) != 1024 || s.bytes != before-4096 {
		t.Fatalf("prompt of length %d, capacity %d; %d bytes kept, %d before", len(l), cap(l), s.bytes, before)
	}
	for _, c := range []int{7, 9} {
		before := s.bytes
		if l := s.takeHashes(c); len(l) != 0 || cap(l) != 1<<c || s.bytes != before-8<<c {
			t.Fatalf("class %d: hash list of length %d, capacity %d; %d bytes kept, %d before", c, len(l), cap(l), s.bytes, before)
		}
	}
	if s.bytes != 0 {
		t.Fatalf("%d bytes kept after every list was taken", s.bytes)
	}
	s.put(tokens[1:2], nil)
	if s.bytes != 1024 {
		t.Fatalf("%d bytes kept of a 1 KB prompt in an empty store", s.bytes)
	}
	// Of a run's lists, what fits.
	w := conversations(t, 300)
	for _, max := range []int{0, 64 << 10, 1 << 30} {
		s := &spareStore{max: max}
		r := runSpare(t, w, lazyCase{"round-robin", "round-robin", 8, func(*Config) {}, true}, leaveSkipped, s)
		if s.bytes > max || max > 0 && s.bytes == 0 || r.prompts != 0 {
			t.Fatalf("bound %d: %d bytes kept, %d prompts taken from an empty store", max, s.bytes, r.prompts)
		}
		// Each list once: two requests given one would write each
		// other's tokens and hashes.
		arrays := map[uintptr]bool{}
		for c := range s.tokens {
			for _, l := range s.tokens[c] {
				arrays[uintptr(unsafe.Pointer(unsafe.SliceData(l)))] = true
			}
			for _, l := range s.hashes[c] {
				arrays[uintptr(unsafe.Pointer(unsafe.SliceData(l)))] = true
			}
		}
		if kept := s.lists(); len(arrays) != kept {
			t.Fatalf("bound %d: %d lists kept, %d arrays", max, kept, len(arrays))
		}
	}
	if spares.max != maxSpareBytes {
		t.Fatalf("the process's store is bounded at %d bytes", spares.max)
	}
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
				want := runSpare(t, w, hashed, fill, &spareStore{})
				got := runSpare(t, w, tc, fill, &spareStore{})
				if !reflect.DeepEqual(got.p, want.p) {
					t.Fatalf("skipped blocks %d, moved hash lists:\n%+v\nengines hashing:\n%+v", fill, got.p, want.p)
				}
				if tc.name == "kv, 16-token blocks" && got.moved < w.Len()/20 {
					t.Fatalf("%d hash lists of %d requests taken over", got.moved, w.Len())
				}
			}
		})
	}
}

// lists counts the lists s keeps.
func (s *spareStore) lists() int {
	n := 0
	for c := range s.tokens {
		n += len(s.tokens[c]) + len(s.hashes[c])
	}
	return n
}

// BenchmarkTraceSweep runs a small sweep of a Mooncake trace (the file
// KVROUTER_TRACE names; skipped without one) one run after another, as
// `kvrouter sim` runs each mode's, alternately with the process's store
// of handed-on lists and with none, and reports the sweeps' mean times
// (handed-ns/sweep, fresh-ns/sweep).
func BenchmarkTraceSweep(b *testing.B) {
	w := benchTrace(b)
	var took [2]time.Duration
	n := 0
	for b.Loop() {
		// Either first, by turns: the first of a pair finds the heap
		// holding the other's garbage.
		for j := range 2 {
			k := (j + n) % 2
			store := []*spareStore{nil, {}}[k]
			start := time.Now()
			for _, mode := range []string{"kv", "round-robin", "sglang-cache-aware"} {
				for _, speedup := range []float64{4, 12} {
					cfg := DefaultConfig()
					cfg.spares = store
					if _, err := Run(cfg, mode, w, speedup); err != nil {
						b.Fatal(err)
					}
				}
			}
			took[k] += time.Since(start)
		}
		n++
	}
	b.ReportMetric(float64(took[0].Nanoseconds())/float64(n), "handed-ns/sweep")
	b.ReportMetric(float64(took[1].Nanoseconds())/float64(n), "fresh-ns/sweep")
}
