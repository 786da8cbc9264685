package router

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/kv"
)

// BenchmarkBestWorkerBooked books, completes and frees 32-block requests
// over 16 workers whose caches hold them: with every worker's events
// arriving, and with one worker silent and routed by prediction.
func BenchmarkBestWorkerBooked(b *testing.B) {
	for _, silent := range []bool{false, true} {
		b.Run(fmt.Sprintf("silent_worker=%v", silent), func(b *testing.B) {
			t := &testing.T{}
			r, c := newRouter(t, 16, nil)
			prompts := make([][]uint32, 64)
			for i := range prompts {
				prompts[i] = tokens(i%8, 24, i, 32)
				wk := uint64(i % 16)
				if silent && wk == 15 {
					id := fmt.Sprint("warm-", i)
					if _, err := r.BestWorker(ctx(), &Request{ID: id, Tokens: prompts[i], Target: &kv.Worker{ID: wk}}); err != nil {
						b.Fatal(err)
					}
					r.MarkPrefillCompleted(id)
					r.Free(id)
					continue
				}
				store(t, r, w(wk), prompts[i])
			}
			c.advance(time.Minute)
			if silent && len(r.Eventless()) != 1 {
				b.Fatal("the silent worker is not routed by prediction")
			}
			ids := make([]string, 1024)
			for i := range ids {
				ids[i] = fmt.Sprint("req-", i)
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				id := ids[i%len(ids)]
				if _, err := r.BestWorker(ctx(), &Request{ID: id, Tokens: prompts[i%len(prompts)]}); err != nil {
					b.Fatal(err)
				}
				r.MarkPrefillCompleted(id)
				r.Free(id)
			}
		})
	}
}

// warmFleet describes a warm benchmark fleet: every worker caches perWorker
// conversations of convTokens tokens, each opening with one shared
// system prompt of systemTokens, stored through engine events.
type warmFleet struct {
	workers, perWorker       int
	systemTokens, convTokens int
	vocab                    uint32
	edit                     func(*Config)
	workerBlockSize          func(id int) int // nil: the router's
}

// build makes the router and returns it with the conversations cached, the
// system prompt and a source of random tokens for new prompts.
func (f warmFleet) build(b testing.TB) (r *Router, convs [][]uint32, system []uint32, random func(n int) []uint32) {
	b.Helper()
	cfg := DefaultConfig()
	cfg.BlockSize = bs
	cfg.Rand = rand.New(rand.NewPCG(1, 2))
	if f.edit != nil {
		f.edit(&cfg)
	}
	r, err := New(cfg)
	if err != nil {
		b.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(3, 4))
	random = func(n int) []uint32 {
		out := make([]uint32, n)
		for i := range out {
			out[i] = rng.Uint32N(f.vocab)
		}
		return out
	}
	system = random(f.systemTokens)
	engineID := uint64(1)
	for id := range f.workers {
		r.AddWorker(WorkerInfo{ID: uint64(id), TotalKVBlocks: 16384, MaxNumBatchedTokens: 8192})
		size := bs
		if f.workerBlockSize != nil {
			size = f.workerBlockSize(id)
		}
		for range f.perWorker {
			toks := append(append([]uint32{}, system...), random(f.convTokens-f.systemTokens)...)
			n := len(toks) / size
			es := EngineStored{Worker: kv.Worker{ID: uint64(id)}, Tokens: toks[:n*size], BlockSize: size}
			for range n {
				es.EngineHashes = append(es.EngineHashes, engineID)
				engineID++
			}
			if err := r.ApplyEngineStored(&es); err != nil {
				b.Fatal(err)
			}
			convs = append(convs, toks)
		}
	}
	return r, convs, system, random
}

// benchRouter is a 16-worker router whose workers each cache 16
// conversations of 2,048 tokens sharing a 512-token system prompt; prompts
// continue one of them (three quarters cached on one worker).
func benchRouter(b *testing.B, edit func(*Config), workerBlockSize func(id int) int) (*Router, [][]uint32) {
	b.Helper()
	r, convs, _, random := warmFleet{workers: 16, perWorker: 16, systemTokens: 512, convTokens: 2048, vocab: 32000,
		edit: edit, workerBlockSize: workerBlockSize}.build(b)
	pick := rand.New(rand.NewPCG(5, 6))
	prompts := make([][]uint32, 256)
	for i := range prompts {
		c := convs[pick.IntN(len(convs))]
		prompts[i] = append(append([]uint32{}, c[:1536]...), random(512)...)
	}
	return r, prompts
}

func BenchmarkBestWorker(b *testing.B) {
	cases := []struct {
		name string
		size func(int) int
	}{
		{"one-block-size", nil},
		// Half the engines publish 32-token blocks on a 16-token router:
		// every request is hashed and matched twice.
		{"two-block-sizes", func(id int) int { return bs * (1 + id%2) }},
	}
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			r, prompts := benchRouter(b, nil, c.size)
			for i := 0; b.Loop(); i++ {
				if _, err := r.BestWorker(ctx(), &Request{Tokens: prompts[i%len(prompts)]}); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkBookAndFree is a booked decision and its release: the whole
// per-request cost of the routing core.
func BenchmarkBookAndFree(b *testing.B) {
	r, prompts := benchRouter(b, nil, nil)
	for i := 0; b.Loop(); i++ {
		id := strconv.Itoa(i)
		if _, err := r.BestWorker(ctx(), &Request{ID: id, Tokens: prompts[i%len(prompts)]}); err != nil {
			b.Fatal(err)
		}
		r.Free(id)
	}
}

// BenchmarkBestWorkerLoaded times one booked decision (hash, match, score, book)
// and the release of the oldest in flight, on 64 workers, eight of which
// cache one of eight 64-block conversations; 128 requests stay in flight,
// half of them still waiting for prefill so the cost's queue terms are live.
func BenchmarkBestWorkerLoaded(b *testing.B) {
	r, _ := newRouter(b, 64, nil)
	for c := range 8 {
		store(b, r, w(uint64(c*8)), tokens(c+1, 64, c+1, 64))
	}
	prompts := make([][]uint32, 512)
	ids := make([]string, len(prompts))
	for i := range prompts {
		prompts[i] = tokens(i%8+1, 64, 100+i, 80)
		ids[i] = fmt.Sprint("b", i)
	}
	ring := make([]string, 128)
	n := 0
	book := func() {
		slot := n % len(ring)
		if ring[slot] != "" {
			r.Free(ring[slot])
		}
		id := ids[n%len(ids)]
		if _, err := route(r, id, prompts[n%len(prompts)]); err != nil {
			b.Fatal(err)
		}
		if n%2 == 0 {
			r.MarkPrefillCompleted(id)
		}
		ring[slot] = id
		n++
	}
	timeBooked(b, len(ring), book)
}

// BenchmarkBestWorkerFleet is `kvrouter bench route` in small: 8,192-token
// prompts over a fleet whose every worker caches four conversations
// sharing a 1,024-token system prompt, with predict-on-route on and the
// real clock. Half the prompts continue a conversation (three quarters
// cached on one worker), half start one (the system prompt cached
// everywhere); each decision is booked, its prefill completed and the
// oldest of 128 in flight freed. At a thousand workers every stage that
// visits each worker shows.
func BenchmarkBestWorkerFleet(b *testing.B) {
	for _, workers := range []int{64, 1000} {
		b.Run(fmt.Sprintf("workers=%d", workers), func(b *testing.B) {
			const isl, systemTokens = 8192, 1024
			r, convs, system, random := warmFleet{workers: workers, perWorker: 4, systemTokens: systemTokens, convTokens: isl, vocab: 128000}.build(b)
			rng := rand.New(rand.NewPCG(5, 6))
			prompts := make([][]uint32, 64)
			for i := range prompts {
				if i%2 == 0 {
					c := convs[rng.IntN(len(convs))]
					prompts[i] = append(append([]uint32{}, c[:isl*3/4]...), random(isl/4)...)
				} else {
					prompts[i] = append(append([]uint32{}, system...), random(isl-systemTokens)...)
				}
			}
			ring := make([]string, 128)
			n := 0
			book := func() {
				id := strconv.Itoa(n)
				if _, err := r.BestWorker(ctx(), &Request{ID: id, Tokens: prompts[n%len(prompts)]}); err != nil {
					b.Fatal(err)
				}
				r.MarkPrefillCompleted(id)
				slot := n % len(ring)
				if ring[slot] != "" {
					r.Free(ring[slot])
				}
				ring[slot] = id
				n++
			}
			// The predicted lookup past the depth every worker holds, and
			// (predicted=every) the whole lookup, one after the other on
			// one warm router.
			for _, every := range []bool{false, true} {
				b.Run(map[bool]string{false: "predicted=beyond", true: "predicted=every"}[every], func(b *testing.B) {
					r.predictEveryDepth = every
					timeBooked(b, len(ring), book)
				})
			}
		})
	}
}

// timeBooked books until inFlight requests are in flight, then times
// booking, each call freeing the oldest. It also reports the benchmark
// thread's CPU time per decision (cpu-ns/op), which the other work of a
// shared machine does not inflate as much as the wall clock.
func timeBooked(b *testing.B, inFlight int, book func()) {
	for range inFlight {
		book()
	}
	b.ReportAllocs()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	cpu0, ok := threadCPU()
	n := 0
	for b.Loop() {
		book()
		n++
	}
	if cpu1, ok1 := threadCPU(); ok && ok1 && n > 0 {
		b.ReportMetric(float64(cpu1-cpu0)/float64(n), "cpu-ns/op")
	}
}

// A booked decision on a warm router, with predict-on-route, allocates
// nothing once its pools have grown: no per-decision garbage for the
// collector to chase at thousands of decisions a second.
func TestSteadyDecisionAllocatesNothing(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector empties sync.Pool at random")
	}
	clock := time.Unix(1_000_000, 0)
	r, convs, system, random := warmFleet{workers: 8, perWorker: 2, systemTokens: 256, convTokens: 2048, vocab: 32000,
		edit: func(c *Config) { c.Now = func() time.Time { return clock } }}.build(t)
	var reqs [256]Request
	for i := range reqs {
		toks := append(append([]uint32{}, system...), random(1024)...)
		if i%2 == 0 {
			toks = append(append([]uint32{}, convs[i%len(convs)][:1536]...), random(512)...)
		}
		reqs[i] = Request{ID: strconv.Itoa(i), Tokens: toks}
	}
	n := 0
	book := func() {
		// Past the confirm window every few decisions, so that settled
		// predictions are dropped and their lists recycled.
		clock = clock.Add(100 * time.Millisecond)
		req := &reqs[n%len(reqs)]
		if _, err := r.BestWorker(ctx(), req); err != nil {
			t.Fatal(err)
		}
		r.MarkPrefillCompleted(req.ID)
		r.Free(reqs[(n+len(reqs)-32)%len(reqs)].ID)
		n++
	}
	for range 4 * len(reqs) {
		book()
	}
	if a := testing.AllocsPerRun(1000, book); a != 0 {
		t.Fatalf("%.2f allocations per decision", a)
	}
}

// BenchmarkSubmitQueued submits requests of 512 blocks, with their hashes,
// that the admission queue holds, then dispatches and frees them: the
// simulator's path in an overloaded run. The router copies the hashes
// (copied) or keeps the caller's (lent: Request.LentHashes). An op is one
// request.
func BenchmarkSubmitQueued(b *testing.B) {
	const n, blocks = 256, 512
	for _, lend := range []bool{false, true} {
		b.Run(map[bool]string{false: "copied", true: "lent"}[lend], func(b *testing.B) {
			r, _ := newRouter(b, 1, func(c *Config) {
				q := 1.0
				c.QueueThreshold = &q
			})
			r.AddWorker(WorkerInfo{ID: 0, TotalKVBlocks: 1 << 20, MaxNumBatchedTokens: 100})
			// A worker whose events come, as the simulator's engines'.
			if err := r.ApplyEngineStored(&EngineStored{Worker: w(0), EngineHashes: []uint64{1}, Tokens: tokens(9, 0, 9, 1), BlockSize: bs}); err != nil {
				b.Fatal(err)
			}
			var pending []string
			reqs := make([]Request, n)
			fns := make([]func(Decision, error), n)
			for i := range reqs {
				toks := tokens(2, blocks/2, 3+i, blocks)
				local := blockhash.NewKeyed(bs, "", "").AppendLocalHashes(nil, toks)
				reqs[i] = Request{ID: strconv.Itoa(i), Tokens: toks, LocalHashes: local, SeqHashes: blockhash.SequenceHashes(local), LentHashes: lend}
				fns[i] = func(_ Decision, err error) {
					if err != nil {
						b.Fatal(err)
					}
					pending = append(pending, reqs[i].ID)
				}
			}
			b.ReportAllocs()
			ops := 0
			for b.Loop() {
				// A prompt never seen, so that it is not taken as cached:
				// its prefill makes the worker busy.
				blocker := Request{ID: "blocker", Tokens: tokens(1, 0, 1000+ops, 10)}
				if _, queued, err := r.Submit(&blocker, fns[0]); err != nil || queued {
					b.Fatalf("blocker: queued %v, %v", queued, err)
				}
				for i := range reqs {
					if _, queued, err := r.Submit(&reqs[i], fns[i]); err != nil || !queued {
						b.Fatalf("request %d: queued %v, %v", i, queued, err)
					}
				}
				pending = append(pending[:0], blocker.ID)
				for k := 0; k < len(pending); k++ {
					r.MarkPrefillCompleted(pending[k])
					r.Free(pending[k])
				}
				if len(pending) != n+1 {
					b.Fatalf("%d of %d queued requests dispatched", len(pending)-1, n)
				}
				ops += n
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(ops), "ns/request")
		})
	}
}
