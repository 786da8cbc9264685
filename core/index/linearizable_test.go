package index

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/kv"
)

// linWorker is one worker's side of TestLookupsSeeStatesTheIndexPassedThrough:
// its events, the clock readings around each Apply, and a model of what it
// holds (a count of engine ids per sequence hash).
type linWorker struct {
	w             kv.Worker
	events        []kv.Event
	before, after []uint64
	ids           map[uint64]uint64 // engine id → sequence hash
	refs          map[uint64]int    // sequence hash → engine ids naming it
	idOf          map[uint64]uint64 // sequence hash → one engine id naming it
	nextID        uint64
	prompts       [][]uint64 // local hashes
	promptSeqs    [][]uint64
	rng           *rand.Rand
}

// next draws the worker's next event from its model and applies it to
// the model: extend a prompt's chain from the end of the run it holds,
// drop random blocks (holes included), or, rarely, clear.
func (lw *linWorker) next() kv.Event {
	switch x := lw.rng.IntN(100); {
	case x < 55:
		p := lw.rng.IntN(len(lw.prompts))
		seqs := lw.promptSeqs[p]
		from := 0
		for from < len(seqs) && lw.refs[seqs[from]] > 0 {
			from++
		}
		if from == len(seqs) {
			from = lw.rng.IntN(len(seqs))
		}
		n := min(len(seqs)-from, 1+lw.rng.IntN(3*applyChunk))
		var parent *uint64
		if from > 0 {
			parent = kv.Ptr(lw.idOf[seqs[from-1]])
		}
		blocks := make([]kv.Block, n)
		for i := range blocks {
			lw.nextID++
			id := lw.w.ID<<32 | lw.nextID
			blocks[i] = kv.Block{EngineHash: id, LocalHash: lw.prompts[p][from+i]}
			lw.ids[id] = seqs[from+i]
			lw.refs[seqs[from+i]]++
			lw.idOf[seqs[from+i]] = id
		}
		return kv.StoredEvent(lw.w, 0, parent, blocks...)
	case x < 97:
		var hs []uint64
		for id := range lw.ids {
			if lw.rng.IntN(4) == 0 {
				hs = append(hs, id)
			}
		}
		slices.Sort(hs)
		lw.rng.Shuffle(len(hs), func(i, j int) { hs[i], hs[j] = hs[j], hs[i] })
		for _, id := range hs {
			seq := lw.ids[id]
			delete(lw.ids, id)
			if lw.refs[seq]--; lw.refs[seq] == 0 {
				delete(lw.refs, seq)
				delete(lw.idOf, seq)
			} else if lw.idOf[seq] == id {
				for other, s := range lw.ids {
					if s == seq {
						lw.idOf[seq] = other
						break
					}
				}
			}
		}
		return kv.RemovedEvent(lw.w, 0, hs...)
	default:
		clear(lw.ids)
		clear(lw.refs)
		clear(lw.idOf)
		return kv.ClearedEvent(lw.w, 0)
	}
}

// Lookups run while writers apply events, and every worker's overlap in
// every answer is its overlap in some state the index passed through
// while the lookup ran: a state between two of its events, or one a long
// event passes through as it is applied a chunk at a time. Shards are
// read one after the other, so the answer is checked worker by worker.
func TestLookupsSeeStatesTheIndexPassedThrough(t *testing.T) {
	lookupsSeeStatesPassedThrough(t)
}

// On one core the test's goroutines run by time slices, in which lookups
// of an index that holds nothing yet could all run before any event.
func TestLookupsSeeStatesTheIndexPassedThroughOnOneCore(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	lookupsSeeStatesPassedThrough(t)
}

func lookupsSeeStatesPassedThrough(t *testing.T) {
	for seed := range uint64(3) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			// Prompts share prefixes of several lengths, so workers share
			// nodes and holder sets change along a path.
			var prompts, seqs [][]uint64
			for p := range 6 {
				local := make([]uint64, 3*applyChunk)
				for i := range local {
					local[i] = uint64(i)
					if i >= (p%3)*applyChunk {
						local[i] |= uint64(p+1) << 40
					}
				}
				prompts = append(prompts, local)
				seqs = append(seqs, blockhash.SequenceHashes(local))
			}
			ix := New(Config{Shards: 3})
			var clock atomic.Uint64
			var workers []*linWorker
			for id := range uint64(6) {
				workers = append(workers, &linWorker{
					w: kv.Worker{ID: id + 1, DPRank: uint32(id % 2)}, ids: map[uint64]uint64{}, refs: map[uint64]int{}, idOf: map[uint64]uint64{},
					prompts: prompts, promptSeqs: seqs, rng: rand.New(rand.NewPCG(seed, id)),
				})
			}
			type seen struct {
				from, to uint64
				q        int
				got      map[kv.Worker]uint32
			}
			var wg, writers sync.WaitGroup
			var stop atomic.Bool
			// Lookups are short, and on a loaded machine the
			// test's goroutines may share one core: the writers go on past
			// their 300 rounds until lookups have met their events (calls
			// moved during a lookup) or the readers are done. On one core a
			// goroutine runs until it is preempted, about 10 ms, and lookups
			// of an index that holds nothing yet are short enough that
			// readers used all their lookups in one such slice, before the
			// writers had finished an event, and every answer was empty.
			// Readers and writers yield now and then, so they take turns.
			var calls, met atomic.Int64
			var readersLeft atomic.Int32
			readersLeft.Store(2)
			// Two writers, each with its own workers.
			for g := range 2 {
				writers.Add(1)
				go func() {
					defer writers.Done()
					for round := 0; round < 300 || met.Load() < 100 && readersLeft.Load() > 0 && round < 20000; round++ {
						for i := g; i < len(workers); i += 2 {
							lw := workers[i]
							ev := lw.next()
							lw.events = append(lw.events, ev)
							lw.before = append(lw.before, clock.Add(1))
							calls.Add(1)
							_ = ix.Apply(&ev)
							calls.Add(1)
							lw.after = append(lw.after, clock.Add(1))
						}
						runtime.Gosched()
					}
				}()
			}
			var seenMu sync.Mutex
			var all []seen
			for r := range 2 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					defer readersLeft.Add(-1)
					var m Matcher
					qr := rand.New(rand.NewPCG(seed, 100+uint64(r)))
					for i := 0; i < 200 || !stop.Load() && i < 200000; i++ {
						q := qr.IntN(len(seqs))
						from, c := clock.Add(1), calls.Load()
						out := ix.FindMatches(&m, seqs[q])
						to := clock.Add(1)
						if calls.Load() != c || c%2 != 0 {
							met.Add(1)
						}
						got := map[kv.Worker]uint32{}
						for _, o := range out {
							got[o.Worker] = o.Blocks
						}
						seenMu.Lock()
						all = append(all, seen{from, to, q, got})
						seenMu.Unlock()
						if i%32 == 31 {
							runtime.Gosched()
						}
					}
				}()
			}
			writers.Wait()
			stop.Store(true)
			wg.Wait()
			if err := ix.check(); err != nil {
				t.Fatal(err)
			}
			// Replay each worker's events in a model, keeping every state's
			// overlap with every prompt: after event i (states[i+1]), and
			// between two of its blocks (mid[i]): a writer lets waiting
			// lookups in at any block.
			overlap := func(refs map[uint64]int, q int) uint32 {
				n := uint32(0)
				for _, s := range seqs[q] {
					if refs[s] == 0 {
						break
					}
					n++
				}
				return n
			}
			snapshot := func(refs map[uint64]int) []uint32 {
				v := make([]uint32, len(seqs))
				for q := range seqs {
					v[q] = overlap(refs, q)
				}
				return v
			}
			checked, overlapped, nonzero := 0, 0, 0
			for _, lw := range workers {
				refs := map[uint64]int{}
				ids := map[uint64]uint64{}
				states := [][]uint32{snapshot(refs)}
				mid := make([][][]uint32, len(lw.events))
				for i, ev := range lw.events {
					switch ev.Kind {
					case kv.KindStored:
						// The chain's sequence hashes, from its parent's.
						var prev uint64
						has := ev.Stored.Parent != nil
						if has {
							prev = ids[*ev.Stored.Parent]
						}
						for j, b := range ev.Stored.Blocks {
							if j > 0 {
								mid[i] = append(mid[i], snapshot(refs))
							}
							s := b.LocalHash
							if has || j > 0 {
								s = blockhash.Chain(prev, b.LocalHash)
							}
							ids[b.EngineHash] = s
							refs[s]++
							prev = s
						}
					case kv.KindRemoved:
						for j, h := range ev.Removed.EngineHashes {
							if j > 0 {
								mid[i] = append(mid[i], snapshot(refs))
							}
							s, ok := ids[h]
							if !ok {
								continue
							}
							delete(ids, h)
							if refs[s]--; refs[s] == 0 {
								delete(refs, s)
							}
						}
					case kv.KindCleared:
						clear(ids)
						clear(refs)
					}
					states = append(states, snapshot(refs))
				}
				for _, o := range all {
					// Events done before the lookup began, and events begun
					// before it ended.
					done, _ := slices.BinarySearch(lw.after, o.from)
					begun, _ := slices.BinarySearch(lw.before, o.to)
					got := o.got[lw.w]
					ok := states[done][o.q] == got
					for i := done; i < begun && !ok; i++ {
						ok = states[i+1][o.q] == got
						for _, v := range mid[i] {
							ok = ok || v[o.q] == got
						}
					}
					if !ok {
						var passed []uint32
						for i := done; i <= begun && i < len(states); i++ {
							passed = append(passed, states[i][o.q])
						}
						t.Fatalf("worker %v: overlap %d with prompt %d, but it held %v over the lookup's span (events %d..%d)", lw.w, got, o.q, passed, done, begun)
					}
					checked++
					if begun > done {
						overlapped++
					}
					if got > 0 {
						nonzero++
					}
				}
			}
			if overlapped == 0 || nonzero == 0 {
				// Say how far each worker's events had got while lookups
				// ran, so a run whose lookups all met the index before it
				// held anything is told from one that answered wrongly.
				var reached []string
				for _, lw := range workers {
					most := 0
					for _, o := range all {
						most = max(most, sort.Search(len(lw.before), func(i int) bool { return lw.before[i] >= o.to }))
					}
					reached = append(reached, fmt.Sprintf("%d/%d", most, len(lw.events)))
				}
				t.Fatalf("of %d overlaps checked, %d during an event and %d not 0: the test exercises nothing (%d lookups, %d met an Apply; events begun by a lookup's end, most/all, by worker: %v)",
					checked, overlapped, nonzero, len(all), met.Load(), reached)
			}
		})
	}
}
