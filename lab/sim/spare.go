package sim

import (
	"math/bits"
	"sync"
)

// spareStore keeps the free prompts and block hash lists of finished
// runs for the next runs of the process: a sweep runs one fleet after
// another, and each run's pools (promptPool, blockHashes) started empty,
// so an overloaded run, whose engines hold nearly every prompt at once,
// built thousands of them in fresh memory, zeroed and faulted in page by
// page, while the last run's waited for the garbage collector. A run
// takes from it what its own free lists lack and hands it what they hold
// when it ends (Run). Nothing a run takes is read before the run writes
// it, as with its own free lists: a run whose skipped blocks are
// poisoned poisons what it hands on (handOn), so that one that read it
// would see blocks of no prompt.
type spareStore struct {
	mu     sync.Mutex
	tokens spareClasses[uint32]
	hashes spareClasses[uint64]
	// bytes is what the lists hold, at most max.
	bytes, max int
}

// maxSpareBytes bounds the process's spare lists: most of what an
// overloaded run of the conversation trace builds in fresh memory (360
// MB of prompts and 90 MB of hash lists at arrival speedup 12), while a
// run that meets its SLO builds a few MB.
const maxSpareBytes = 256 << 20

// spares are the process's.
var spares = spareStore{max: maxSpareBytes}

// spareClasses are empty lists by size class: class c holds lists of
// capacity 2^c.
type spareClasses[T uint32 | uint64] [bits.UintSize][][]T

// class is the size class of l, false when its capacity is not a power
// of two (a list the pools do not recycle).
func class[T uint32 | uint64](l []T) (int, bool) {
	c := bits.Len(uint(cap(l))) - 1
	return c, c >= 0 && cap(l) == 1<<c
}

func (cl *spareClasses[T]) take(c int) []T {
	l := cl[c]
	if len(l) == 0 {
		return nil
	}
	x := l[len(l)-1]
	l[len(l)-1] = nil
	cl[c] = l[:len(l)-1]
	return x
}

// takeTokens is an empty prompt of capacity 2^c, nil when none is spare.
func (s *spareStore) takeTokens(c int) []uint32 {
	s.mu.Lock()
	defer s.mu.Unlock()
	l := s.tokens.take(c)
	s.bytes -= cap(l) * 4
	return l
}

// takeHashes is an empty hash list of capacity 2^c, nil when none is
// spare.
func (s *spareStore) takeHashes(c int) []uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	l := s.hashes.take(c)
	s.bytes -= cap(l) * 8
	return l
}

// put keeps what fits of the lists of a finished run, the rest left to
// the garbage collector.
func (s *spareStore) put(tokens [][]uint32, hashes [][]uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, l := range hashes {
		if c, ok := class(l); ok && s.bytes+cap(l)*8 <= s.max {
			s.hashes[c] = append(s.hashes[c], l[:0])
			s.bytes += cap(l) * 8
		}
	}
	for _, l := range tokens {
		if c, ok := class(l); ok && s.bytes+cap(l)*4 <= s.max {
			s.tokens[c] = append(s.tokens[c], l[:0])
			s.bytes += cap(l) * 4
		}
	}
}

// handOn gives the run's free prompts and hash lists, and those of the
// requests it still holds, to the next runs (spares): the run has ended,
// and neither its engines nor its router read them again.
func (s *sim) handOn() {
	p, m := &s.prompts, &s.ids
	if p.given == nil || p.how != reusePrompts {
		return
	}
	var tokens [][]uint32
	for c := range p.free {
		tokens = append(tokens, p.free[c]...)
		p.free[c] = nil
	}
	for i, l := range p.given {
		if l != nil {
			tokens = append(tokens, l)
			p.given[i] = nil
		}
	}
	var hashes [][]uint64
	if m.recycles {
		for c := range m.free {
			hashes = append(hashes, m.free[c]...)
			m.free[c] = nil
		}
		for i := range m.seq {
			if m.seq[i] != nil {
				hashes = append(hashes, m.local[i], m.seq[i])
				m.local[i], m.seq[i] = nil, nil
			}
		}
	}
	if p.fill == poisonSkipped || p.fill == scrambleSkipped {
		for _, l := range tokens {
			p.overwrite(l[:cap(l)])
		}
		for _, l := range hashes {
			poisonHashes(l[:cap(l)])
		}
	}
	p.spares.put(tokens, hashes)
}

// poisonHashes overwrites l with hashes of no block.
func poisonHashes(l []uint64) {
	for k := range l {
		l[k] = ^uint64(0)
	}
}
