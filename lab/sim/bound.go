package sim

import (
	"encoding/binary"
	"math"
	"slices"
	"time"

	"github.com/zeebo/xxh3"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/lab/replay"
	"github.com/kvrouter/kvrouter/lab/trace"
	"github.com/kvrouter/kvrouter/lab/workload"
	"github.com/kvrouter/kvrouter/mocker/engine"
)

// EngineBoundRPS bounds the arrival rate any routing policy can sustain on
// w more tightly than PrefillBoundRPS, by charging the engines for the
// decode steps every request needs as well as for the prompt tokens one
// infinite cache would miss.
//
// A request of OSL output tokens decodes in OSL−1 steps (its first token
// comes from the step that prefills its prompt's end). A step decodes at
// most MaxNumSeqs sequences, and costs DecodeTime(u), u the fraction of
// the engine's blocks held by running requests. DecodeTime is concave, so
// it lies above its chord: DecodeTime(u) ≥ D(0) + (D(1) − D(0))·u. Summed
// over a fleet's decode steps that is at least D(0) for every MaxNumSeqs
// decoded tokens, plus (D(1) − D(0)) / NumGPUBlocks for every block a
// decoding request holds in every step it decodes.
//
// The blocks counted are those no two decoding requests of one step can
// share, so that they are distinct slots of the engine in every step
// they are counted in:
//   - Each prompt block is charged to one owner of the requests whose
//     prompts hold it, in every step that owner's requests decode: the
//     turns of a closed-loop session share an owner (they never run at
//     once, so each holds the block alone while it decodes), every other
//     request is its own. A block is charged to all the requests of the
//     first owner whose prompts hold it, or, when that is more, to the
//     one request among its holders with the most decode steps: it holds
//     the block through all of them, wherever the routing sends it.
//   - Each decode step also writes its request's answer into blocks of
//     its own (decodeTails): the partial last block, and every full block
//     holding generated tokens only.
//
// Prefill is charged as in PrefillBoundRPS. The sum is a lower bound on the
// stepping time any fleet spends on w, so w's requests over it, per engine,
// bound the rate. It leaves out the memory idle sessions need to keep
// their hits, queueing and imbalance: real goodputs lie below it. 0 when
// there is nothing to bound.
func EngineBoundRPS(c *replay.Ceiling, w Workload, eng engine.Config, workers int) float64 {
	return engineBound(c, decodeStatsOf(w, eng.BlockSize), eng, float64(workers))
}

// unequalEngineBound is EngineBoundRPS on a fleet of unequal engines: speed is
// the engines counted by their speed (the fleet does speed configured
// engines' work per second), and eng.NumGPUBlocks the most blocks of any
// engine, whose decode steps read a held block most cheaply. Charging
// every step at the fastest rate and every block at the cheapest keeps
// it a bound whichever engines the work goes to.
func unequalEngineBound(c *replay.Ceiling, w Workload, eng engine.Config, speed float64) float64 {
	return engineBound(c, decodeStatsOf(w, eng.BlockSize), eng, speed)
}

func engineBound(c *replay.Ceiling, d decodeStats, eng engine.Config, speed float64) float64 {
	if d.requests == 0 || !(speed > 0) || eng.MaxNumSeqs <= 0 || eng.NumGPUBlocks <= 0 {
		return 0
	}
	d0 := float64(engine.DecodeTime(0))
	slope := float64(engine.DecodeTime(1)) - d0
	decode := float64(d.steps)*d0/float64(eng.MaxNumSeqs) + slope*float64(d.privateBlockSteps)/float64(eng.NumGPUBlocks) // ns
	hits, total := c.Tokens()
	prefill := float64(total-hits) * cheapestPrefillPerToken(eng.MaxNumBatchedTokens)
	busy := (prefill + decode) / speed / float64(time.Second) // each engine's share
	if busy <= 0 {
		return 0
	}
	return float64(d.requests) / busy
}

// decodeStats is what the engine bound needs of a workload's decode steps.
type decodeStats struct {
	requests int
	steps    int64 // every request's OSL−1, summed
	// privateBlockSteps is, summed over the blocks charged to decoding
	// requests (see EngineBoundRPS), the decode steps each is charged in.
	privateBlockSteps int64
}

// ownership finds each block's charge in one pass: the steps of the
// first owner's requests whose prompts hold it, or, if another owner's
// prompt holds it too and one request of any owner decodes longer, that
// request's steps. Summed over blocks, that is the charge of
// EngineBoundRPS, without keeping any prompt's hashes for a second pass
// (8 bytes per block of the workload: half a GB for the agentic one).
type ownership struct {
	owners []int32
	blocks []blockOwner // by block number (replay.BlockIDs)
	tails  decodeTails
	stats  decodeStats
}

type blockOwner struct {
	owner int32  // the first owner whose prompt holds it; -1 before any
	steps uint32 // that owner's steps
	most  uint32 // the most steps of one request holding it
}

// newOwnership has room for about blocks distinct blocks (blocksHint).
func newOwnership(w Workload, blockSize, blocks int) *ownership {
	return &ownership{owners: requestOwners(w), tails: newDecodeTails(w.Len(), blockSize), blocks: make([]blockOwner, 0, blocks)}
}

// add takes request i's full blocks: its prompt's chained hashes seq and
// their numbers ids.
func (o *ownership) add(i int, r *workload.Request, seq []uint64, ids []int32) {
	steps := uint32(max(r.OSL-1, 0))
	o.stats.requests++
	o.stats.steps += int64(steps)
	o.tails.add(r, seq)
	own := o.owners[i]
	for _, id := range ids {
		if int(id) >= len(o.blocks) {
			o.blocks = extend(o.blocks, int(id)+1, blockOwner{owner: -1})
		}
		bo := &o.blocks[id]
		if bo.owner < 0 {
			bo.owner = own
		}
		if bo.owner == own {
			bo.steps += steps
		}
		bo.most = max(bo.most, steps)
	}
}

// extend lengthens s to n with fill, at least doubling its capacity when
// it must grow: append grows a large slice by a quarter, and records
// kept per block of a workload were copied several times over.
func extend[T any](s []T, n int, fill T) []T {
	if n > cap(s) {
		s = slices.Grow(s, max(n, 2*cap(s))-len(s))
	}
	for len(s) < n {
		s = append(s, fill)
	}
	return s
}

func (o *ownership) result() decodeStats {
	d := o.stats
	for _, bo := range o.blocks {
		if bo.owner < 0 {
			continue
		}
		d.privateBlockSteps += int64(max(bo.steps, bo.most))
	}
	for i := range o.tails.requests() {
		d.privateBlockSteps += o.tails.blockSteps(i)
	}
	return d
}

// decodeStatsOf hashes every prompt under its cache salt: salted copies of
// one prefix are different blocks.
func decodeStatsOf(w Workload, blockSize int) decodeStats {
	hint := blocksHint(w, blockSize)
	o := newOwnership(w, blockSize, hint)
	eachPromptBlocks(w, blockSize, hint, func(i int, r *workload.Request, seq []uint64, ids []int32) { o.add(i, r, seq, ids) })
	return o.result()
}

// eachPromptBlocks calls f with every request of w in order, its prompt's
// full blocks' chained hashes under its cache salt and their numbers (one
// replay.BlockIDs, with room for about blocks hashes, numbers every
// prompt's blocks). The slices are f's until it returns.
func eachPromptBlocks(w Workload, blockSize, blocks int, f func(i int, r *workload.Request, seq []uint64, ids []int32)) {
	t := newTurnBlocks(w)
	numbers := replay.NewBlockIDs(blocks)
	tr, _ := w.(*Trace)
	var buf []uint32
	for i := range w.Len() {
		var r workload.Request
		if tr != nil {
			// Only the tokens after the blocks taken are read: the
			// trace's blocks before them are left unwritten.
			r = workload.FromTraceRequestFrom(&tr.reqs[i], buf, t.taken(i, blockSize)/trace.BlockTokens)
			buf = r.Tokens
		} else {
			r = w.Request(i)
		}
		seq, ids := t.blocks(i, &r, blockSize, numbers)
		f(i, &r, seq, ids)
	}
}

// blocksHint is about how many distinct full blocks the prompts of w
// hold at blockSize, at most: each prompt's full blocks beyond those it
// shares with the prompt it extends (extensions); 0 on a workload that
// cannot tell its prompts' lengths without building them. The bounds
// pass sizes its tables by it, so that they do not copy themselves as
// they grow.
func blocksHint(w Workload, blockSize int) int {
	prev, share := extensions(w)
	return distinctPromptBlocks(w, blockSize, prev, share)
}

// distinctPromptBlocks is blocksHint of the extensions prev and share of w.
func distinctPromptBlocks(w Workload, blockSize int, prev, share []int32) int {
	length := lengths(w)
	if length == nil {
		return 0
	}
	n := 0
	for i := range w.Len() {
		shared := 0
		if p := prev[i]; p >= 0 {
			// Only the blocks the earlier prompt holds in full: a
			// trace's prompts share whole hash ids, the last of which
			// the earlier one may hold only part of.
			pin, _ := length(int(p))
			shared = min(int(share[i]), pin) / blockSize
		}
		in, _ := length(i)
		n += max(in/blockSize-shared, 0)
	}
	return n
}

// lengths tells the prompt and output lengths of w's requests without
// building them; nil on a workload that cannot.
func lengths(w Workload) func(i int) (in, out int) {
	switch w := w.(type) {
	case *Trace:
		return func(i int) (int, int) { return w.reqs[i].InputLength, w.reqs[i].OutputLength }
	case Requests:
		return func(i int) (int, int) { return len(w[i].Tokens), w[i].OSL }
	}
	return nil
}

// engineBlocksHint is the engines' Config.ExpectedBlocks on a fleet of
// engines running w: each engine's share of the most distinct blocks the
// run can make (the prompts', blocksHint, and every request's generated
// ones), doubled, as routing spreads requests unevenly and engines cache
// blocks that others cache too. 0, for tables that start small, on a
// workload that cannot tell. prev and share are w's extensions.
func engineBlocksHint(w Workload, prev, share []int32, blockSize, engines int) int {
	length := lengths(w)
	if length == nil || engines <= 0 {
		return 0
	}
	n := distinctPromptBlocks(w, blockSize, prev, share)
	for i := range w.Len() {
		_, out := length(i)
		n += out/blockSize + 1
	}
	return (2*n + engines - 1) / engines
}

// turnBlocks carries a prompt's blocks to the later prompts that extend
// it (see extensions): a turn's prompt mostly repeats the one before (an
// agent's context grows by the tool call and its result; a conversation
// sends its earlier turns again), and the blocks it repeats need neither
// hashing nor a lookup of their number. Only blocks whose tokens and salt
// are the earlier prompt's are taken from it, so the hashes and numbers
// are those of hashing every prompt whole.
type turnBlocks struct {
	prev, share []int32 // extensions; nil on a workload that cannot tell
	left        []int32 // later prompts that have yet to take a prompt's blocks
	kept        map[int32]promptBlocks
	free        []promptBlocks // slices to reuse
	local       []uint64
}

type promptBlocks struct {
	salt string
	seq  []uint64
	ids  []int32
}

func newTurnBlocks(w Workload) *turnBlocks {
	t := &turnBlocks{kept: map[int32]promptBlocks{}}
	if t.prev, t.share = extensions(w); t.prev != nil {
		t.left = successors(t.prev)
	}
	return t
}

// blocks is request i's full blocks' chained hashes and numbers, valid
// until the next call.
func (t *turnBlocks) blocks(i int, r *workload.Request, bs int, numbers *replay.BlockIDs) ([]uint64, []int32) {
	var k promptBlocks
	same, carried := 0, false
	if t.prev != nil && t.prev[i] >= 0 {
		pi := t.prev[i]
		if p, ok := t.kept[pi]; ok {
			t.left[pi]--
			last := t.left[pi] == 0
			if last {
				delete(t.kept, pi)
			}
			if p.salt == r.CacheSalt {
				same = min(int(t.share[i])/bs, len(p.seq), len(r.Tokens)/bs)
				carried = true
				if last {
					// The last prompt to take them extends the lists
					// in place: no one reads them again.
					k = p
					k.seq, k.ids = p.seq[:same], p.ids[:same]
				} else {
					k = t.spare()
					k.seq, k.ids = append(k.seq, p.seq[:same]...), append(k.ids, p.ids[:same]...)
				}
			} else if last {
				t.free = append(t.free, p)
			}
		}
	}
	if !carried {
		k = t.spare()
	}
	h := blockhash.NewKeyed(bs, "", r.CacheSalt)
	if same > 0 {
		t.local, k.seq = h.AppendChainedHashes(t.local[:0], k.seq, k.seq[same-1], r.Tokens[same*bs:])
	} else {
		t.local, k.seq = h.AppendHashes(t.local[:0], k.seq, r.Tokens)
	}
	k.ids = numbers.AppendIDs(k.ids, k.seq[same:])
	if t.left != nil && t.left[i] > 0 {
		k.salt = r.CacheSalt
		t.kept[int32(i)] = k
	} else {
		t.free = append(t.free, k)
	}
	return k.seq, k.ids
}

// taken is how many leading tokens of request i's prompt blocks will
// take from the prompt it extends rather than read, if its salt is that
// prompt's.
func (t *turnBlocks) taken(i, bs int) int {
	if t.prev == nil || t.prev[i] < 0 {
		return 0
	}
	p, ok := t.kept[t.prev[i]]
	if !ok {
		return 0
	}
	return min(int(t.share[i])/bs, len(p.seq)) * bs
}

// spare is empty lists, reused when some are free.
func (t *turnBlocks) spare() promptBlocks {
	n := len(t.free)
	if n == 0 {
		return promptBlocks{}
	}
	k := t.free[n-1]
	t.free = t.free[:n-1]
	k.seq, k.ids = k.seq[:0], k.ids[:0]
	return k
}

// decodeTails counts the blocks each request's decode steps write into,
// beyond its prompt's full blocks. In the decode step that produces its
// token g (g ≥ 1) a request of L prompt tokens holds ⌈(L + g)/bs⌉ blocks:
// its prompt's ⌊L/bs⌋ full blocks and the rest. Two of the rest count:
//   - the partial last block, whenever L + g is not a multiple of bs: an
//     engine never shares a block that is not full;
//   - the full blocks that start at or after token L: they hold generated
//     tokens only, which an engine draws from its seed and the request's
//     prompt. No request's prompt carries them (the workloads' prompts are
//     their own tokens), so only a request with the same prompt on the
//     same engine could write the same blocks: a request whose prompt
//     another request repeats is credited none.
//
// A full block that holds both prompt and generated tokens is not counted.
type decodeTails struct {
	bs      int
	prompts []promptTail
	seen    map[uint64]int32 // how many requests send each prompt
	buf     []byte
}

type promptTail struct {
	tokens, steps int32
	print         uint64 // the whole prompt's fingerprint
}

func newDecodeTails(n, blockSize int) decodeTails {
	return decodeTails{bs: blockSize, prompts: make([]promptTail, 0, n), seen: map[uint64]int32{}}
}

// add takes the next request, its full blocks' chained hashes seq.
func (d *decodeTails) add(r *workload.Request, seq []uint64) {
	var last uint64
	if len(seq) > 0 {
		last = seq[len(seq)-1]
	}
	// The chained hash of the last full block stands for the prompt up to
	// it (salt included); the partial block's tokens and the salt (for a
	// prompt shorter than a block) complete the fingerprint.
	b := binary.LittleEndian.AppendUint64(d.buf[:0], last)
	b = binary.LittleEndian.AppendUint64(b, uint64(len(r.Tokens)))
	for _, t := range r.Tokens[len(seq)*d.bs:] {
		b = binary.LittleEndian.AppendUint32(b, t)
	}
	b = append(b, r.CacheSalt...)
	d.buf = b
	fp := xxh3.Hash(b)
	d.seen[fp]++
	d.prompts = append(d.prompts, promptTail{tokens: int32(len(r.Tokens)), steps: int32(max(r.OSL-1, 0)), print: fp})
}

func (d *decodeTails) requests() int { return len(d.prompts) }

// blockSteps is request i's counted blocks summed over its decode steps.
func (d *decodeTails) blockSteps(i int) int64 {
	p := d.prompts[i]
	alone := d.seen[p.print] == 1
	bs, l := d.bs, int(p.tokens)
	var sum int64
	for g := 1; g <= int(p.steps); g++ {
		if (l+g)%bs != 0 {
			sum++
		}
		if alone {
			sum += int64(max((l+g)/bs-(l+bs-1)/bs, 0))
		}
	}
	return sum
}

// requestOwners gives the requests that can never run at once the same
// owner: the turns of a closed-loop session (each waits for the one
// before, see predecessors). Every other request owns itself.
func requestOwners(w Workload) []int32 {
	owners := make([]int32, w.Len())
	prev := predecessors(w)
	for i := range owners {
		owners[i] = int32(i)
		if prev != nil && prev[i] >= 0 {
			owners[i] = owners[prev[i]]
		}
	}
	return owners
}

// cheapestPrefillPerToken is the least step time per prompt token, in ns,
// over the step sizes the batch budget allows.
func cheapestPrefillPerToken(maxBatched int) float64 {
	best := math.Inf(1)
	for t := 1; t <= max(maxBatched, 1); t++ {
		best = min(best, float64(engine.PrefillTime(t))/float64(t))
	}
	return best
}
