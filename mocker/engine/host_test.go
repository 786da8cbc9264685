package engine

import (
	"slices"
	"testing"
	"time"
)

// runAll steps e until idle and returns the outputs' CachedTokens by id,
// every event, and the total model time.
func runAll(t *testing.T, e *Engine) (cached map[string]int, evs []BlockEvent, total time.Duration) {
	t.Helper()
	cached = map[string]int{}
	for i := 0; !e.Idle(); i++ {
		if i > 10000 {
			t.Fatal("engine never idles")
		}
		r := e.Step()
		for _, o := range r.Outputs {
			if o.Index == 0 {
				cached[o.ID] = o.CachedTokens
			}
		}
		for _, ev := range r.Events {
			ev.BlockHashes = slices.Clone(ev.BlockHashes)
			evs = append(evs, ev)
		}
		total += r.Duration
	}
	return cached, evs, total
}

func hostConfig(gpu, cpu int) Config {
	cfg := DefaultConfig()
	cfg.NumGPUBlocks, cfg.NumCPUBlocks = gpu, cpu
	return cfg
}

// tierSets replays events into the set of blocks each tier holds.
func tierSets(t *testing.T, evs []BlockEvent) (gpu, host map[uint64]bool) {
	t.Helper()
	gpu, host = map[uint64]bool{}, map[uint64]bool{}
	for _, ev := range evs {
		set := gpu
		if ev.Host {
			set = host
		}
		for _, h := range ev.BlockHashes {
			switch ev.Kind {
			case Stored:
				if set[h] {
					t.Fatalf("block %x stored twice on host=%v", h, ev.Host)
				}
				set[h] = true
			case Removed:
				if !set[h] {
					t.Fatalf("block %x removed from host=%v, never stored there", h, ev.Host)
				}
				delete(set, h)
			}
		}
	}
	return gpu, host
}

// The host tier is written through and published as vLLM's offloading
// connector publishes it: medium CPU, no parent, no tokens, after the
// step's GPU events.
func TestHostWriteThroughEvents(t *testing.T) {
	e := mustNew(t, hostConfig(64, 64))
	mustAdd(t, e, "a", seqTokens(1, 4*16+3), 2)
	_, evs, _ := runAll(t, e)
	var gpuStored, hostStored []uint64
	for _, ev := range evs {
		if ev.Kind != Stored {
			continue
		}
		if !ev.Host {
			gpuStored = append(gpuStored, ev.BlockHashes...)
			continue
		}
		if ev.Parent != nil || ev.TokenIDs == nil || len(ev.TokenIDs) != 0 || ev.LoRAName != "" || ev.ExtraKeys != nil {
			t.Fatalf("host stored event %+v: want no parent, empty token ids, no keys", ev)
		}
		if len(gpuStored) < len(hostStored)+len(ev.BlockHashes) {
			t.Fatalf("host stored blocks before the GPU did")
		}
		hostStored = append(hostStored, ev.BlockHashes...)
	}
	if len(gpuStored) != 4 || !slices.Equal(gpuStored, hostStored) {
		t.Fatalf("GPU stored %x, host stored %x: want the same 4 blocks in order", gpuStored, hostStored)
	}
	if m := e.Metrics(); m.HostBlocks != 4 {
		t.Fatalf("host holds %d blocks, want 4", m.HostBlocks)
	}
}

// A prompt whose prefix was evicted from the GPU but kept on the host
// loads it: its cached tokens count the host's blocks, the GPU stores them
// again, and the step costs the load instead of the prefill.
func TestHostHitLoadsInsteadOfPrefill(t *testing.T) {
	const bs = 16
	prompt := seqTokens(1000, 32*bs+1)
	run := func(cpu int) (int, time.Duration, []BlockEvent, Metrics) {
		e := mustNew(t, hostConfig(40, cpu))
		mustAdd(t, e, "a", prompt, 1)
		runAll(t, e)
		mustAdd(t, e, "evict", seqTokens(50000, 40*bs-1), 1) // takes every GPU block
		runAll(t, e)
		mustAdd(t, e, "again", prompt, 1)
		cached, evs, d := runAll(t, e)
		return cached["again"], d, evs, e.Metrics()
	}
	coldCached, cold, _, _ := run(0)
	cached, warm, evs, m := run(100)
	if coldCached != 0 {
		t.Fatalf("without a host tier the prompt found %d tokens cached, want 0 (evicted)", coldCached)
	}
	if cached != 32*bs || m.HostHits != 32*bs {
		t.Fatalf("with a host tier: cached %d, host hits %d, want %d", cached, m.HostHits, 32*bs)
	}
	load := 32 * 83886 * time.Nanosecond // 2 MiB at 25 GB/s
	want := StepTime(1, 0, 0) + load
	if d := warm - want; d < -time.Microsecond*40 || d > time.Microsecond*40 {
		t.Fatalf("the warm request took %v, want one token's step %v plus the load %v (cold: %v)", warm, StepTime(1, 0, 0), load, cold)
	}
	var gpuStored int
	for _, ev := range evs {
		if ev.Kind == Stored && !ev.Host {
			gpuStored += len(ev.BlockHashes)
		}
	}
	if gpuStored != 32 {
		t.Fatalf("the loaded blocks were stored %d times on the GPU, want 32", gpuStored)
	}
}

// The host pool evicts by LRU, a prefix after its suffixes, and publishes
// the evictions with medium CPU.
func TestHostLRUEviction(t *testing.T) {
	const bs = 16
	e := mustNew(t, hostConfig(64, 6))
	mustAdd(t, e, "a", seqTokens(1, 4*bs+1), 1)
	_, first, _ := runAll(t, e)
	_, hostA := tierSets(t, first)
	mustAdd(t, e, "b", seqTokens(9000, 4*bs+1), 1)
	_, second, _ := runAll(t, e)
	var removed []uint64
	for _, ev := range second {
		if ev.Kind == Removed && ev.Host {
			removed = append(removed, ev.BlockHashes...)
		}
		if ev.Kind == Removed && !ev.Host {
			t.Fatalf("GPU evicted %x with room to spare", ev.BlockHashes)
		}
	}
	_, hostAll := tierSets(t, append(first, second...))
	if len(hostAll) != 6 || len(removed) != 2 {
		t.Fatalf("host holds %d blocks after removing %d, want 6 after 2", len(hostAll), len(removed))
	}
	// a's blocks were touched first-block-last: its suffix goes first.
	a := seqBlocks{tokens: seqTokens(1, 4*bs+1)}
	e.bm.ensureHashes(&a, 4)
	if !slices.Equal(removed, []uint64{a.hashes[3], a.hashes[2]}) || !hostA[a.hashes[0]] || !hostAll[a.hashes[0]] || !hostAll[a.hashes[1]] {
		t.Fatalf("host evicted %x, want a's last two blocks %x", removed, a.hashes[2:])
	}
}

func TestHostConfigErrors(t *testing.T) {
	for _, cfg := range []Config{
		{NumCPUBlocks: -1},
		{NumCPUBlocks: 8, KVOffloadBandwidth: -1},
		{NumCPUBlocks: 8, EnablePrefixCaching: false},
	} {
		c := hostConfig(64, cfg.NumCPUBlocks)
		c.KVOffloadBandwidth = cfg.KVOffloadBandwidth
		if cfg.NumCPUBlocks == 8 && cfg.KVOffloadBandwidth == 0 {
			c.EnablePrefixCaching = false
		}
		if _, err := New(c); err == nil {
			t.Errorf("New(%d CPU blocks, %v GB/s, caching %v) accepted", c.NumCPUBlocks, c.KVOffloadBandwidth, c.EnablePrefixCaching)
		}
	}
}
