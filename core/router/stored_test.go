package router

import (
	"fmt"
	"math/rand/v2"
	"reflect"
	"runtime"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/kv"
)

// A stored event handed its blocks' local hashes, all or the first few,
// becomes the event hashing gives, with salts, adapters and multimodal
// items; a wrong hash shows in the event.
func TestHashEngineStoredTakesLocalHashes(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	for k := range 300 {
		n := 1 + rng.IntN(6)
		es := EngineStored{Worker: w(1), EngineHashes: make([]uint64, n), Tokens: make([]uint32, n*bs+rng.IntN(bs)), BlockSize: bs}
		for i := range es.EngineHashes {
			es.EngineHashes[i] = rng.Uint64()
		}
		for i := range es.Tokens {
			es.Tokens[i] = rng.Uint32N(1000)
		}
		switch k % 4 {
		case 1:
			es.Salt = "s"
		case 2:
			es.LoRA = "a"
		case 3:
			es.MM = make([][]uint64, n)
			es.MM[rng.IntN(n)] = []uint64{rng.Uint64()}
		}
		want, _, err := HashEngineStored(&es, bs)
		if err != nil {
			t.Fatal(err)
		}
		local := make([]uint64, n)
		for i, b := range want.Stored.Blocks {
			local[i] = b.LocalHash
		}
		es.LocalHashes = local[:rng.IntN(n+1)]
		if got, _, _ := HashEngineStored(&es, bs); !reflect.DeepEqual(got, want) {
			t.Fatalf("event %d, %d of %d local hashes handed over: %+v, hashed %+v", k, len(es.LocalHashes), n, got, want)
		}
		if len(es.LocalHashes) > 0 {
			es.LocalHashes[0]++
			if got, _, _ := HashEngineStored(&es, bs); reflect.DeepEqual(got, want) {
				t.Fatalf("event %d: a wrong local hash changed nothing", k)
			}
		}
	}
}

// A request handed its local hashes is routed as one the router hashes
// itself, and one whose hashes do not fit its prompt is hashed.
func TestSubmitTakesLocalHashes(t *testing.T) {
	for _, salt := range []string{"", "s"} {
		r, _ := newRouter(t, 3, nil)
		for wk := range 3 {
			es := EngineStored{Worker: w(uint64(wk)), EngineHashes: []uint64{uint64(wk)*10 + 1, uint64(wk)*10 + 2, uint64(wk)*10 + 3}, Tokens: tokens(1, 2+wk%2, 7+wk, 3), BlockSize: bs, Salt: salt}
			if err := r.ApplyEngineStored(&es); err != nil {
				t.Fatal(err)
			}
		}
		prompt := tokens(1, 3, 9, 4)
		local := blockhash.NewKeyed(bs, "", salt).AppendLocalHashes(nil, prompt)
		for i, hashes := range [][]uint64{nil, local, local[:2], append(local, 1)} {
			d, err := r.BestWorker(ctx(), &Request{Tokens: prompt, CacheSalt: salt, LocalHashes: hashes})
			if err != nil {
				t.Fatal(err)
			}
			if d.Worker != w(1) || d.OverlapBlocks != 3 {
				t.Errorf("salt %q, hashes %d: %v with %d blocks, want worker 1 with 3", salt, i, d.Worker, d.OverlapBlocks)
			}
		}
		wrong := append([]uint64(nil), local...)
		wrong[0]++
		if d, err := r.BestWorker(ctx(), &Request{Tokens: prompt, CacheSalt: salt, LocalHashes: wrong}); err != nil || d.OverlapBlocks != 0 {
			t.Errorf("salt %q: wrong local hashes credited %d blocks (%v)", salt, d.OverlapBlocks, err)
		}
		// Sequence hashes with them are taken too; without local hashes,
		// or of another length, ignored.
		seq := blockhash.SequenceHashes(local)
		for i, c := range []struct {
			local, seq []uint64
			overlap    int
		}{{local, seq, 3}, {nil, seq, 3}, {local, seq[:2], 3}, {local, slices.Concat(seq[:1], []uint64{5, 6, 7}), 1}} {
			d, err := r.BestWorker(ctx(), &Request{Tokens: prompt, CacheSalt: salt, LocalHashes: c.local, SeqHashes: c.seq})
			if err != nil {
				t.Fatal(err)
			}
			if d.OverlapBlocks != c.overlap {
				t.Errorf("salt %q, sequence hashes %d: %d blocks credited, want %d", salt, i, d.OverlapBlocks, c.overlap)
			}
		}
	}
}

// Stored events applied one after another, long and short, each build
// their blocks in a list the one before used: every block is indexed as
// its own event had it, and the lists cost no allocation.
func TestApplyEngineStoredReusesBlockLists(t *testing.T) {
	r, _ := newRouter(t, 3, nil)
	rng := rand.New(rand.NewPCG(9, 10))
	prompts := make([][]uint32, 3)
	for k := range 60 {
		wk := k % 3
		n := 1 + rng.IntN(12)
		toks := make([]uint32, n*bs)
		for i := range toks {
			toks[i] = rng.Uint32N(50)
		}
		ids := make([]uint64, n)
		for i := range ids {
			ids[i] = uint64(k)<<8 | uint64(i)
		}
		if err := r.ApplyEngineStored(&EngineStored{Worker: w(uint64(wk)), EngineHashes: ids, Tokens: toks, BlockSize: bs}); err != nil {
			t.Fatal(err)
		}
		prompts[wk] = toks
		for pw, p := range prompts {
			if p == nil {
				continue
			}
			d, err := r.BestWorker(ctx(), &Request{Tokens: p, Only: []uint64{uint64(pw)}})
			if err != nil {
				t.Fatal(err)
			}
			if d.OverlapBlocks != len(p)/bs {
				t.Fatalf("event %d: worker %d's last prompt credited %d blocks of %d", k, pw, d.OverlapBlocks, len(p)/bs)
			}
		}
	}
	toks := prompts[0]
	local := blockhash.New(bs, "").LocalHashes(toks)
	ids := make([]uint64, len(local))
	next := uint64(1) << 40
	if allocs := testing.AllocsPerRun(100, func() {
		for i := range ids {
			next++
			ids[i] = next
		}
		if err := r.ApplyEngineStored(&EngineStored{Worker: w(0), EngineHashes: ids, Tokens: toks, BlockSize: bs, LocalHashes: local}); err != nil {
			t.Fatal(err)
		}
	}); allocs > 0 {
		t.Errorf("%v allocations per stored event", allocs)
	}
}

// BenchmarkHashEngineStored: a stored event of 8 blocks of 512 tokens,
// hashed, or with the local hashes the router computed at routing.
func BenchmarkHashEngineStored(b *testing.B) {
	const n, size = 8, 512
	es := EngineStored{Worker: w(1), EngineHashes: make([]uint64, n), Tokens: make([]uint32, n*size), BlockSize: size}
	for i := range es.Tokens {
		es.Tokens[i] = uint32(i * 7919 % 128000)
	}
	local := blockhash.NewKeyed(size, "", "").AppendLocalHashes(nil, es.Tokens)
	for _, supplied := range []bool{false, true} {
		b.Run(fmt.Sprint(map[bool]string{false: "hashed", true: "supplied"}[supplied]), func(b *testing.B) {
			if supplied {
				es.LocalHashes = local
			}
			b.ReportAllocs()
			for b.Loop() {
				if _, _, err := HashEngineStored(&es, size); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// A request that lends its hashes is routed as one whose hashes the
// router copies, and while the admission queue holds it the router keeps
// no copy of them; once it is dispatched they are the caller's again:
// later requests, whose hashes the router copies, never write there.
func TestSubmitKeepsLentHashesWithoutCopying(t *testing.T) {
	const n, blocks = 40, 512
	type routed struct {
		worker               kv.Worker
		overlap, prompt, ord int
	}
	run := func(lend bool) (got []routed, perRequest uint64) {
		r, c := newRouter(t, 1, func(c *Config) {
			q := 1.0
			c.QueueThreshold = &q
		})
		r.AddWorker(WorkerInfo{ID: 0, TotalKVBlocks: 100_000, MaxNumBatchedTokens: 100})
		record := func(d Decision, err error) {
			if err != nil {
				t.Error(err)
			}
			got = append(got, routed{d.Worker, d.OverlapBlocks, d.PromptBlocks, len(got)})
		}
		if _, queued, err := r.Submit(&Request{ID: "big", Tokens: tokens(1, 0, 1, 10)}, record); err != nil || queued {
			t.Fatalf("first request: queued %v, %v", queued, err)
		}
		reqs := make([]Request, n)
		var lists, kept [][]uint64
		for i := range reqs {
			toks := tokens(2, blocks/2, 3+i, blocks)
			local := blockhash.NewKeyed(bs, "", "").AppendLocalHashes(nil, toks)
			seq := blockhash.SequenceHashes(local)
			reqs[i] = Request{ID: strconv.Itoa(i), Tokens: toks, LocalHashes: local, SeqHashes: seq, LentHashes: lend}
			lists = append(lists, local, seq)
			kept = append(kept, slices.Clone(local), slices.Clone(seq))
		}
		var before, after runtime.MemStats
		runtime.ReadMemStats(&before)
		for i := range reqs {
			if _, queued, err := r.Submit(&reqs[i], record); err != nil || !queued {
				t.Fatalf("request %d: queued %v, %v", i, queued, err)
			}
		}
		runtime.ReadMemStats(&after)
		c.advance(time.Second)
		r.MarkPrefillCompleted("big")
		for pass := 0; len(got) < n && pass < n; pass++ {
			for i := range reqs {
				r.MarkPrefillCompleted(reqs[i].ID)
			}
		}
		if len(got) != n {
			t.Fatalf("%d of %d queued requests dispatched", len(got), n)
		}
		for i := range 2 * n {
			toks := tokens(4, 0, 100+i, blocks)
			if _, err := r.BestWorker(ctx(), &Request{Tokens: toks, LocalHashes: blockhash.NewKeyed(bs, "", "").AppendLocalHashes(nil, toks)}); err != nil {
				t.Fatal(err)
			}
		}
		for k := range lists {
			if !slices.Equal(lists[k], kept[k]) {
				t.Fatalf("lend %v: hash list %d changed after its request was dispatched", lend, k)
			}
		}
		return got, (after.TotalAlloc - before.TotalAlloc) / n
	}
	copied, copiedBytes := run(false)
	lent, lentBytes := run(true)
	t.Logf("bytes allocated per queued request: %d lending its hashes, %d copied", lentBytes, copiedBytes)
	if !slices.Equal(lent, copied) {
		t.Fatalf("lent hashes routed\n%+v\ncopied ones\n%+v", lent, copied)
	}
	// One list is 8 bytes a block: copying both is twice that.
	if list := uint64(8 * blocks); lentBytes >= list || copiedBytes < 2*list {
		t.Fatalf("%d bytes allocated per queued request lending its hashes, %d per one copied, for lists of %d bytes", lentBytes, copiedBytes, list)
	}
}
