package engine

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"reflect"
	"sync"
	"testing"
	"unsafe"
)

func resetSpareTables() {
	spareTables.Lock()
	spareTables.sets, spareTables.bytes = nil, 0
	spareTables.Unlock()
}

// churn steps e through a random workload that fills and evicts its
// cache, and returns every step's result.
func churn(e *Engine, seed uint64) ([]StepResult, error) {
	rng := rand.New(rand.NewPCG(seed, 1))
	prefix := randTokens(rng, 120, 500)
	var out []StepResult
	for step := 0; step < 400 || !e.Idle(); step++ {
		if step > 5000 {
			return nil, errors.New("engine never idle")
		}
		if step < 400 && rng.IntN(3) == 0 {
			toks := append(prefix[:rng.IntN(120):120], randTokens(rng, 1+rng.IntN(60), 500)...)
			if err := e.Add(Request{ID: fmt.Sprint(step), Tokens: toks, MaxTokens: 1 + rng.IntN(30)}); err != nil {
				return nil, err
			}
		}
		out = append(out, e.Step())
	}
	return out, nil
}

func mustChurn(t *testing.T, e *Engine, seed uint64) []StepResult {
	t.Helper()
	out, err := churn(e, seed)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// An engine on the tables a freed engine left, full of its blocks, steps
// exactly as one on fresh tables.
func TestFreedTablesGoToTheNextEngine(t *testing.T) {
	resetSpareTables()
	defer resetSpareTables()
	cfg := Config{BlockSize: 4, NumGPUBlocks: 64, MaxNumSeqs: 8, MaxNumBatchedTokens: 64, EnablePrefixCaching: true, Seed: 3, NoBlockTokens: true, ExpectedBlocks: 64}
	first := mustNew(t, cfg)
	mustChurn(t, first, 1)
	slots := unsafe.SliceData(first.bm.byHash.slots)
	first.Free()

	reused := mustNew(t, cfg)
	if unsafe.SliceData(reused.bm.byHash.slots) != slots {
		t.Fatal("the next engine did not take the freed tables")
	}
	resetSpareTables()
	fresh := mustNew(t, cfg)
	if got, want := mustChurn(t, reused, 2), mustChurn(t, fresh, 2); !reflect.DeepEqual(got, want) {
		t.Fatal("the engine on reused tables stepped otherwise")
	}
}

// Only tables that fit are taken: an engine expecting more blocks, or
// fewer (whose map would have fewer slots), gets fresh ones; one that
// expects none keeps growing its own, and frees nothing.
func TestSpareTablesFit(t *testing.T) {
	resetSpareTables()
	defer resetSpareTables()
	cfg := Config{BlockSize: 4, NumGPUBlocks: 1024, MaxNumSeqs: 8, MaxNumBatchedTokens: 64, EnablePrefixCaching: true, NoBlockTokens: true, ExpectedBlocks: 256}
	mustNew(t, cfg).Free()
	for _, expected := range []int{0, 100, 512} {
		c := cfg
		c.ExpectedBlocks = expected
		before := len(spareTables.sets)
		e := mustNew(t, c)
		if len(spareTables.sets) != before {
			t.Fatalf("expecting %d blocks took a spare set", expected)
		}
		e.Free()
	}
	if n := len(spareTables.sets); n != 3 {
		t.Fatalf("%d spare sets, want 3 (256's, 100's and 512's)", n)
	}
	if e := mustNew(t, cfg); len(spareTables.sets) != 2 {
		t.Fatal("expecting 256 blocks took no spare set")
	} else {
		e.Free()
	}
}

// The spare tables never hold more than maxSpareBytes; the newest stay.
func TestSpareTablesBounded(t *testing.T) {
	resetSpareTables()
	defer resetSpareTables()
	const n = 1 << 16
	set := func() blockTables {
		return blockTables{blocks: make([]block, 0, n), slots: make([]uint64, mapSlots(n)), lru: make([]int32, 0, lruRoom(n))}
	}
	size := (&blockTables{blocks: make([]block, 0, n), slots: make([]uint64, mapSlots(n)), lru: make([]int32, 0, lruRoom(n))}).bytes()
	var last blockTables
	for range 2*maxSpareBytes/size + 3 {
		last = set()
		putTables(last)
	}
	if spareTables.bytes > maxSpareBytes || spareTables.bytes != len(spareTables.sets)*size || len(spareTables.sets) != maxSpareBytes/size {
		t.Fatalf("%d spare sets of %d bytes, %d counted: want %d sets within %d bytes", len(spareTables.sets), size, spareTables.bytes, maxSpareBytes/size, maxSpareBytes)
	}
	if got, ok := takeTables(n); !ok || unsafe.SliceData(got.slots) != unsafe.SliceData(last.slots) {
		t.Fatal("the newest set was not kept, or not taken first")
	}
}

// Engines made and freed on many goroutines at once, as a sweep's runs
// are, all step as an engine on fresh tables does.
func TestSpareTablesAcrossGoroutines(t *testing.T) {
	resetSpareTables()
	defer resetSpareTables()
	cfg := Config{BlockSize: 4, NumGPUBlocks: 64, MaxNumSeqs: 8, MaxNumBatchedTokens: 64, EnablePrefixCaching: true, NoBlockTokens: true, ExpectedBlocks: 64}
	want := mustChurn(t, mustNew(t, cfg), 5)
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for g := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 5 {
				e, err := New(cfg)
				if err != nil {
					errs[g] = err
					return
				}
				got, err := churn(e, 5)
				if err == nil && !reflect.DeepEqual(got, want) {
					err = fmt.Errorf("goroutine %d: an engine stepped otherwise", g)
				}
				if err != nil {
					errs[g] = err
					return
				}
				e.Free()
			}
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
}
