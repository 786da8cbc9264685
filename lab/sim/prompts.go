package sim

import (
	"math/bits"

	"github.com/kvrouter/kvrouter/lab/workload"
)

// promptDisposal is what becomes of a finished request's trace prompt.
type promptDisposal uint8

const (
	// reusePrompts builds later prompts in it.
	reusePrompts promptDisposal = iota
	// dropPrompts leaves it to the garbage collector.
	dropPrompts
	// poisonPrompts overwrites it with tokens no prompt holds and never
	// hands it out again: a run that still read it would see other
	// blocks, and its results would change.
	poisonPrompts
)

// poison is a token id no trace prompt holds (they are below trace.Vocab).
const poison = ^uint32(0)

// promptPool recycles the trace's prompts of an aggregated fleet with
// one router. A prompt is built for its request alone and handed to its
// engine (engine.Request.Owned); the engine's KV events point into it
// (BlockEvent.TokenIDs) until the router has applied them, a KV event
// delay later. So a prompt is free once its request has finished and
// its engine's events up to that step have been applied: allocating
// each prompt afresh cost as much again as generating its tokens, in
// zeroing and in the collector's work.
type promptPool struct {
	tr *Trace
	// ids frees the requests' block hashes with their prompts, which the
	// engines' events point into as well.
	ids   *blockHashes
	given [][]uint32                // given[i]: request i's prompt while it runs
	free  [bits.UintSize][][]uint32 // free[c]: free prompts of capacity 2^c
	how   promptDisposal
	// reused counts the prompts built in a free one.
	reused int
}

func (p *promptPool) init(s *sim) {
	p.how = s.cfg.prompts
	tr, ok := s.w.(*Trace)
	// A disaggregated request's prompt goes to two engines, and replicas
	// and speculative prefills keep prompts beyond their request.
	if !ok || p.how == dropPrompts || s.pd != nil || s.rep != nil || s.cfg.SpeculativePrefill {
		return
	}
	p.tr = tr
	p.given = make([][]uint32, tr.Len())
	p.ids = &s.ids
}

// request builds request i, in a free prompt of its size class when
// there is one. Classes are powers of two: prompts of a trace grow turn
// by turn, and a prompt of exactly its request's size would rarely fit
// the next.
func (p *promptPool) request(s *sim, i int) workload.Request {
	if p.tr == nil {
		return s.w.Request(i)
	}
	c := bits.Len(uint(workload.TraceRoom(&p.tr.reqs[i]) - 1))
	var buf []uint32
	if free := p.free[c]; len(free) > 0 {
		p.reused++
		buf = free[len(free)-1]
		free[len(free)-1] = nil
		p.free[c] = free[:len(free)-1]
	} else {
		buf = make([]uint32, 0, 1<<c)
	}
	req := workload.FromTraceRequestInto(&p.tr.reqs[i], buf)
	p.given[i] = req.Tokens
	return req
}

// retire frees request i's prompt once its engine se has applied the
// events of the step that finished it.
func (p *promptPool) retire(se *simEngine, i int) {
	if p.given == nil || p.given[i] == nil {
		return
	}
	if n := len(se.batches); n > 0 {
		se.retired[n-1] = append(se.retired[n-1], int32(i))
		return
	}
	p.release(i)
}

// release takes back request i's prompt and block hashes.
func (p *promptPool) release(i int) {
	p.put(p.given[i])
	p.given[i] = nil
	p.ids.engineDone(i, p.how)
}

func (p *promptPool) put(buf []uint32) {
	if p.how == poisonPrompts {
		buf = buf[:cap(buf)]
		for k := range buf {
			buf[k] = poison
		}
		return
	}
	c := bits.Len(uint(cap(buf) - 1))
	p.free[c] = append(p.free[c], buf[:0])
}
