package sim

import (
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/lab/workload"
)

// The engines are told to expect their share of the blocks a run can
// make, doubled: a lone engine whose cache never evicts ends the run
// holding every distinct block it made, which must be no more than half
// its hint (the hint bounds it) and no less than a quarter (the hint is
// not so loose that the tables it reserves go mostly unused).
func TestEngineBlocksHintBoundsTheCache(t *testing.T) {
	w := conversations(t, 400)
	for _, bs := range []int{16, 64} {
		cfg := smallConfig()
		cfg.Workers = 1
		cfg.Engine.BlockSize = bs
		cfg.Engine.NumGPUBlocks = 1 << 16
		s, err := newSim(cfg, "kv", w, 1)
		if err != nil {
			t.Fatal(err)
		}
		hint := s.engines[0].eng.Config().ExpectedBlocks
		if err := s.run(); err != nil {
			t.Fatal(err)
		}
		cached := len(s.engines[0].eng.CachedBlocks())
		if cached == 0 || cached > hint/2 || cached < hint/8 {
			t.Fatalf("%d-token blocks: %d blocks cached, hint %d: want within [hint/8, hint/2]", bs, cached, hint)
		}
	}
}

// Each of a fleet's engines expects an equal share, rounded up, of what a
// lone engine would; a workload that cannot tell its lengths leaves the
// tables to grow.
func TestEngineBlocksHintIsAShare(t *testing.T) {
	w := conversations(t, 400)
	prev, share := extensions(w)
	one := engineBlocksHint(w, prev, share, 16, 1)
	for _, engines := range []int{2, 3, 8, 1000} {
		if got, want := engineBlocksHint(w, prev, share, 16, engines), (one+engines-1)/engines; got != want {
			t.Fatalf("%d engines: hint %d, want %d", engines, got, want)
		}
	}
	cfg := smallConfig()
	s, err := newSim(cfg, "kv", w, 1)
	if err != nil {
		t.Fatal(err)
	}
	for i := range s.engines {
		if got, want := s.engines[i].eng.Config().ExpectedBlocks, engineBlocksHint(w, prev, share, cfg.Engine.BlockSize, cfg.Workers); got != want {
			t.Fatalf("engine %d expects %d blocks, want %d", i, got, want)
		}
	}
	if got := engineBlocksHint(lazyWorkload{w}, nil, nil, 16, 1); got != 0 {
		t.Fatalf("a workload of unknown lengths: hint %d, want 0", got)
	}
}

// lazyWorkload hides a workload's type, as a generated workload's is
// unknown to the hints.
type lazyWorkload struct{ Workload }

// A trace's extensions are found once and shared by all its runs.
func TestTraceExtensionsFoundOnce(t *testing.T) {
	w := conversations(t, 300)
	prev, share := extensions(w)
	again, _ := extensions(w)
	if &prev[0] != &again[0] {
		t.Fatal("extensions found again")
	}
	wantPrev, wantShare := traceExtensions(w)
	if !slices.Equal(prev, wantPrev) || !slices.Equal(share, wantShare) {
		t.Fatal("the kept extensions are not the trace's")
	}
}

// blocksHint bounds the distinct full blocks of a trace's prompts, though
// a prompt shares whole hash ids with the one it extends, the last of
// which that one may hold only part of.
func TestBlocksHintBoundsTheDistinctBlocks(t *testing.T) {
	w := conversations(t, 400)
	for _, bs := range []int{16, 48, 64, 512} {
		hint := blocksHint(w, bs)
		distinct := 0
		eachPromptBlocks(w, bs, hint, func(_ int, _ *workload.Request, _ []uint64, ids []int32) {
			for _, id := range ids {
				distinct = max(distinct, int(id)+1)
			}
		})
		if distinct == 0 || distinct > hint {
			t.Fatalf("%d-token blocks: %d distinct blocks, hint %d", bs, distinct, hint)
		}
	}
}
