package index

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/kv"
)

// predModel is the reference: a list of predictions, each a worker, a
// prompt and a deadline. A live prediction that is a prefix of the query
// counts whole; one that diverges from it counts its common prefix rounded
// down to whole strides (what holding every stride and the last block can
// see). A worker's overlap is the most any of its predictions counts.
type predModel struct {
	preds []modelPred
	open  map[string]int
}

type modelPred struct {
	id   string
	w    kv.Worker
	seq  []uint64
	at   time.Time
	gone bool
}

func (m *predModel) add(id string, w kv.Worker, seq []uint64, at time.Time) {
	if i, ok := m.open[id]; ok {
		m.preds[i].gone = true
	}
	m.open[id] = len(m.preds)
	m.preds = append(m.preds, modelPred{id: id, w: w, seq: seq, at: at})
}

func (m *predModel) settle(id string, at time.Time) {
	if i, ok := m.open[id]; ok {
		delete(m.open, id)
		if at.Before(m.preds[i].at) {
			m.preds[i].at = at
		}
	}
}

func (m *predModel) removeWorker(id uint64) {
	for i := range m.preds {
		if m.preds[i].w.ID == id {
			m.preds[i].gone = true
			if m.open[m.preds[i].id] == i {
				delete(m.open, m.preds[i].id)
			}
		}
	}
}

func (m *predModel) find(seq []uint64, now time.Time) map[kv.Worker]int {
	out := map[kv.Worker]int{}
	for _, p := range m.preds {
		if p.gone || !now.Before(p.at) {
			continue
		}
		n := 0
		for n < len(seq) && n < len(p.seq) && seq[n] == p.seq[n] {
			n++
		}
		if n < len(p.seq) {
			n -= n % predictedStride
		}
		if n > out[p.w] {
			out[p.w] = n
		}
	}
	for w, n := range out {
		if n == 0 {
			delete(out, w)
		}
	}
	return out
}

// promptTree builds prompts that share prefixes of many lengths: prompt
// i extends a random earlier one by a few blocks, so holder sets shrink at
// every depth and inside jumps.
func promptTree(r *rand.Rand, n int) [][]uint64 {
	locals := make([][]uint64, 0, n)
	next := uint64(1)
	for i := range n {
		var base []uint64
		if i > 0 && r.IntN(4) != 0 {
			parent := locals[r.IntN(len(locals))]
			base = append(base, parent[:r.IntN(len(parent)+1)]...)
		}
		for range 1 + r.IntN(40) {
			base = append(base, next)
			next++
		}
		locals = append(locals, base)
	}
	seqs := make([][]uint64, n)
	for i, l := range locals {
		seqs[i] = blockhash.SequenceHashes(l)
	}
	return seqs
}

func TestPredictedMatchesReferenceModel(t *testing.T) {
	for seed := range uint64(20) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			r := rand.New(rand.NewPCG(seed, 9))
			c := &fakeClock{t: time.Unix(1000, 0)}
			const ttl = 30 * time.Second
			p := NewPredicted(ApproxConfig{TTL: ttl, Now: c.now})
			m := &predModel{open: map[string]int{}}
			prompts := promptTree(r, 60)
			workers := []kv.Worker{{ID: 1}, {ID: 2}, {ID: 2, DPRank: 1}, {ID: 3}, {ID: 4}, {ID: 5}}
			if seed%2 == 1 { // blocks with more holders than a list walk takes
				for id := range uint64(40) {
					workers = append(workers, kv.Worker{ID: 100 + id, DPRank: uint32(id % 3)})
				}
			}
			var mt Matcher
			for step := range 3000 {
				switch op := r.IntN(100); {
				case op < 40:
					id := fmt.Sprint("r", r.IntN(200))
					w, seq := workers[r.IntN(len(workers))], prompts[r.IntN(len(prompts))]
					p.Add(id, w, seq, c.now())
					m.add(id, w, seq, c.now().Add(ttl))
				case op < 60:
					id := fmt.Sprint("r", r.IntN(200))
					window := time.Duration(r.IntN(3000)) * time.Millisecond
					p.Settle(id, window)
					m.settle(id, c.now().Add(window))
				case op < 62:
					id := workers[r.IntN(len(workers))].ID
					p.RemoveWorker(id)
					m.removeWorker(id)
				case op < 80:
					c.advance(time.Duration(r.IntN(2000)) * time.Millisecond)
				default:
					q := prompts[r.IntN(len(prompts))]
					if r.IntN(2) == 0 { // a query that diverges from a known prompt
						q = append(append([]uint64(nil), q[:r.IntN(len(q)+1)]...), uint64(r.Uint64()))
					}
					got := map[kv.Worker]int{}
					for _, o := range p.FindMatches(&mt, q, c.now()) {
						got[o.Worker] = int(o.Blocks)
					}
					want := m.find(q, c.now())
					if fmt.Sprint(got) != fmt.Sprint(want) {
						t.Fatalf("step %d: overlaps %v, want %v", step, got, want)
					}
					// Beyond a depth, exactly the workers predicted deeper.
					from := r.IntN(len(q) + 2)
					clear(got)
					for _, o := range p.FindMatchesBeyond(&mt, q, c.now(), from) {
						got[o.Worker] = int(o.Blocks)
					}
					maps.DeleteFunc(want, func(_ kv.Worker, n int) bool { return n <= from })
					if fmt.Sprint(got) != fmt.Sprint(want) {
						t.Fatalf("step %d: overlaps beyond %d %v, want %v", step, from, got, want)
					}
				}
				if err := checkPairKeys(p); err != nil {
					t.Fatalf("step %d: %v", step, err)
				}
			}
			// Everything expires: no pair may be left behind.
			c.advance(ttl)
			p.FindMatches(&mt, prompts[0], c.now())
			if st := p.Stats(); st.Pairs != 0 || p.heads.Len() != 0 {
				t.Fatalf("after every deadline: %d pairs, %d heads", st.Pairs, p.heads.Len())
			}
		})
	}
}

// checkPairKeys holds p's pair keys to what holderOf relies on: every
// holder of a block of more than shortList holders, and no other.
func checkPairKeys(p *Predicted) error {
	want := 0
	var err error
	p.heads.Range(func(h uint64, first uint32) bool {
		if p.holders[first-1].count <= shortList {
			return true
		}
		for i := first; i != 0; i = p.holders[i-1].next {
			want++
			if got := p.find(h, p.holders[i-1].w); got != i {
				err = fmt.Errorf("holder %d of block %x: pair key finds %d", i, h, got)
				return false
			}
		}
		return true
	})
	if err == nil && p.byPair.Len() != want {
		err = fmt.Errorf("%d pair keys, want %d", p.byPair.Len(), want)
	}
	return err
}

// Requests whose router never settles them (lost, crashed clients) go at
// the TTL; the index does not grow with them.
func TestPredictedForgetsUnsettledAtTheTTL(t *testing.T) {
	c := &fakeClock{t: time.Unix(1000, 0)}
	p := NewPredicted(ApproxConfig{TTL: 30 * time.Second, Now: c.now})
	for i := range 10_000 {
		_, seq := chain(uint64(3*i+1), uint64(3*i+2), uint64(3*i+3))
		p.Add(fmt.Sprint(i), kv.Worker{ID: uint64(i % 7)}, seq, c.now())
		c.advance(10 * time.Millisecond)
	}
	// 30 s of bookings 10 ms apart, each holding its last block.
	if st := p.Stats(); st.Pairs != 3000 || len(p.open) != 3000 {
		t.Fatalf("%d pairs and %d open predictions, want 3000 and 3000", st.Pairs, len(p.open))
	}
}

func TestPredictedSizeBound(t *testing.T) {
	c := &fakeClock{t: time.Unix(1000, 0)}
	p := NewPredicted(ApproxConfig{MaxBlocks: 100, PruneRatio: 0.5, Now: c.now})
	var mt Matcher
	prompt := func(i int) []uint64 {
		local := make([]uint64, 5*predictedStride) // holds 5 blocks
		for j := range local {
			local[j] = uint64(1000*i + j + 1)
		}
		return blockhash.SequenceHashes(local)
	}
	for i := range 30 {
		p.Add(fmt.Sprint(i), kv.Worker{ID: 1}, prompt(i), c.now())
		c.advance(time.Millisecond)
		if st := p.Stats(); st.Pairs > 100 {
			t.Fatalf("after %d adds: %d pairs above the bound", i+1, st.Pairs)
		}
	}
	// The latest prediction survives pruning; the earliest went first.
	if depthOf(p.FindMatches(&mt, prompt(29), c.now()), kv.Worker{ID: 1}) != 5*predictedStride || depthOf(p.FindMatches(&mt, prompt(0), c.now()), kv.Worker{ID: 1}) != 0 {
		t.Fatal("pruning did not take the earliest deadlines first")
	}
	if p.Stats().Evicted == 0 {
		t.Fatal("evictions not counted")
	}
}

func BenchmarkPredicted(b *testing.B) {
	// 8,192-token prompts (512 blocks of 16) on 64 workers: a booking, the
	// lookup of the next request and a settle, as the router does per
	// request; 256 sessions whose turns extend their previous prompt.
	c := &fakeClock{t: time.Unix(1000, 0)}
	p := NewPredicted(ApproxConfig{TTL: 30 * time.Second, Now: c.now})
	prompts := make([][]uint64, 256)
	for i := range prompts {
		local := make([]uint64, 512)
		for j := range local {
			local[j] = uint64(i)<<32 | uint64(j)
		}
		prompts[i] = blockhash.SequenceHashes(local)
	}
	var mt Matcher
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		seq := prompts[i%len(prompts)]
		p.FindMatches(&mt, seq, c.now())
		id := fmt.Sprint(i % 4096)
		p.Add(id, kv.Worker{ID: uint64(i % 64)}, seq, c.now())
		p.Settle(id, 2*time.Second)
		c.advance(time.Millisecond)
	}
}

// The queue pops the earliest deadline, of equal ones the earliest
// booked, through pushes, deadlines brought forward and removals (which
// prediction an eviction drops), and every entry knows its index.
func TestDeadlineQueueMatchesReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 8))
	var q deadlineQueue
	var ref []*prediction // the queued predictions, unordered
	first := func() int {
		best := 0
		for i, pr := range ref {
			if b := ref[best]; pr.at < b.at || (pr.at == b.at && pr.seq < b.seq) {
				best = i
			}
		}
		return best
	}
	take := func(i int) { ref = slices.Delete(ref, i, i+1) }
	for step := range 20000 {
		switch op := rng.IntN(8); {
		case len(ref) > 0 && op < 2:
			want := ref[first()]
			if got := q.pop(); got != want {
				t.Fatalf("step %d: pop (%d, %d), want (%d, %d)", step, got.at, got.seq, want.at, want.seq)
			}
			take(first())
		case len(ref) > 0 && op == 2:
			i := rng.IntN(len(ref))
			q.remove(ref[i])
			take(i)
		case len(ref) > 0 && op == 3:
			pr := ref[rng.IntN(len(ref))]
			if at := int64(rng.IntN(50)); at < pr.at {
				pr.at = at
				q.up(pr.pos)
			}
		default:
			pr := &prediction{at: int64(rng.IntN(50)), seq: uint64(step)}
			q.push(pr)
			ref = append(ref, pr)
		}
		if len(q.items) != len(ref) {
			t.Fatalf("step %d: %d queued, want %d", step, len(q.items), len(ref))
		}
		for i, pr := range q.items {
			if pr.pos != i {
				t.Fatalf("step %d: entry %d thinks it is at %d", step, i, pr.pos)
			}
		}
	}
}

// A settled prediction's deadline moves in the queue instead of adding an
// entry: once the settled ones have expired the queue is empty, where it
// kept each booking's TTL entry for the TTL.
func TestSettledPredictionsLeaveTheQueue(t *testing.T) {
	c := &fakeClock{t: time.Unix(1000, 0)}
	p := NewPredicted(ApproxConfig{TTL: 30 * time.Second, Now: c.now})
	var mt Matcher
	for i := range 1000 {
		_, seq := chain(uint64(3*i+1), uint64(3*i+2), uint64(3*i+3))
		id := fmt.Sprint(i)
		p.Add(id, kv.Worker{ID: uint64(i % 7)}, seq, c.now())
		p.Settle(id, 2*time.Second)
		c.advance(time.Millisecond)
	}
	c.advance(3 * time.Second)
	p.FindMatches(&mt, []uint64{1}, c.now())
	if n, st := len(p.queue.items), p.Stats(); n != 0 || st.Pairs != 0 || st.Expired != 1000 {
		t.Fatalf("%d queued, %d pairs, %d expired; want 0, 0 and 1000", n, st.Pairs, st.Expired)
	}
}

// A steady stream of bookings, each settled and expiring 2 s later,
// allocates nothing once the first have expired: expired predictions and
// their held lists serve the next bookings.
func TestPredictedSteadyBookingAllocatesNothing(t *testing.T) {
	c := &fakeClock{t: time.Unix(1000, 0)}
	p := NewPredicted(ApproxConfig{TTL: 30 * time.Second, Now: c.now})
	var mt Matcher
	const n = 256
	prompts := make([][]uint64, n)
	ids := make([]string, 4096)
	for i := range prompts {
		local := make([]uint64, 64)
		for j := range local {
			local[j] = uint64(i)<<32 | uint64(j)
		}
		prompts[i] = blockhash.SequenceHashes(local)
	}
	for i := range ids {
		ids[i] = fmt.Sprint(i)
	}
	book := func(i int) {
		seq := prompts[i%n]
		p.FindMatches(&mt, seq, c.now())
		p.Add(ids[i%len(ids)], kv.Worker{ID: uint64(i % 64)}, seq, c.now())
		p.Settle(ids[i%len(ids)], 2*time.Second)
		c.advance(time.Millisecond)
	}
	i := 0
	for ; i < 3000; i++ { // 3 s: past the 2 s window
		book(i)
	}
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for ; i < 6000; i++ {
		book(i)
	}
	runtime.ReadMemStats(&after)
	if m := after.Mallocs - before.Mallocs; m != 0 {
		t.Fatalf("%d allocations in 3,000 steady bookings", m)
	}
}

// BenchmarkPredictedSharedPrefix looks up prompts that share only a
// system prompt with the live predictions of every worker of a fleet: the
// lookup follows the whole fleet down the system prompt and drops it where
// the prompts part.
func BenchmarkPredictedSharedPrefix(b *testing.B) {
	for _, workers := range []int{64, 1000} {
		b.Run(fmt.Sprintf("workers=%d", workers), func(b *testing.B) {
			c := &fakeClock{t: time.Unix(1000, 0)}
			p := NewPredicted(ApproxConfig{TTL: time.Hour, MaxBlocks: 1 << 30, Now: c.now})
			prompt := func(i int) []uint64 {
				local := make([]uint64, 512)
				for j := range local {
					local[j] = uint64(j)
					if j >= 64 {
						local[j] |= uint64(i+1) << 32
					}
				}
				return blockhash.SequenceHashes(local)
			}
			for w := range workers {
				p.Add(fmt.Sprint(w), kv.Worker{ID: uint64(w)}, prompt(w), c.now())
			}
			queries := make([][]uint64, 16)
			for i := range queries {
				queries[i] = prompt(workers + i)
			}
			var mt Matcher
			// from 64: past the prefix every worker holds, as a router
			// whose workers all hold it by their events looks up.
			for _, from := range []int{0, 64} {
				b.Run(fmt.Sprintf("from=%d", from), func(b *testing.B) {
					i := 0
					for b.Loop() {
						p.FindMatchesBeyond(&mt, queries[i%len(queries)], c.now(), from)
						i++
					}
				})
			}
		})
	}
}

// burstPrompts are n prompts of 512 blocks each, none sharing a block.
func burstPrompts(n int) [][]uint64 {
	prompts := make([][]uint64, n)
	for i := range prompts {
		local := make([]uint64, 512)
		for j := range local {
			local[j] = uint64(i+1)<<32 | uint64(j)
		}
		prompts[i] = blockhash.SequenceHashes(local)
	}
	return prompts
}

// A lull that lets every prediction expire leaves the tables their room,
// so the next burst books into them without resizing.
func TestPredictedTablesKeepTheirRoom(t *testing.T) {
	c := &fakeClock{t: time.Unix(1000, 0)}
	p := NewPredicted(ApproxConfig{TTL: time.Second, Now: c.now})
	prompts := burstPrompts(64)
	var mt Matcher
	var heads, pairs int
	for round := range 3 {
		for i, seq := range prompts {
			p.Add(fmt.Sprint(i), kv.Worker{ID: uint64(i % 8)}, seq, c.now())
		}
		if round == 0 {
			heads, pairs = len(p.heads.slots), len(p.byPair.slots)
		}
		c.advance(2 * time.Second)
		p.FindMatches(&mt, prompts[0], c.now())
		if st := p.Stats(); st.Pairs != 0 || p.heads.Len() != 0 || p.byPair.Len() != 0 {
			t.Fatalf("round %d: %d pairs, %d heads, %d pair keys left", round, st.Pairs, p.heads.Len(), p.byPair.Len())
		}
		if len(p.heads.slots) != heads || len(p.byPair.slots) != pairs {
			t.Fatalf("round %d: tables of %d and %d slots, want %d and %d kept", round, len(p.heads.slots), len(p.byPair.slots), heads, pairs)
		}
	}
}

// BenchmarkPredictedBursts books 64 prompts of 512 blocks, then lets them
// all expire: traffic with lulls between its bursts.
func BenchmarkPredictedBursts(b *testing.B) {
	c := &fakeClock{t: time.Unix(1000, 0)}
	p := NewPredicted(ApproxConfig{TTL: time.Second, Now: c.now})
	prompts := burstPrompts(64)
	var mt Matcher
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		for i, seq := range prompts {
			p.Add(fmt.Sprint(i), kv.Worker{ID: uint64(i % 8)}, seq, c.now())
		}
		c.advance(2 * time.Second)
		p.FindMatches(&mt, prompts[0], c.now())
	}
}
