package prefixtree

// poisonFreed makes every slab handed to the spare ones be overwritten
// with poison, so that a test catches a label still lying in one. Tests
// only.
var poisonFreed bool

// poison is what a poisoned slab holds: a token no test inserts.
const poison = 0xdead_beef

func poisonSlab(s []uint32) {
	if !poisonFreed {
		return
	}
	s = s[:cap(s)]
	for i := range s {
		s[i] = poison
	}
}
