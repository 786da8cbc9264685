package index

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/kv"
)

var allTiers = []kv.StorageTier{kv.TierDevice, kv.TierHostPinned, kv.TierDisk, kv.TierExternal}

// tieredRef is the brute-force definition of a tiered index: one
// reference model per tier, a lower tier resolving parents the worker
// holds on another tier (the device first).
type tieredRef map[kv.StorageTier]*refModel

func newTieredRef() tieredRef {
	r := tieredRef{}
	for _, tier := range allTiers {
		r[tier] = newRef()
	}
	for _, tier := range allTiers[1:] {
		r[tier].foreign = func(w kv.Worker, id uint64) (uint64, bool) {
			for _, o := range allTiers {
				if o != tier {
					if seq, ok := r[o].ids[w][id]; ok {
						return seq, true
					}
				}
			}
			return 0, false
		}
	}
	return r
}

func (r tieredRef) apply(ev *kv.Event) error {
	m, ok := r[ev.Tier]
	if !ok {
		return ErrUnknownTier
	}
	if ev.Kind == kv.KindCleared && ev.Tier == kv.TierDevice {
		for _, m := range r {
			_ = m.apply(ev)
		}
		return nil
	}
	return m.apply(ev)
}

func (r tieredRef) removeWorker(id uint64) {
	for _, m := range r {
		m.removeWorker(id)
	}
}

// run is from plus the run of seq from there that pred holds.
func run(seq []uint64, from uint32, pred func(uint64) bool) uint32 {
	for int(from) < len(seq) && pred(seq[from]) {
		from++
	}
	return from
}

// find is every matched worker's TierOverlap, and the shared pool's run
// from the root.
func (r tieredRef) find(seq []uint64) (map[kv.Worker]TierOverlap, uint32) {
	out := map[kv.Worker]TierOverlap{}
	dev := r[kv.TierDevice].find(seq)
	workers := map[kv.Worker]bool{}
	for w := range dev {
		workers[w] = true
	}
	for _, tier := range []kv.StorageTier{kv.TierHostPinned, kv.TierDisk} {
		for w, held := range r[tier].holds {
			if len(seq) > 0 && held[seq[0]] > 0 {
				workers[w] = true
			}
		}
	}
	pooled := func(seq uint64) bool {
		for _, held := range r[kv.TierExternal].holds {
			if held[seq] > 0 {
				return true
			}
		}
		return false
	}
	for w := range workers {
		o := TierOverlap{Worker: w, Device: dev[w]}
		o.Host = run(seq, o.Device, func(s uint64) bool { return r[kv.TierHostPinned].holds[w][s] > 0 })
		o.Disk = run(seq, o.Host, func(s uint64) bool { return r[kv.TierDisk].holds[w][s] > 0 })
		o.Shared = run(seq, o.Device, pooled) - o.Device
		out[w] = o
	}
	return out, run(seq, 0, pooled)
}

// tieredGen draws eventGen's streams over every tier: parents named on
// one tier are often held on another, and a few events carry a tier no
// engine publishes.
func tieredEvent(g *eventGen) kv.Event {
	ev := g.next()
	switch x := g.rng.IntN(100); {
	case x < 45:
	case x < 70:
		ev.Tier = kv.TierHostPinned
	case x < 88:
		ev.Tier = kv.TierDisk
	case x < 98:
		ev.Tier = kv.TierExternal
	default:
		ev.Tier = "floppy"
	}
	return ev
}

// tieredQueries are the paths to every node of every tier, each extended
// by a random block, plus random paths. A node hanging from another
// tier's block continues up that tier's path.
func tieredQueries(rng *rand.Rand, ix *Index) [][]uint64 {
	var trees []*tree
	for i := range ix.shards {
		for j := -1; j < lowerTiers; j++ {
			if t := ix.shards[i].tree(j); t != nil {
				trees = append(trees, t)
			}
		}
	}
	// up is where a root node's path continues: a deeper node elsewhere
	// with the same sequence hash.
	up := func(seq uint64) (*tree, uint32, bool) {
		for _, t := range trees {
			if n, ok := t.bySeq.get(seq, &t.nodes); ok && t.nodes.at(n).parent != rootParent {
				return t, n, true
			}
		}
		return nil, 0, false
	}
	var qs [][]uint64
	for _, t0 := range trees {
		for n0 := uint32(1); int(n0) < t0.nodes.len(); n0++ {
			if cur, ok := t0.bySeq.get(t0.nodes.at(n0).seq(), &t0.nodes); !ok || cur != n0 {
				continue
			}
			var path []uint64
			t, n := t0, n0
			for range 64 {
				nd := t.nodes.at(n)
				path = append(path, nd.seq())
				if nd.parent != rootParent {
					n = nd.parent
					continue
				}
				if nd.seq() == nd.local() {
					if t2, n2, ok := up(nd.seq()); ok {
						path = path[:len(path)-1]
						t, n = t2, n2
						continue
					}
				}
				break
			}
			slices.Reverse(path)
			qs = append(qs, append(path, blockhash.Chain(path[len(path)-1], rng.Uint64N(4))))
		}
	}
	for range 20 {
		path := make([]uint64, 1+rng.IntN(8))
		for i := range path {
			path[i] = rng.Uint64N(4)
		}
		qs = append(qs, blockhash.SequenceHashes(path))
	}
	return qs
}

func tiersMap(t *testing.T, ix *Index, m *Matcher, q []uint64) map[kv.Worker]TierOverlap {
	t.Helper()
	dev := asMap(t, ix.FindMatches(m, q))
	out := map[kv.Worker]TierOverlap{}
	if !ix.hasLower.Load() {
		for w, d := range dev {
			out[w] = TierOverlap{Worker: w, Device: d, Host: d, Disk: d}
		}
	}
	for _, o := range m.Tiers() {
		if _, dup := out[o.Worker]; dup {
			t.Fatalf("worker %v reported twice", o.Worker)
		}
		if o.Device != dev[o.Worker] {
			t.Fatalf("%v: tiers say device %d, FindMatches %d", o.Worker, o.Device, dev[o.Worker])
		}
		out[o.Worker] = o
	}
	return out
}

func (ix *Index) checkTiers() error {
	for i := range ix.shards {
		for j := -1; j < lowerTiers; j++ {
			if t := ix.shards[i].tree(j); t != nil {
				if err := t.check(); err != nil {
					return fmt.Errorf("shard %d tier %d: %w", i, j, err)
				}
			}
		}
	}
	return nil
}

func TestTieredIndexAgreesWithReferenceModel(t *testing.T) {
	for seed := uint64(1); seed <= 24; seed++ {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			g := newGen(seed)
			ix := New(Config{Shards: 1 + int(seed%4)})
			ref := newTieredRef()
			var m Matcher
			for step := 0; step < 3000; step++ {
				ev := tieredEvent(g)
				if step%500 == 499 {
					id := uint64(1 + g.rng.IntN(3))
					ix.RemoveWorker(id)
					ref.removeWorker(id)
					continue
				}
				wantErr := ref.apply(&ev)
				if err := ix.Apply(&ev); err != wantErr {
					t.Fatalf("step %d %v %s: Apply = %v, reference %v", step, ev.Kind, ev.Tier, err, wantErr)
				}
				if step%50 != 0 {
					continue
				}
				if err := ix.checkTiers(); err != nil {
					t.Fatalf("step %d: %v", step, err)
				}
				for _, q := range tieredQueries(g.rng, ix) {
					got := tiersMap(t, ix, &m, q)
					want, root := ref.find(q)
					if !maps.Equal(got, want) {
						t.Fatalf("step %d: tiers %v, reference %v", step, got, want)
					}
					if m.SharedRoot() != root {
						t.Fatalf("step %d: shared root %d, reference %d", step, m.SharedRoot(), root)
					}
				}
				for _, w := range g.workers {
					if got, want := ix.Blocks(w), len(ref[kv.TierDevice].ids[w]); got != want {
						t.Fatalf("step %d: Blocks(%v) = %d, reference %d", step, w, got, want)
					}
				}
			}
			if st := ix.Stats(); st.UnknownTier == 0 || st.UnknownParent == 0 {
				t.Fatalf("stream did not exercise every rejection: %+v", st)
			}
		})
	}
}

// A block the GPU evicts and the host keeps stays matched, on the host
// tier; a removal on one medium leaves the others.
func TestBlockOffloadedToHostStaysMatchedOnHost(t *testing.T) {
	w := kv.Worker{ID: 1}
	ix := New(Config{Shards: 2})
	blocks := []kv.Block{{EngineHash: 10, LocalHash: 1}, {EngineHash: 11, LocalHash: 2}, {EngineHash: 12, LocalHash: 3}}
	seq := blockhash.SequenceHashes([]uint64{1, 2, 3})
	apply := func(ev kv.Event, tier kv.StorageTier) {
		t.Helper()
		ev.Tier = tier
		if err := ix.Apply(&ev); err != nil {
			t.Fatal(err)
		}
	}
	var m Matcher
	want := func(dev, host uint32) {
		t.Helper()
		got := tiersMap(t, ix, &m, seq)[w]
		if got.Device != dev || got.Host != host || got.Disk != host {
			t.Fatalf("device %d host %d disk %d, want device %d host %d", got.Device, got.Host, got.Disk, dev, host)
		}
	}
	apply(kv.StoredEvent(w, 1, nil, blocks...), kv.TierDevice)
	// The offloading connector copies the tail to the host, below a
	// parent it holds on the GPU only.
	apply(kv.StoredEvent(w, 2, kv.Ptr(uint64(11)), blocks[2]), kv.TierHostPinned)
	want(3, 3)
	apply(kv.RemovedEvent(w, 3, 12), kv.TierDevice)
	want(2, 3)
	if got := ix.Blocks(w); got != 2 {
		t.Fatalf("device blocks %d, want 2", got)
	}
	apply(kv.StoredEvent(w, 4, nil, blocks[:2]...), kv.TierHostPinned)
	apply(kv.RemovedEvent(w, 5, 10, 11), kv.TierDevice)
	want(0, 3)
	apply(kv.RemovedEvent(w, 6, 11), kv.TierHostPinned)
	want(0, 1)
	ev := kv.ClearedEvent(w, 7)
	ev.Tier = "floppy"
	if err := ix.Apply(&ev); err != ErrUnknownTier {
		t.Fatalf("unknown tier: %v", err)
	}
	want(0, 1)
}

func TestTieredDumpReplaysToEqualIndex(t *testing.T) {
	for seed := uint64(1); seed <= 6; seed++ {
		g := newGen(seed)
		ix := New(Config{Shards: 3})
		for range 2000 {
			ev := tieredEvent(g)
			_ = ix.Apply(&ev)
		}
		dump := ix.Dump()
		replay := New(Config{Shards: 3})
		tiers := map[kv.StorageTier]bool{}
		for i := range dump {
			tiers[dump[i].Tier] = true
			if err := replay.Apply(&dump[i]); err != nil {
				t.Fatalf("seed %d: replaying dump event %d: %v", seed, i, err)
			}
		}
		if len(tiers) != len(allTiers) {
			t.Fatalf("seed %d: dump has tiers %v", seed, tiers)
		}
		if err := replay.checkTiers(); err != nil {
			t.Fatal(err)
		}
		var m1, m2 Matcher
		for _, q := range tieredQueries(g.rng, ix) {
			a, b := tiersMap(t, ix, &m1, q), tiersMap(t, replay, &m2, q)
			if !maps.Equal(a, b) {
				t.Fatalf("seed %d: tiers after replay %v, before %v", seed, b, a)
			}
		}
		// The device tier's dump stays the same for equal indexes.
		var dev, again []string
		for _, ev := range dump {
			if ev.Tier == kv.TierDevice {
				dev = append(dev, dumpLine(ev))
			}
		}
		for _, ev := range replay.Dump() {
			if ev.Tier == kv.TierDevice {
				again = append(again, dumpLine(ev))
			}
		}
		if !slices.Equal(dev, again) {
			t.Fatalf("seed %d: device dump differs after replay", seed)
		}
	}
}

func TestTieredMemoryCapHoldsAndEvictsLowerTiersFirst(t *testing.T) {
	g := newGen(99)
	g.freshIDs = true
	ix := New(Config{Shards: 1, MaxPairs: 40})
	ref := newTieredRef()
	var m Matcher
	for step := 0; step < 5000; step++ {
		ev := tieredEvent(g)
		_ = ref.apply(&ev)
		_ = ix.Apply(&ev)
		if ix.Pairs() > 40 {
			t.Fatalf("step %d: %d pairs above the cap", step, ix.Pairs())
		}
		if step%100 != 0 {
			continue
		}
		if err := ix.checkTiers(); err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		for _, q := range tieredQueries(g.rng, ix) {
			want, _ := ref.find(q)
			for w, o := range tiersMap(t, ix, &m, q) {
				if r := want[w]; o.Device > r.Device || o.Host > r.Host || o.Disk > r.Disk {
					t.Fatalf("step %d: capped index claims %+v on %v, truth %+v", step, o, w, r)
				}
			}
		}
	}
	if ix.Stats().PairsEvicted == 0 {
		t.Fatal("cap never evicted")
	}
}

// A clear of the device (an engine's reset, or the clear a router makes
// before loading a dump) drops the rank on every tier, so that the dump
// rebuilds every tier exactly; a clear naming a lower tier drops that
// tier only.
func TestDeviceClearDropsTheRankOnEveryTier(t *testing.T) {
	w, other := kv.Worker{ID: 1}, kv.Worker{ID: 2}
	ix := New(Config{Shards: 1})
	for _, wk := range []kv.Worker{w, other} {
		for i, tier := range allTiers {
			ev := kv.StoredEvent(wk, 0, nil, kv.Block{EngineHash: uint64(10 + i), LocalHash: uint64(1 + i)})
			ev.Tier = tier
			if err := ix.Apply(&ev); err != nil {
				t.Fatal(err)
			}
		}
	}
	held := func(wk kv.Worker) (n int) {
		for _, tier := range allTiers {
			h, _ := ix.HeldOn(wk, tier)
			n += len(h)
		}
		return n
	}
	clr := kv.ClearedEvent(w, 0)
	clr.Tier = kv.TierDisk
	if err := ix.Apply(&clr); err != nil {
		t.Fatal(err)
	}
	if h, _ := ix.HeldOn(w, kv.TierDisk); len(h) != 0 || held(w) != 3 {
		t.Fatalf("a disk clear left %d disk blocks, %d in all (want 0, 3)", len(h), held(w))
	}
	clr.Tier = kv.TierDevice
	if err := ix.Apply(&clr); err != nil {
		t.Fatal(err)
	}
	if held(w) != 0 || held(other) != 4 {
		t.Fatalf("after a device clear: %d blocks left, the other worker %d (want 0, 4)", held(w), held(other))
	}
	var m Matcher
	seq := blockhash.SequenceHashes([]uint64{2})
	if got := tiersMap(t, ix, &m, seq); got[w] != (TierOverlap{}) || got[other].Host != 1 {
		t.Fatalf("tiers after the clear: %v", got)
	}
}

// Removals and clears of a tier nothing was stored on are no-ops that keep
// lookups on the device-only path.
func TestRemovalFromAnEmptyTierKeepsTheDeviceOnlyPath(t *testing.T) {
	w := kv.Worker{ID: 1}
	ix := New(Config{Shards: 2})
	st := kv.StoredEvent(w, 0, nil, kv.Block{EngineHash: 10, LocalHash: 1})
	if err := ix.Apply(&st); err != nil {
		t.Fatal(err)
	}
	rm, clr := kv.RemovedEvent(w, 0, 10), kv.ClearedEvent(w, 0)
	rm.Tier, clr.Tier = kv.TierHostPinned, kv.TierExternal
	for _, ev := range []kv.Event{rm, clr} {
		if err := ix.Apply(&ev); err != nil {
			t.Fatal(err)
		}
	}
	if ix.hasLower.Load() {
		t.Fatal("a removal made a lower tier")
	}
	if got := ix.Blocks(w); got != 1 {
		t.Fatalf("device blocks %d, want 1", got)
	}
	if st := ix.Stats(); st.UnknownBlocks != 1 || st.RemovedEvents != 1 || st.ClearedEvents != 1 {
		t.Fatalf("stats %+v", st)
	}
	bad := kv.Event{Worker: w, Tier: kv.TierDisk, Kind: kv.Kind(99)}
	if err := ix.Apply(&bad); err != ErrUnknownKind {
		t.Fatalf("unknown kind on an empty tier: %v", err)
	}
}

// The cap evicts the slowest tier first: no host block goes while a disk
// block is left, no device block while a host or disk block is.
func TestMemoryCapEvictsDiskThenHostThenDevice(t *testing.T) {
	w := kv.Worker{ID: 1}
	ix := New(Config{Shards: 1, MaxPairs: 100})
	chain := func(tier kv.StorageTier, base uint64, n int) {
		for i := range n {
			var parent *uint64
			if i > 0 {
				parent = kv.Ptr(base + uint64(i-1))
			}
			ev := kv.StoredEvent(w, 0, parent, kv.Block{EngineHash: base + uint64(i), LocalHash: base + uint64(i)})
			ev.Tier = tier
			if err := ix.Apply(&ev); err != nil {
				t.Fatal(err)
			}
		}
	}
	held := func(tier kv.StorageTier) int {
		h, _ := ix.HeldOn(w, tier)
		return len(h)
	}
	chain(kv.TierHostPinned, 1000, 30)
	chain(kv.TierDisk, 2000, 30)
	stored := 0
	for stored < 90 {
		stored += 10
		chain(kv.TierDevice, 0, stored) // the chain grows by 10 blocks
		dev, host, disk := held(kv.TierDevice), held(kv.TierHostPinned), held(kv.TierDisk)
		if dev+host+disk > 100 {
			t.Fatalf("%d device blocks stored: %d+%d+%d pairs above the cap", stored, dev, host, disk)
		}
		if dev < stored && host+disk > 0 || host < 30 && disk > 0 {
			t.Fatalf("%d device blocks stored: device %d, host %d, disk %d: a faster tier lost blocks first", stored, dev, host, disk)
		}
	}
	if held(kv.TierDisk) != 0 || held(kv.TierHostPinned) > 10 || held(kv.TierDevice) != 90 {
		t.Fatalf("device %d, host %d, disk %d at the end", held(kv.TierDevice), held(kv.TierHostPinned), held(kv.TierDisk))
	}
}

// Lookups allocate nothing, on a device-only index and, once the
// matcher's scratch has grown, on a tiered one.
func TestFindMatchesAllocatesNothing(t *testing.T) {
	for _, offload := range []int{0, 16} {
		ix := New(Config{Shards: 4})
		qs := offloadedFleet(ix, 16, 2, 64, 8, offload, rand.New(rand.NewPCG(5, 6)))
		if ix.hasLower.Load() != (offload > 0) {
			t.Fatalf("offload %d: lower tiers %v", offload, ix.hasLower.Load())
		}
		var m Matcher
		for _, q := range qs {
			ix.FindMatches(&m, q)
		}
		i := 0
		if a := testing.AllocsPerRun(100, func() { ix.FindMatches(&m, qs[i%len(qs)]); i++ }); a != 0 {
			t.Fatalf("offload %d: %.1f allocations per lookup", offload, a)
		}
	}
}
