// Package prefixtree is the approximate per-worker token prefix tree behind
// SGLang's cache-aware routing policy. A router that sees no KV events from
// its engines remembers, for each worker, the token sequences it routed
// there, and scores a new request by how many of its leading tokens a
// worker's tree already holds. The tree is capped in tokens and forgets the
// least recently routed leaves first, as the engine's own LRU cache would.
package prefixtree

import (
	"bytes"
	"unsafe"

	"github.com/kvrouter/kvrouter/core/hugepage"
)

// maxSliceChildren is the fan-out above which a node's children move from
// parallel slices to a map. Almost every node has one to three children
// (the root typically one, the BOS token), and two small slices cost a
// fraction of a map's memory; but a node under a busy shared prefix may
// collect thousands, where a scan would not do. Lookup time is lost in the
// label comparisons: the benchmarks do not tell 0 (always a map), 8 and 32
// apart.
const maxSliceChildren = 8

type node struct {
	// label is never empty for a node other than the root. With inSlab
	// it lies in one of the tree's slabs, its capacity cut at its end.
	// Otherwise it is either an array of its own or a suffix of an array
	// whose head lives on, copied, in its ancestors, which outlive it; so
	// an evicted leaf frees its tokens and no surviving label pins evicted
	// ones.
	label  []uint32
	parent *node

	// Children are keyed by the first token of their label; keys[i] is
	// kids[i].label[0], kept inline so the scan touches one cache line.
	// When big is non-nil it holds all children and the slices are unused.
	keys []uint32
	kids []*node
	big  map[uint32]*node

	// stamp and tick order eviction: the caller's clock, then the tree's
	// own insert counter, so inserts sharing a clock value still evict in
	// insertion order.
	stamp int64
	tick  uint64

	// heapIdx is the node's position in Tree.leaves, or -1 when it is not a
	// leaf (or is the root, which is never evicted).
	heapIdx int32
	inSlab  bool
}

func (n *node) child(tok uint32) *node {
	if n.big != nil {
		return n.big[tok]
	}
	for i, k := range n.keys {
		if k == tok {
			return n.kids[i]
		}
	}
	return nil
}

func (n *node) numChildren() int {
	if n.big != nil {
		return len(n.big)
	}
	return len(n.kids)
}

func (n *node) addChild(c *node) {
	tok := c.label[0]
	if n.big != nil {
		n.big[tok] = c
		return
	}
	if len(n.kids) < maxSliceChildren {
		n.keys = append(n.keys, tok)
		n.kids = append(n.kids, c)
		return
	}
	n.big = make(map[uint32]*node, 2*maxSliceChildren)
	for i, k := range n.keys {
		n.big[k] = n.kids[i]
	}
	n.big[tok] = c
	n.keys, n.kids = nil, nil
}

// replaceChild swaps in c for the child with c's first token; used by a
// split, which keeps the first token of the edge it cuts.
func (n *node) replaceChild(c *node) {
	tok := c.label[0]
	if n.big != nil {
		n.big[tok] = c
		return
	}
	for i, k := range n.keys {
		if k == tok {
			n.kids[i] = c
			return
		}
	}
}

func (n *node) removeChild(tok uint32) {
	if n.big != nil {
		delete(n.big, tok)
		return
	}
	for i, k := range n.keys {
		if k == tok {
			last := len(n.keys) - 1
			n.keys[i], n.kids[i] = n.keys[last], n.kids[last]
			n.kids[last] = nil // let the evicted node go
			n.keys, n.kids = n.keys[:last], n.kids[:last]
			return
		}
	}
}

// Tree is a compressed radix tree over token ids (uint32) for one worker.
// It is not safe for concurrent use; callers serialise access.
type Tree struct {
	root      *node
	maxTokens int
	size      int
	evicted   uint64
	tick      uint64
	// leaves is a min-heap of every non-root childless node by (stamp,
	// tick), so eviction costs O(log leaves) instead of a scan of the tree.
	leaves []*node

	// Until its first eviction a tree carves its labels from slabs, so an
	// insert copies only the tokens it adds, a split copies none, and a
	// large tree's slabs lie on huge pages: a growing tree touches new
	// memory as fast as it takes tokens, and a page fault per 4 KiB cost
	// more than the copy. Evicted labels cannot free a slab's memory, so
	// from the first eviction on new labels get arrays of their own, and
	// once the slabs hold more evicted tokens than live ones, the live
	// ones move to arrays of their own too and the slabs go. slab is the
	// one being filled; held counts the tokens written into slabs, dead
	// those of them evicted.
	slab       []uint32
	held, dead int
	evicting   bool
}

// Slab sizes in tokens: a new slab is as large as the tree, within these
// bounds, so a small tree stays small and a large one on few slabs.
const (
	minSlab = 4 << 10
	maxSlab = 4 << 20
)

// New returns an empty tree holding at most maxTokens tokens (sum of edge
// lengths); maxTokens <= 0 means no cap.
func New(maxTokens int) *Tree {
	return &Tree{root: &node{heapIdx: -1}, maxTokens: maxTokens}
}

// Size is the number of tokens stored (sum of edge lengths).
func (t *Tree) Size() int { return t.size }

// Evicted is the number of tokens evicted so far.
func (t *Tree) Evicted() uint64 { return t.evicted }

// Match returns the length of the longest prefix of tokens that is a path
// from the root (i.e. the longest common prefix with any inserted, not yet
// evicted sequence). It does not change the tree or its LRU order.
func (t *Tree) Match(tokens []uint32) int {
	n, i := t.root, 0
	for i < len(tokens) {
		c := n.child(tokens[i])
		if c == nil {
			break
		}
		m := commonPrefix(c.label, tokens[i:])
		i += m
		if m < len(c.label) {
			break
		}
		n = c
	}
	return i
}

// Insert adds tokens as a path, stamping every node on the path with now
// (a logical clock supplied by the caller, non-decreasing), then, while
// Size() > maxTokens, evicts the leaf with the oldest stamp (ties: any),
// removing the whole leaf edge; a parent that becomes a childless node is a
// leaf candidate afterwards. The nodes of the path just inserted have the
// newest stamp, so they go last.
//
// Ties on now are in fact broken by insertion order, so the sequence just
// inserted survives whole whenever len(tokens) <= maxTokens. When it is
// longer, eviction goes on into the new path itself, from its last edge
// upwards, and may remove all of it: the cap always holds when Insert
// returns. Inserting a path that ends inside an edge splits the edge, so
// the prefix takes the new stamp while the rest keeps its own. Tokens are
// copied; the caller may reuse the slice. An empty sequence is a no-op.
func (t *Tree) Insert(tokens []uint32, now int64) {
	if len(tokens) == 0 {
		return
	}
	t.tick++
	n, i := t.root, 0
	for i < len(tokens) {
		c := n.child(tokens[i])
		if c == nil {
			leaf := &node{
				parent: n,
				stamp:  now,
				tick:   t.tick,
			}
			leaf.label, leaf.inSlab = t.store(tokens[i:])
			if n.heapIdx >= 0 {
				t.heapRemove(n)
			}
			n.addChild(leaf)
			t.size += len(leaf.label)
			t.heapPush(leaf)
			break
		}
		m := commonPrefix(c.label, tokens[i:])
		if m < len(c.label) {
			c = t.split(c, m)
		}
		c.stamp, c.tick = now, t.tick
		if c.heapIdx >= 0 {
			t.heapFix(int(c.heapIdx))
		}
		i += m
		n = c
	}
	t.evict()
}

// split cuts c's edge after m tokens (0 < m < len(c.label)) and returns the
// new upper node. Out of a slab, the upper part gets a fresh copy of its
// tokens so that c, left holding the tail of the old array, is the only
// node pinning it. Both parts keep c's stamp until the caller restamps the
// upper one.
func (t *Tree) split(c *node, m int) *node {
	up := &node{
		label:   c.label[:m:m],
		parent:  c.parent,
		stamp:   c.stamp,
		tick:    c.tick,
		heapIdx: -1,
		inSlab:  c.inSlab,
	}
	if !c.inSlab {
		up.label = append([]uint32(nil), up.label...)
	}
	c.parent.replaceChild(up)
	c.label = c.label[m:]
	c.parent = up
	up.addChild(c)
	return up
}

func (t *Tree) evict() {
	if t.maxTokens <= 0 {
		return
	}
	for t.size > t.maxTokens && len(t.leaves) > 0 {
		leaf := t.leaves[0]
		t.heapRemove(leaf)
		p := leaf.parent
		p.removeChild(leaf.label[0])
		t.size -= len(leaf.label)
		t.evicted += uint64(len(leaf.label))
		t.evicting = true
		if leaf.inSlab {
			t.dead += len(leaf.label)
		}
		leaf.parent, leaf.label = nil, nil
		if p != t.root && p.numChildren() == 0 {
			t.heapPush(p)
		}
	}
	if t.held > 0 && t.dead > t.held-t.dead {
		t.leaveSlabs()
	}
}

// store copies tokens into the current slab, or, once the tree evicts, an
// array of their own. When they do not fit, the next slab is sized to the
// tree (within bounds), and a run of more than a quarter of it gets an
// array of its own instead, so a slab given up leaves at most a quarter of
// itself unused.
func (t *Tree) store(tokens []uint32) (label []uint32, inSlab bool) {
	n := len(tokens)
	if t.evicting {
		return append([]uint32(nil), tokens...), false
	}
	if len(t.slab)+n > cap(t.slab) {
		size := min(max(t.size, minSlab), maxSlab)
		if n > size/4 {
			return append([]uint32(nil), tokens...), false
		}
		t.slab = hugepage.Make[uint32](size)[:0]
	}
	t.held += n
	at := len(t.slab)
	t.slab = append(t.slab, tokens...)
	return t.slab[at:len(t.slab):len(t.slab)], true
}

// leaveSlabs copies every label still in a slab into an array of its own,
// so the slabs, mostly filled with evicted labels, can be freed. It costs
// at most one copy of the tree, once.
func (t *Tree) leaveSlabs() {
	t.slab, t.held, t.dead = nil, 0, 0
	stack := []*node{t.root}
	for len(stack) > 0 {
		n := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		if n.inSlab {
			n.label, n.inSlab = append([]uint32(nil), n.label...), false
		}
		if n.big != nil {
			for _, c := range n.big {
				stack = append(stack, c)
			}
		} else {
			stack = append(stack, n.kids...)
		}
	}
}

// commonPrefix returns the length of the common prefix of a and b.
func commonPrefix(a, b []uint32) int {
	n := min(len(a), len(b))
	a, b = a[:n], b[:n]
	// Long equal runs are the common case (a shared prompt), so compare
	// 1 KiB at a time with the runtime's vectorised memequal, about twice
	// as fast as any scalar loop, then find the first difference within
	// the failing chunk eight tokens per step.
	i := 0
	for ; i+memeqChunk <= n; i += memeqChunk {
		if !bytes.Equal(tokenBytes(a[i:i+memeqChunk]), tokenBytes(b[i:i+memeqChunk])) {
			break
		}
	}
	for ; i+8 <= n; i += 8 {
		x, y := a[i:i+8:i+8], b[i:i+8:i+8]
		if x[0] != y[0] || x[1] != y[1] || x[2] != y[2] || x[3] != y[3] ||
			x[4] != y[4] || x[5] != y[5] || x[6] != y[6] || x[7] != y[7] {
			break
		}
	}
	for ; i < n; i++ {
		if a[i] != b[i] {
			return i
		}
	}
	return n
}

// memeqChunk is in tokens; 256 measured best among 32 to 256, larger ones
// only lengthen the scalar scan after a mismatch.
const memeqChunk = 256

// tokenBytes views a non-empty token slice as bytes; equality does not
// depend on byte order, so this is portable.
func tokenBytes(s []uint32) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(&s[0])), 4*len(s))
}

func older(a, b *node) bool {
	if a.stamp != b.stamp {
		return a.stamp < b.stamp
	}
	return a.tick < b.tick
}

func (t *Tree) heapPush(n *node) {
	n.heapIdx = int32(len(t.leaves))
	t.leaves = append(t.leaves, n)
	t.heapUp(int(n.heapIdx))
}

func (t *Tree) heapRemove(n *node) {
	i, last := int(n.heapIdx), len(t.leaves)-1
	if i != last {
		t.heapSwap(i, last)
	}
	t.leaves[last] = nil
	t.leaves = t.leaves[:last]
	n.heapIdx = -1
	if i != last {
		t.heapFix(i)
	}
}

func (t *Tree) heapFix(i int) {
	if !t.heapUp(i) {
		t.heapDown(i)
	}
}

func (t *Tree) heapSwap(i, j int) {
	h := t.leaves
	h[i], h[j] = h[j], h[i]
	h[i].heapIdx = int32(i)
	h[j].heapIdx = int32(j)
}

// heapUp reports whether the element moved.
func (t *Tree) heapUp(i int) bool {
	start := i
	for i > 0 {
		p := (i - 1) / 2
		if !older(t.leaves[i], t.leaves[p]) {
			break
		}
		t.heapSwap(i, p)
		i = p
	}
	return i != start
}

func (t *Tree) heapDown(i int) {
	h := t.leaves
	for {
		l := 2*i + 1
		if l >= len(h) {
			return
		}
		m := l
		if r := l + 1; r < len(h) && older(h[r], h[l]) {
			m = r
		}
		if !older(h[m], h[i]) {
			return
		}
		t.heapSwap(i, m)
		i = m
	}
}
