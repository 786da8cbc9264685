package engine

import (
	"math"
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

// hostOnly makes an engine of gpu blocks whose host tier holds prompt and
// whose GPU no longer does (a longer prompt evicted it).
func hostOnly(t *testing.T, gpu int, bandwidth float64, prompt []uint32) *Engine {
	t.Helper()
	cfg := hostConfig(gpu, 4096)
	cfg.KVOffloadBandwidth = bandwidth
	e := mustNew(t, cfg)
	mustAdd(t, e, "a", prompt, 1)
	runAll(t, e)
	mustAdd(t, e, "evict", seqTokens(50000, gpu*16-1), 1)
	runAll(t, e)
	if n := e.CachedPrefixBlocks(prompt); n != 0 {
		t.Fatalf("the GPU still caches %d blocks of the prompt", n)
	}
	return e
}

// A host load runs beside the running requests, as vLLM's connector loads
// on its own stream: the steps while it is in flight are the running
// request's decode steps alone, and the loading request's first token comes
// in the first step that starts after its load has ended.
func TestHostLoadDoesNotStallRunningRequests(t *testing.T) {
	const bs = 16
	prompt := seqTokens(1000, 32*bs+1)
	// 0.1 GB/s: 32 blocks of 2 MiB take 671 ms, about a hundred decode steps.
	e := hostOnly(t, 80, 0.1, prompt)
	mustAdd(t, e, "decoding", seqTokens(90000, bs+1), 400)
	for range 3 {
		e.Step()
	}
	mustAdd(t, e, "loading", prompt, 2)
	load := time.Duration(32 * math.Round(2*1024*1024/0.1))
	var at time.Duration // since "loading" was added
	loadSteps := 0
	for i := 0; ; i++ {
		if i > 1000 {
			t.Fatal("the loading request never produced a token")
		}
		r := e.Step()
		first := false
		for _, o := range r.Outputs {
			first = first || o.ID == "loading"
		}
		if first {
			if at < load {
				t.Fatalf("the first token's step started at %v, before the load's end (%v)", at, load)
			}
			if r.PrefillTokens != 1 {
				t.Fatalf("the loaded request prefilled %d tokens, want its last one", r.PrefillTokens)
			}
			at += r.Duration
			break
		}
		if at >= load {
			t.Fatalf("step %d started at %v, after the load ended (%v), without the loaded request", i, at, load)
		}
		if want := StepTime(0, 1, r.KVUsage); r.Duration != want || r.DecodeSeqs != 1 || r.PrefillTokens != 0 {
			t.Fatalf("step %d while loading: %v, %d decodes, %d prefill tokens; want the decode step alone (%v)",
				i, r.Duration, r.DecodeSeqs, r.PrefillTokens, want)
		}
		if m := e.Metrics(); m.Running != 1 || m.Waiting != 1 {
			t.Fatalf("step %d: %d running, %d waiting; want the loading request waiting", i, m.Running, m.Waiting)
		}
		at += r.Duration
		loadSteps++
	}
	if loadSteps < 10 {
		t.Fatalf("only %d steps ran during a load of %v", loadSteps, load)
	}
	if m := e.Metrics(); m.HostHits != 32*bs {
		t.Fatalf("host hits %d, want %d", m.HostHits, 32*bs)
	}
}

// Loads share one link in the order they started (vLLM's CPU-to-GPU
// transfers each wait for the previous one), and a request whose prefix is
// on its way for another waits for that load instead of loading it again.
func TestHostLoadsQueueOnOneLink(t *testing.T) {
	const bs = 16
	p1 := seqTokens(1000, 8*bs+1)
	p2 := seqTokens(7000, 8*bs+1)
	cfg := hostConfig(40, 4096)
	cfg.KVOffloadBandwidth = 0.1 // 168 ms a load, ten prefill steps
	e := mustNew(t, cfg)
	mustAdd(t, e, "p1", p1, 1)
	mustAdd(t, e, "p2", p2, 1)
	runAll(t, e)
	mustAdd(t, e, "evict", seqTokens(50000, 40*bs-1), 1)
	runAll(t, e)
	mustAdd(t, e, "one", p1, 1)
	mustAdd(t, e, "two", p2, 1)
	mustAdd(t, e, "same", append(slices.Clone(p1[:8*bs]), 5, 6, 7), 1)
	per := time.Duration(math.Round(2 * 1024 * 1024 / 0.1))
	firsts := map[string]time.Duration{}
	var at time.Duration
	for i := 0; !e.Idle(); i++ {
		if i > 100 {
			t.Fatal("the engine never idles")
		}
		r := e.Step()
		at += r.Duration
		for _, o := range r.Outputs {
			firsts[o.ID] = at
		}
	}
	one, two := firsts["one"], firsts["two"]
	// "one" runs at 8 loads' end, "two" at 16's: each first token step
	// starts there and prefills what the ready requests have left.
	if one < 8*per || two < 16*per || two <= one {
		t.Fatalf("first tokens at %v and %v, want after %v and %v", one, two, 8*per, 16*per)
	}
	if two-16*per > StepTime(2, 0, 1)+time.Millisecond {
		t.Fatalf("the second load's request answered at %v, %v after its load: the loads overlapped or waited too long", two, two-16*per)
	}
	if m := e.Metrics(); m.HostHits != 16*bs {
		t.Fatalf("host hits %d tokens, want the two loads' %d: the shared prefix was loaded twice", m.HostHits, 16*bs)
	}
	if firsts["same"] < one {
		t.Fatalf("the request sharing one's loading prefix answered at %v, before one (%v)", firsts["same"], one)
	}
}

// Requests whose loads ended hold their blocks while they wait. When the
// queue's front cannot fit beside them and nothing runs or loads (a
// request preempted in the step that made a load ready goes back ahead of
// it), they give their blocks back (kept cached) rather than stall the
// engine for good.
func TestLoadedRequestsDoNotDeadlockTheQueue(t *testing.T) {
	const bs = 16
	p1 := seqTokens(1000, 20*bs+1)
	e := hostOnly(t, 48, 25, p1)
	mustAdd(t, e, "loaded", p1, 1)
	if r := e.Step(); !r.LoadWait {
		t.Fatalf("the first step ran %+v, want a wait for the load", r)
	}
	mustAdd(t, e, "front", seqTokens(70000, 30*bs), 1) // 30 blocks: 28 are free beside the load's 20
	e.promoteLoads()
	front := e.byID["front"]
	e.waiting.remove(front)
	e.waiting.pushFront(front)
	cached, _, _ := runAll(t, e)
	if len(cached) != 2 {
		t.Fatalf("%d of 2 requests answered", len(cached))
	}
}
