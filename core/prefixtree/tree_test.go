package prefixtree

import (
	"math/rand/v2"
	"slices"
	"testing"
)

// refTrie is the brute-force reference: one node per token, so matching and
// sizes need no edge arithmetic. Eviction must still happen by whole edges
// of the compressed tree, and those depend on history (an edge is cut where
// an insert diverged or ended inside it, and stays cut), so the reference
// records edge starts explicitly and evicts by scanning every node.
type refTrie struct {
	root    *refNode
	max     int
	size    int
	evicted uint64
	tick    uint64
}

type refNode struct {
	parent    *refNode
	tok       uint32
	kids      map[uint32]*refNode
	stamp     int64
	tick      uint64
	edgeStart bool
}

func newRef(max int) *refTrie {
	return &refTrie{root: &refNode{kids: map[uint32]*refNode{}}, max: max}
}

func (r *refTrie) insert(tokens []uint32, now int64) {
	if len(tokens) == 0 {
		return
	}
	r.tick++
	n, created := r.root, false
	for _, tok := range tokens {
		c := n.kids[tok]
		if c == nil {
			c = &refNode{parent: n, tok: tok, kids: map[uint32]*refNode{}}
			if !created {
				// Diverging here cuts whatever edge passed through n, and
				// the new branch starts an edge of its own.
				for _, k := range n.kids {
					k.edgeStart = true
				}
				c.edgeStart = true
				created = true
			}
			n.kids[tok] = c
			r.size++
		}
		c.stamp, c.tick = now, r.tick
		n = c
	}
	if !created {
		// Ending inside an edge cuts it there.
		for _, k := range n.kids {
			k.edgeStart = true
		}
	}
	for r.max > 0 && r.size > r.max {
		var oldest *refNode
		r.walk(func(n *refNode) {
			if len(n.kids) == 0 && (oldest == nil || n.stamp < oldest.stamp ||
				n.stamp == oldest.stamp && n.tick < oldest.tick) {
				oldest = n
			}
		})
		for {
			p := oldest.parent
			delete(p.kids, oldest.tok)
			r.size--
			r.evicted++
			if oldest.edgeStart {
				break
			}
			oldest = p
		}
	}
}

func (r *refTrie) walk(f func(*refNode)) {
	var rec func(*refNode)
	rec = func(n *refNode) {
		for _, c := range n.kids {
			f(c)
			rec(c)
		}
	}
	rec(r.root)
}

func (r *refTrie) match(tokens []uint32) int {
	n := r.root
	for i, tok := range tokens {
		if n = n.kids[tok]; n == nil {
			return i
		}
	}
	return len(tokens)
}

// checkInvariants walks the whole tree and its heap.
func checkInvariants(t *testing.T, tr *Tree) {
	t.Helper()
	size, leaves := 0, 0
	var rec func(n *node)
	rec = func(n *node) {
		var kids []*node
		if n.big != nil {
			if n.keys != nil || n.kids != nil {
				t.Fatalf("node has both a child map and child slices")
			}
			for k, c := range n.big {
				if c.label[0] != k {
					t.Fatalf("child keyed %d has label starting %d", k, c.label[0])
				}
				kids = append(kids, c)
			}
		} else {
			if len(n.keys) != len(n.kids) || len(n.kids) > maxSliceChildren {
				t.Fatalf("child slices: %d keys, %d kids", len(n.keys), len(n.kids))
			}
			for i, c := range n.kids {
				if c.label[0] != n.keys[i] {
					t.Fatalf("child keyed %d has label starting %d", n.keys[i], c.label[0])
				}
				if slices.Index(n.keys, n.keys[i]) != i {
					t.Fatalf("duplicate child key %d", n.keys[i])
				}
			}
			kids = n.kids
		}
		if n != tr.root {
			if len(n.label) == 0 {
				t.Fatalf("empty label below the root")
			}
			size += len(n.label)
			if len(kids) == 0 {
				leaves++
				if n.heapIdx < 0 || int(n.heapIdx) >= len(tr.leaves) || tr.leaves[n.heapIdx] != n {
					t.Fatalf("leaf not at its heap index %d", n.heapIdx)
				}
			} else if n.heapIdx != -1 {
				t.Fatalf("inner node in the heap at %d", n.heapIdx)
			}
		} else if n.heapIdx != -1 {
			t.Fatalf("root in the heap")
		}
		for _, c := range kids {
			if c.parent != n {
				t.Fatalf("bad parent pointer")
			}
			if n != tr.root && older(n, c) {
				t.Fatalf("parent stamp (%d,%d) older than child (%d,%d)", n.stamp, n.tick, c.stamp, c.tick)
			}
			rec(c)
		}
	}
	rec(tr.root)
	if size != tr.Size() {
		t.Fatalf("sum of edge lengths %d, Size() %d", size, tr.Size())
	}
	if leaves != len(tr.leaves) {
		t.Fatalf("%d leaves, heap holds %d", leaves, len(tr.leaves))
	}
	for i := 1; i < len(tr.leaves); i++ {
		if older(tr.leaves[i], tr.leaves[(i-1)/2]) {
			t.Fatalf("heap order broken at %d", i)
		}
	}
}

// workload draws sequences as a prefix from a small pool plus a random
// suffix over a small alphabet, so that inserts split edges often and
// queries stop inside edges.
type workload struct {
	rng  *rand.Rand
	pool [][]uint32
}

func newWorkload(seed uint64, poolSize, maxPrefix int) *workload {
	w := &workload{rng: rand.New(rand.NewPCG(seed, 42))}
	for range poolSize {
		w.pool = append(w.pool, w.tokens(w.rng.IntN(maxPrefix+1)))
	}
	// Pool entries extending one another make "insert an extension" and
	// "insert a prefix of a path" frequent.
	for i := 1; i < len(w.pool); i += 3 {
		w.pool[i] = append(slices.Clone(w.pool[i-1]), w.pool[i]...)
	}
	return w
}

func (w *workload) tokens(n int) []uint32 {
	s := make([]uint32, n)
	for i := range s {
		s[i] = uint32(w.rng.IntN(4))
	}
	return s
}

func (w *workload) seq(maxSuffix int) []uint32 {
	p := w.pool[w.rng.IntN(len(w.pool))]
	if cut := w.rng.IntN(4); cut == 0 && len(p) > 0 {
		p = p[:w.rng.IntN(len(p))]
	}
	return append(slices.Clone(p), w.tokens(w.rng.IntN(maxSuffix+1))...)
}

func lcp(a, b []uint32) int {
	n := 0
	for n < len(a) && n < len(b) && a[n] == b[n] {
		n++
	}
	return n
}

func TestMatchAgainstInsertedSequences(t *testing.T) {
	for seed := range uint64(5) {
		w := newWorkload(seed, 12, 40)
		tr := New(0)
		var inserted [][]uint32
		for step := range 1500 {
			s := w.seq(30)
			buf := slices.Clone(s)
			tr.Insert(buf, int64(step))
			clear(buf) // the tree must have copied it
			inserted = append(inserted, s)
			for range 4 {
				q := w.seq(30)
				want := 0
				for _, s := range inserted {
					want = max(want, lcp(q, s))
				}
				if got := tr.Match(q); got != want {
					t.Fatalf("seed %d step %d: Match = %d, want %d", seed, step, got, want)
				}
			}
			if got := tr.Match(s); got != len(s) {
				t.Fatalf("seed %d step %d: inserted sequence matches %d of %d", seed, step, got, len(s))
			}
			if step%50 == 0 {
				checkInvariants(t, tr)
			}
		}
		checkInvariants(t, tr)
		if tr.Evicted() != 0 {
			t.Fatalf("uncapped tree evicted %d tokens", tr.Evicted())
		}
	}
}

func TestCappedAgainstReference(t *testing.T) {
	for _, tc := range []struct {
		name      string
		cap       int
		sameClock bool
	}{
		{"cap 200", 200, false},
		{"cap 60", 60, false},
		{"cap 15 below many sequences", 15, false},
		{"cap 200 coarse clock", 200, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for seed := range uint64(4) {
				w := newWorkload(seed, 10, 30)
				tr, ref := New(tc.cap), newRef(tc.cap)
				for step := range 1500 {
					s := w.seq(25)
					now := int64(step)
					if tc.sameClock {
						now /= 7
					}
					tr.Insert(s, now)
					ref.insert(s, now)
					if tr.Size() > tc.cap {
						t.Fatalf("step %d: Size %d above cap %d", step, tr.Size(), tc.cap)
					}
					if tr.Size() != ref.size || tr.Evicted() != ref.evicted {
						t.Fatalf("seed %d step %d: size %d evicted %d, reference %d, %d",
							seed, step, tr.Size(), tr.Evicted(), ref.size, ref.evicted)
					}
					if len(s) <= tc.cap {
						if got := tr.Match(s); got != len(s) {
							t.Fatalf("step %d: newest sequence matches %d of %d", step, got, len(s))
						}
					}
					for range 4 {
						q := w.seq(25)
						if got, want := tr.Match(q), ref.match(q); got != want {
							t.Fatalf("seed %d step %d: Match = %d, reference %d", seed, step, got, want)
						}
					}
					if step%25 == 0 {
						checkInvariants(t, tr)
						checkSurvivors(t, tr)
					}
				}
			}
		})
	}
}

// checkSurvivors rebuilds the set of surviving sequences from the tree's
// root-to-leaf paths and checks that Size counts each distinct non-empty
// prefix once and that Match agrees with a scan over those sequences.
func checkSurvivors(t *testing.T, tr *Tree) {
	t.Helper()
	var paths [][]uint32
	var rec func(n *node, path []uint32)
	rec = func(n *node, path []uint32) {
		path = append(slices.Clone(path), n.label...)
		kids := n.kids
		for _, c := range n.big {
			kids = append(kids, c)
		}
		if len(kids) == 0 && n != tr.root {
			paths = append(paths, path)
		}
		for _, c := range kids {
			rec(c, path)
		}
	}
	rec(tr.root, nil)
	prefixes := map[string]bool{}
	for _, p := range paths {
		for i := 1; i <= len(p); i++ {
			prefixes[string(encode(p[:i]))] = true
		}
		if got := tr.Match(p); got != len(p) {
			t.Fatalf("surviving path matches %d of %d", got, len(p))
		}
	}
	if len(prefixes) != tr.Size() {
		t.Fatalf("%d distinct prefixes, Size %d", len(prefixes), tr.Size())
	}
}

func encode(s []uint32) []byte {
	b := make([]byte, 0, 4*len(s))
	for _, v := range s {
		b = append(b, byte(v), byte(v>>8), byte(v>>16), byte(v>>24))
	}
	return b
}

func seqOf(start uint32, n int) []uint32 {
	s := make([]uint32, n)
	for i := range s {
		s[i] = start + uint32(i)
	}
	return s
}

func TestEvictsOldestLeafFirst(t *testing.T) {
	a, b, c := seqOf(100, 10), seqOf(200, 20), seqOf(300, 30)
	tr := New(55)
	tr.Insert(a, 1)
	tr.Insert(b, 2)
	tr.Insert(c, 3) // 60 > 55: A, the oldest, goes whole
	if got := tr.Match(a); got != 0 {
		t.Fatalf("A should be evicted, matches %d", got)
	}
	if tr.Match(b) != 20 || tr.Match(c) != 30 || tr.Size() != 50 || tr.Evicted() != 10 {
		t.Fatalf("B %d C %d size %d evicted %d", tr.Match(b), tr.Match(c), tr.Size(), tr.Evicted())
	}

	// Matching is read-only: asking about B does not save it.
	tr.Match(b)
	// Re-inserting a prefix of C splits C's edge, refreshing the prefix
	// only; A comes back and B is now the oldest leaf.
	tr.Insert(c[:5], 4)
	tr.Insert(a, 5) // 60 > 55: B goes
	if tr.Match(b) != 0 || tr.Match(a) != 10 || tr.Match(c) != 30 || tr.Size() != 40 {
		t.Fatalf("after refresh: A %d B %d C %d size %d", tr.Match(a), tr.Match(b), tr.Match(c), tr.Size())
	}
	// C's tail (25 tokens, stamp 3) is now older than its refreshed head
	// (stamp 4) and A (stamp 5): a 20-token D evicts the tail only.
	d := seqOf(400, 20)
	tr.Insert(d, 6)
	if tr.Match(c) != 5 || tr.Match(a) != 10 || tr.Match(d) != 20 || tr.Size() != 35 {
		t.Fatalf("after D: C %d A %d D %d size %d", tr.Match(c), tr.Match(a), tr.Match(d), tr.Size())
	}
	// C's head became a leaf with stamp 4, the oldest: it goes next.
	tr.Insert(seqOf(500, 25), 7)
	if tr.Match(c) != 0 || tr.Match(a) != 10 || tr.Match(d) != 20 || tr.Size() != 55 {
		t.Fatalf("after E: C %d A %d D %d size %d", tr.Match(c), tr.Match(a), tr.Match(d), tr.Size())
	}
	if tr.Evicted() != 10+20+25+5 {
		t.Fatalf("evicted %d", tr.Evicted())
	}
	checkInvariants(t, tr)
}

func TestSharedPrefixEvictsBranchesNotTrunk(t *testing.T) {
	sys := seqOf(1, 100)
	conv := func(id uint32, n int) []uint32 { return append(slices.Clone(sys), seqOf(id*1000, n)...) }
	tr := New(250)
	tr.Insert(conv(1, 50), 1)
	tr.Insert(conv(2, 50), 2)
	tr.Insert(conv(3, 60), 3) // 260 > 250: branch 1 goes, the trunk stays
	if tr.Match(conv(1, 50)) != 100 || tr.Match(conv(2, 50)) != 150 || tr.Match(conv(3, 60)) != 160 {
		t.Fatalf("matches %d %d %d", tr.Match(conv(1, 50)), tr.Match(conv(2, 50)), tr.Match(conv(3, 60)))
	}
	if tr.Size() != 210 || tr.Evicted() != 50 {
		t.Fatalf("size %d evicted %d", tr.Size(), tr.Evicted())
	}
	checkInvariants(t, tr)
}

func TestEdgeCases(t *testing.T) {
	t.Run("empty", func(t *testing.T) {
		tr := New(10)
		tr.Insert(nil, 1)
		tr.Insert([]uint32{}, 2)
		if tr.Size() != 0 || tr.Match(nil) != 0 || tr.Match([]uint32{1}) != 0 {
			t.Fatalf("size %d", tr.Size())
		}
		tr.Insert([]uint32{1, 2}, 3)
		if tr.Match(nil) != 0 {
			t.Fatalf("empty query matched")
		}
		checkInvariants(t, tr)
	})
	t.Run("prefix of existing path", func(t *testing.T) {
		tr := New(0)
		tr.Insert([]uint32{1, 2, 3, 4}, 1)
		tr.Insert([]uint32{1, 2}, 2)
		if tr.Size() != 4 || tr.Match([]uint32{1, 2, 3, 4, 5}) != 4 || tr.Match([]uint32{1, 2, 9}) != 2 {
			t.Fatalf("size %d", tr.Size())
		}
		checkInvariants(t, tr)
	})
	t.Run("extension", func(t *testing.T) {
		tr := New(0)
		tr.Insert([]uint32{1, 2}, 1)
		tr.Insert([]uint32{1, 2, 3, 4}, 2)
		if tr.Size() != 4 || tr.Match([]uint32{1, 2, 3, 4}) != 4 || tr.Match([]uint32{1, 2, 3, 5}) != 3 {
			t.Fatalf("size %d", tr.Size())
		}
		checkInvariants(t, tr)
	})
	t.Run("identical re-insert", func(t *testing.T) {
		tr := New(0)
		s := []uint32{5, 6, 7}
		for i := range 5 {
			tr.Insert(s, int64(i))
		}
		if tr.Size() != 3 || len(tr.leaves) != 1 || tr.Match(s) != 3 {
			t.Fatalf("size %d leaves %d", tr.Size(), len(tr.leaves))
		}
		checkInvariants(t, tr)
	})
	t.Run("diverge inside an edge", func(t *testing.T) {
		tr := New(0)
		tr.Insert([]uint32{1, 2, 3, 4}, 1)
		tr.Insert([]uint32{1, 2, 9, 9}, 2)
		if tr.Size() != 6 || tr.Match([]uint32{1, 2, 3}) != 3 || tr.Match([]uint32{1, 2, 9, 9, 9}) != 4 {
			t.Fatalf("size %d", tr.Size())
		}
		checkInvariants(t, tr)
	})
	t.Run("sequence longer than the cap", func(t *testing.T) {
		// The new path is one leaf edge of 20 tokens: evicting it whole is
		// the only way back under the cap, so the tree ends up empty.
		tr := New(10)
		tr.Insert(seqOf(1, 5), 1)
		tr.Insert(seqOf(100, 20), 2)
		if tr.Size() != 0 || tr.Evicted() != 25 || tr.Match(seqOf(100, 20)) != 0 {
			t.Fatalf("size %d evicted %d", tr.Size(), tr.Evicted())
		}
		checkInvariants(t, tr)
	})
	t.Run("sequence longer than the cap keeps its head", func(t *testing.T) {
		// Extending a held 8-token path by 12 evicts the new 12-token leaf
		// edge; the refreshed head fits and stays.
		tr := New(10)
		tr.Insert(seqOf(1, 8), 1)
		tr.Insert(seqOf(1, 20), 2)
		if tr.Size() != 8 || tr.Match(seqOf(1, 20)) != 8 {
			t.Fatalf("size %d match %d", tr.Size(), tr.Match(seqOf(1, 20)))
		}
		checkInvariants(t, tr)
	})
	t.Run("many children move to a map", func(t *testing.T) {
		tr := New(0)
		for i := range uint32(100) {
			tr.Insert([]uint32{7, i}, int64(i))
		}
		for i := range uint32(100) {
			if tr.Match([]uint32{7, i, 0}) != 2 {
				t.Fatalf("child %d lost", i)
			}
		}
		if tr.Match([]uint32{7, 100}) != 1 {
			t.Fatalf("phantom child")
		}
		checkInvariants(t, tr)
		// Capping a tree like this evicts map children by age.
		tc := New(2 + 50)
		for i := range uint32(100) {
			tc.Insert([]uint32{7, 8, i}, int64(i))
		}
		for i := range uint32(100) {
			if want := i >= 50; (tc.Match([]uint32{7, 8, i}) == 3) != want {
				t.Fatalf("child %d: match %d", i, tc.Match([]uint32{7, 8, i}))
			}
		}
		checkInvariants(t, tc)
	})
}

// slabTokens is the sum of the labels lying in slabs.
func slabTokens(tr *Tree) int {
	n, stack := 0, []*node{tr.root}
	for len(stack) > 0 {
		x := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		if x.inSlab {
			n += len(x.label)
		}
		for _, c := range x.big {
			stack = append(stack, c)
		}
		stack = append(stack, x.kids...)
	}
	return n
}

// Evicted tokens are let go: the slabs never hold more evicted tokens than
// live ones, and once most of what they held is evicted they are dropped.
// A split in a slab copies nothing.
func TestEvictedTokensAreReleased(t *testing.T) {
	const limit = 30000
	tr := New(limit)
	rng := rand.New(rand.NewPCG(9, 10))
	long := make([]uint32, 2000)
	inserted := 0
	for step := range 2000 {
		for i := range long {
			long[i] = rng.Uint32N(4)
		}
		n := 50 + rng.IntN(len(long)-50)
		tr.Insert(long[:n], int64(step))
		inserted += n
		live := slabTokens(tr)
		if live != tr.held-tr.dead || tr.dead > live {
			t.Fatalf("step %d: slabs hold %d live tokens (%d counted) and %d evicted", step, live, tr.held-tr.dead, tr.dead)
		}
		if step == 10 && (live == 0 || tr.Evicted() > 0) {
			t.Fatalf("a tree below its cap keeps %d tokens in slabs, evicted %d", live, tr.Evicted())
		}
	}
	if tr.Evicted() < uint64(inserted/2) || tr.held != 0 || tr.slab != nil || slabTokens(tr) != 0 {
		t.Fatalf("%d of %d tokens evicted, slabs still hold %d", tr.Evicted(), inserted, tr.held)
	}
	checkInvariants(t, tr)

	split := New(0)
	split.Insert(long, 1)
	held := split.held
	split.Insert(long[:10], 2)
	split.Insert(append(slices.Clone(long[:500]), 7), 3)
	if split.held != held+1 {
		t.Fatalf("two splits and a one-token leaf wrote %d tokens, want 1", split.held-held)
	}
}

func TestSplitDoesNotPinEvictedTokens(t *testing.T) {
	// Out of a slab, a split must copy the upper part: if it resliced, the
	// surviving head of a long edge would keep the evicted tail's array
	// alive.
	tr := New(1000)
	tr.Insert(seqOf(5000, 1000), 1)
	tr.Insert(seqOf(7000, 10), 2) // evicts: labels leave the slabs
	long := seqOf(1, 1000)
	tr.Insert(long, 3)
	tr.Insert(long[:10], 4)
	head := tr.root.child(1)
	if head.inSlab || len(head.label) != 10 || cap(head.label) >= 100 {
		t.Fatalf("head label len %d cap %d, in a slab %v", len(head.label), cap(head.label), head.inSlab)
	}
}

// An insert that cuts an edge and adds a short leaf allocates nodes and
// their child lists, but no tokens: those go into the slab.
func TestSplitAndLeafAllocateNoTokens(t *testing.T) {
	long := seqOf(1, 1000)
	tr := New(0)
	tr.Insert(long, 1)
	tr.Insert(seqOf(5000, 100), 2) // the first slab, with room to spare
	seqs := make([][]uint32, 101)
	for i := range seqs {
		k := 10 + 5*i
		seqs[i] = append(long[:k:k], 7)
	}
	i := 0
	a := testing.AllocsPerRun(100, func() {
		tr.Insert(seqs[i], int64(10+i))
		i++
	})
	t.Logf("%.2f allocations per insert", a)
	if a > 5 {
		t.Fatalf("a split and a one-token leaf allocated %.1f times, want 5: the two nodes and the child lists", a)
	}
	checkInvariants(t, tr)
}
