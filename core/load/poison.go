package load

// poisonFreed makes every run buffer the trie lets go of (recycled with its
// node, kept for reuse or dropped) be overwritten with poison, so that a
// test catches any node still reading one. Tests only; off, it costs a
// branch per freed buffer.
var poisonFreed bool

// poison is what a poisoned buffer holds: a block hash no test chain uses.
const poison = 0xdead_beef_dead_beef

func poisonRun(r []uint64) {
	if !poisonFreed {
		return
	}
	r = r[:cap(r)]
	for i := range r {
		r[i] = poison
	}
}
