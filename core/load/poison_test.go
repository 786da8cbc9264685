package load

import (
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/kv"
)

// TestMain poisons every run buffer the trie lets go of, so that a node
// still reading one after it was recycled, kept or dropped fails the
// tests that compare the trie with the model; benchmarks run without.
func TestMain(m *testing.M) {
	flag.Parse()
	poisonFreed = flag.Lookup("test.bench").Value.String() == ""
	os.Exit(m.Run())
}

// chainOf is the chain request id's end node stands for: the runs from the
// root down to it.
func chainOf(tr *Tracker, id string) []uint64 {
	var runs [][]uint64
	for n := tr.requests[id].end; n != nil && n != tr.root; n = n.parent {
		runs = append(runs, n.run)
	}
	var b []uint64
	for i := len(runs) - 1; i >= 0; i-- {
		b = append(b, runs[i]...)
	}
	return b
}

// TestLongRunsAgainstModel books and frees prompts of up to 3,000 blocks
// (past a recycled node's buffer, and past the longest kept one) that share
// prefixes of every length, so that long runs are split, merged, kept,
// taken back and dropped in every combination, with freed buffers
// poisoned. After every step the trie's invariants hold, every active
// request's chain reads back as booked, and potentials agree with the
// model.
func TestLongRunsAgainstModel(t *testing.T) {
	if !poisonFreed {
		t.Skip("needs poisoned buffers")
	}
	cfg := DefaultConfig()
	cfg.RequestTTL = -1
	tr := New(cfg)
	ref := &model{cfg: cfg, now: time.Now, reqs: map[string]*modelReq{}, lastScan: time.Now()}
	workers := []kv.Worker{w1, w2, w3}
	rng := rand.New(rand.NewPCG(11, 12))
	var families [3][]uint64
	for f := range families {
		families[f] = make([]uint64, maxLongRun+maxRecycledRun)
		for i := range families[f] {
			families[f][i] = uint64(f)<<40 | uint64(i)
		}
	}
	lengths := []int{1, 7, maxRecycledRun - 1, maxRecycledRun, maxRecycledRun + 1, 1500, 2048, 3000, maxLongRun, maxLongRun + 300}
	booked := map[string][]uint64{}
	var dst []Potential
	for step := range 600 {
		id := fmt.Sprint("r", rng.IntN(16))
		if rng.IntN(100) < 55 {
			n := lengths[rng.IntN(len(lengths))]
			if rng.IntN(2) == 0 {
				n = 1 + rng.IntN(3000)
			}
			local := slices.Clone(families[rng.IntN(len(families))][:n])
			if rng.IntN(3) > 0 {
				// Diverge somewhere, so that the chain splits a run.
				local[rng.IntN(n)] = uint64(rng.IntN(4)) << 50
			}
			b := chain(local...)
			r := Request{ID: id, Worker: workers[rng.IntN(len(workers))], Blocks: b, ISL: 16 * n}
			ok := tr.AddRequest(r) == nil
			if ok != ref.add(r) {
				t.Fatalf("step %d: AddRequest(%s) disagrees", step, id)
			}
			if ok {
				booked[id] = b
			}
			// The caller may reuse its slice at once.
			for i := range b {
				b[i] = poison
			}
			if ok {
				booked[id] = chain(local...)
			}
		} else {
			if tr.Free(id) != ref.free(id) {
				t.Fatalf("step %d: Free(%s) disagrees", step, id)
			}
			delete(booked, id)
		}
		if err := checkTrie(tr); err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		for id, b := range booked {
			if !slices.Equal(chainOf(tr, id), b) {
				t.Fatalf("step %d: request %s's chain does not read back as booked", step, id)
			}
		}
		q := Query{Blocks: chain(slices.Clone(families[rng.IntN(len(families))][:1+rng.IntN(3500)])...)}
		dst = checkPotentials(t, step, tr, ref, q, workers, dst)
	}
	if len(tr.longRuns) == 0 {
		t.Fatal("no long buffer was ever kept")
	}
}
