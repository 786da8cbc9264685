package sim

import (
	"math/bits"

	"github.com/kvrouter/kvrouter/lab/trace"
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

// skippedTokens is what the blocks of a prompt that nothing reads hold.
type skippedTokens uint8

const (
	// leaveSkipped writes nothing there: they hold what the memory
	// held, an earlier prompt's tokens or zeros.
	leaveSkipped skippedTokens = iota
	// generateSkipped generates them as any other block.
	generateSkipped
	// poisonSkipped and scrambleSkipped overwrite them with tokens of no
	// trace prompt and with other tokens of the vocabulary: a run that
	// read them would see other blocks, and its results would change.
	poisonSkipped
	scrambleSkipped
)

// defaultSkipped is what a run's Config leaves at leaveSkipped gets,
// which a build for checking the runs may change (poison_check.go).
var defaultSkipped = leaveSkipped

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
	// reqs is a materialised workload whose prompts its engines get in
	// pooled copies (own), with tail when the copies hold only the
	// tokens the engine reads; nil for a trace.
	reqs Requests
	tail bool
	// ids frees the requests' block hashes with their prompts, which the
	// engines' events point into as well.
	ids   *blockHashes
	given [][]uint32                // given[i]: request i's prompt while it runs
	free  [bits.UintSize][][]uint32 // free[c]: free prompts of capacity 2^c
	how   promptDisposal
	// reused counts the prompts built in a free one, made those built in
	// fresh memory.
	reused, made int
	// lazy: the tokens of the leading blocks a prompt shares with its
	// previous turn are read by nothing, and are not generated. The loop
	// hashes every prompt once at arrival (blockHashes) and takes those
	// blocks' hashes from the previous turn's; the router takes the
	// hashes, the engine its block ids and local hashes, and the Stored
	// events the engine's local hashes. What reads a prompt's tokens is
	// the hashing of the blocks no earlier turn shares, and the engine's,
	// of its partial last block and the generated blocks that continue
	// it, and the fingerprint that seeds its tokens. Anything else that
	// reads them turns lazy off: a router that hashes the Stored events'
	// tokens (IgnoreCacheSalt), a policy that keeps its own view of the
	// prompts (sched.Mode.ReadsPrompt), engines that keep copies of their
	// blocks' tokens, and the fleets that keep no pool.
	lazy bool
	fill skippedTokens
	// skipped counts the blocks of trace tokens not generated as the
	// prompts arrive, and the engine blocks of a materialised workload's
	// prompts not copied (tail).
	skipped int
	// scratch is where a lazy run builds a prompt as it arrives, to hash
	// the blocks no earlier turn shares: once hashed, nothing reads a
	// prompt's full blocks, and the prompt its engine gets (engineTokens)
	// holds the tokens of its partial last block alone. An overloaded
	// run, whose router queue holds nearly every prompt at once, kept
	// them all, and their fresh memory cost more than the rest of the run.
	scratch []uint32
	// bs is the engines' block size, in a lazy run.
	bs int
	// stand are the tokens the router is told of in lazy runs, a stand-in
	// of each prompt's length: it takes the prompts' hashes and reads
	// nothing else of them.
	stand []uint32
}

func (p *promptPool) init(s *sim) {
	p.how = s.cfg.prompts
	tr, isTrace := s.w.(*Trace)
	reqs, isReqs := s.w.(Requests)
	// A disaggregated request's prompt goes to two engines, and replicas
	// and speculative prefills keep prompts beyond their request.
	if !isTrace && !isReqs || p.how == dropPrompts || s.pd != nil || s.rep != nil || s.cfg.SpeculativePrefill {
		return
	}
	p.tr, p.reqs = tr, reqs
	p.given = make([][]uint32, s.w.Len())
	p.ids = &s.ids
}

// initLazy decides, once the run's block hashes are set up, whether its
// prompts' shared blocks are generated (see lazy).
func (p *promptPool) initLazy(s *sim) {
	if p.fill = s.cfg.skipped; p.fill == leaveSkipped {
		p.fill = defaultSkipped
	}
	m := &s.ids
	m.poison = p.fill == poisonSkipped || p.fill == scrambleSkipped
	readers := s.cfg.IgnoreCacheSalt || s.cfg.listsBlocks || s.r.Mode().ReadsPrompt()
	p.lazy = p.tr != nil && p.fill != generateSkipped && m.on && m.router && m.prev != nil && !readers
	p.tail = p.reqs != nil && p.fill != generateSkipped && m.on && !readers
	p.bs = m.bs
}

// request builds request i as it arrives: in a lazy run in scratch, else
// as build does.
func (p *promptPool) request(s *sim, i int) workload.Request {
	if p.tr == nil {
		return s.w.Request(i)
	}
	r := &p.tr.reqs[i]
	if !p.lazy {
		return p.build(i, 0)
	}
	// The router hashes the prompt as it arrives, taking as many blocks
	// as this from the previous turn.
	skip := s.ids.taken(i, "", r.InputLength/s.ids.bs) * s.ids.bs / trace.BlockTokens
	p.skipped += skip
	req := workload.FromTraceRequestFrom(r, p.scratch, skip)
	p.scratch = req.Tokens[:0]
	p.overwrite(req.Tokens[:skip*trace.BlockTokens])
	return req
}

// build builds request i's prompt in a free one of its size class when
// there is one, without the tokens of its first skip trace blocks.
// Classes are powers of two: prompts of a trace grow turn by turn, and a
// prompt of exactly its request's size would rarely fit the next.
func (p *promptPool) build(i, skip int) workload.Request {
	r := &p.tr.reqs[i]
	req := workload.FromTraceRequestFrom(r, p.take(workload.TraceRoom(r)), skip)
	if skip > 0 {
		p.overwrite(req.Tokens[:skip*trace.BlockTokens])
	}
	p.given[i] = req.Tokens
	return req
}

// take is an empty prompt of room for n tokens, a free one of its size
// class when there is one.
func (p *promptPool) take(n int) []uint32 {
	c := bits.Len(uint(n - 1))
	if free := p.free[c]; len(free) > 0 {
		p.reused++
		buf := free[len(free)-1]
		free[len(free)-1] = nil
		p.free[c] = free[:len(free)-1]
		return buf
	}
	p.made++
	return make([]uint32, 0, 1<<c)
}

// own gives request i's engine a pooled copy of its prompt, with room for
// its output: the engine takes it over (engine.Request.Owned) instead of
// copying it into fresh memory, which cost as much as the rest of Add. A
// tail copy holds the tokens of the partial last block alone when the
// prompt's block hashes are already taken: nothing else of the engine's
// copy is read (see lazy), and copying them was most of what was left.
func (p *promptPool) own(i int, req *workload.Request) {
	n := len(req.Tokens)
	buf := p.take(n + req.OSL)[:n]
	skip := 0
	if p.tail && p.ids.seq[i] != nil {
		skip = n / p.bs * p.bs
		p.skipped += skip / p.bs
		p.overwrite(buf[:skip])
	}
	copy(buf[skip:], req.Tokens[skip:])
	p.given[i] = buf
	req.Tokens = buf
}

// owns reports whether request i's engine takes its prompt over.
func (p *promptPool) owns(i int) bool { return p.given != nil && p.given[i] != nil }

// routerTokens are the tokens of a prompt the router is told of: the
// prompt itself, or in a lazy run a stand-in of its length, which holds
// what the skipped blocks hold (see skippedTokens).
func (p *promptPool) routerTokens(toks []uint32) []uint32 {
	if !p.lazy {
		return toks
	}
	n := len(toks)
	if len(p.stand) < n {
		// A new one: the router may still hold stand-ins of the old.
		p.stand = make([]uint32, max(n, 2*len(p.stand)))
		p.overwrite(p.stand)
	}
	return p.stand[:n:n]
}

// park forgets the prompt of request i, which the router's queue holds,
// in a lazy run: engineTokens builds it.
func (p *promptPool) park(req *workload.Request) {
	if p.lazy {
		req.Tokens = nil
	}
}

// engineTokens builds, in a lazy run, the prompt request i's engine gets
// in place of the one it arrived with: of the trace blocks, only the one
// that holds the partial last engine block, the only tokens the engine
// reads of a prompt whose block hashes it is handed.
func (p *promptPool) engineTokens(i int, req *workload.Request) {
	if p.reqs != nil {
		p.own(i, req)
		return
	}
	if !p.lazy {
		return
	}
	skip := 0
	if p.ids.seq[i] != nil {
		skip = p.tr.reqs[i].InputLength / p.bs * p.bs / trace.BlockTokens
	}
	req.Tokens = p.build(i, skip).Tokens
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

// overwrite fills the room of a prompt's skipped blocks as fill says.
func (p *promptPool) overwrite(toks []uint32) {
	switch p.fill {
	case poisonSkipped:
		for k := range toks {
			toks[k] = poison
		}
	case scrambleSkipped:
		for k := range toks {
			toks[k] = uint32(k*7919+p.skipped) % trace.Vocab
		}
	}
}
