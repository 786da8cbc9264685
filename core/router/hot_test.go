package router

import (
	"fmt"
	"math"
	"slices"
	"testing"
	"time"
)

// hotFleet is a closed-loop simulation, in virtual time, of clients
// continuing a few cached conversations on engines timed like the mocker:
// each engine prefills one request at a time, only the tokens it does not
// cache, at the mocker's fitted speed, then decodes at a fixed step. The
// engines cache what they prefill and tell the router, as their KV events
// would.
type hotFleet struct {
	t       *testing.T
	r       *Router
	clk     *clock
	convs   int // conversations the clients continue
	prefix  int // blocks of each conversation's history
	turn    int // new blocks each request adds
	decode  time.Duration
	cached  []map[int]bool // per engine: conversations it holds
	free    []time.Time    // per engine: when its prefill lane is next free
	pending []hotEvent
	next    int // requests issued so far, for ids and fresh turns
	// routed counts, per engine, the requests routed since the last
	// reset; ttft sums their times to first token.
	routed []int
	ttft   time.Duration
}

type hotEvent struct {
	at       time.Time
	id       string
	engine   int
	client   int
	firstTok bool // prefill done; otherwise the request ends
	conv     int
}

// prefillTime is the mocker's step-time fit for t new tokens
// (mocker/engine.PrefillTime).
func prefillTime(t int) time.Duration {
	if t <= 0 {
		return 0
	}
	x := float64(t)
	return time.Duration(math.Round((4.209989e-7*x*x + 1.518344e-2*x + 16.50142) * float64(time.Millisecond)))
}

func newHotFleet(t *testing.T, engines int) *hotFleet {
	r, clk := newRouter(t, engines, nil)
	h := &hotFleet{t: t, r: r, clk: clk, convs: 8, prefix: 64, turn: 16, decode: 8 * 10 * time.Millisecond,
		cached: make([]map[int]bool, engines), free: make([]time.Time, engines), routed: make([]int, engines)}
	for e := range engines {
		h.cached[e] = map[int]bool{}
	}
	return h
}

func (h *hotFleet) history(conv int) []uint32 { return tokens(conv+1, h.prefix, conv+1, h.prefix) }

// warm has engine e prefill every conversation's history.
func (h *hotFleet) warm(e int) {
	for c := range h.convs {
		store(h.t, h.r, w(uint64(e)), h.history(c))
		h.cached[e][c] = true
	}
}

// restart empties engine e: the router loses it and it rejoins with an
// empty cache; its requests in flight fail and are freed.
func (h *hotFleet) restart(e int) {
	h.r.RemoveWorker(uint64(e))
	h.r.AddWorker(WorkerInfo{ID: uint64(e), TotalKVBlocks: 16384, MaxNumBatchedTokens: 8192})
	h.cached[e] = map[int]bool{}
	kept := h.pending[:0]
	var failed []hotEvent
	for _, ev := range h.pending {
		switch {
		case ev.engine != e:
			kept = append(kept, ev)
		case !ev.firstTok:
			failed = append(failed, ev) // its client retries now
		}
	}
	h.pending = kept
	h.free[e] = h.clk.now()
	for _, ev := range failed {
		h.r.Free(ev.id)
		h.send(ev.client)
	}
}

func (h *hotFleet) send(client int) {
	conv := h.next % h.convs
	id := fmt.Sprint("req-", h.next)
	h.next++
	toks := append(h.history(conv), tokens(0, 0, 1_000_000+h.next, h.turn)...)
	d, err := route(h.r, id, toks)
	if err != nil {
		h.t.Fatal(err)
	}
	e := int(d.Worker.ID)
	now := h.clk.now()
	uncached := len(toks)
	if h.cached[e][conv] {
		uncached -= h.prefix * bs
	}
	start := now
	if h.free[e].After(start) {
		start = h.free[e]
	}
	done := start.Add(prefillTime(uncached))
	h.free[e] = done
	h.routed[e]++
	h.ttft += done.Sub(now)
	h.pending = append(h.pending, hotEvent{at: done, id: id, engine: e, client: client, firstTok: true, conv: conv})
}

// run keeps clients requests in flight for d of virtual time.
func (h *hotFleet) run(clients int, d time.Duration) {
	end := h.clk.now().Add(d)
	for c := range clients {
		h.send(c)
	}
	h.loop(end)
}

func (h *hotFleet) loop(end time.Time) {
	for len(h.pending) > 0 {
		i := 0
		for j, ev := range h.pending {
			if ev.at.Before(h.pending[i].at) {
				i = j
			}
		}
		ev := h.pending[i]
		if ev.at.After(end) {
			return
		}
		h.pending = slices.Delete(h.pending, i, i+1)
		h.clk.advance(ev.at.Sub(h.clk.now()))
		if ev.firstTok {
			h.r.MarkPrefillCompleted(ev.id)
			store(h.t, h.r, w(uint64(ev.engine)), h.history(ev.conv))
			h.cached[ev.engine][ev.conv] = true
			ev.firstTok = false
			ev.at = ev.at.Add(h.decode)
			h.pending = append(h.pending, ev)
			continue
		}
		h.r.Free(ev.id)
		h.send(ev.client)
	}
}

func (h *hotFleet) reset() {
	clear(h.routed)
	h.ttft = 0
}

func (h *hotFleet) meanTTFT() time.Duration {
	n := 0
	for _, c := range h.routed {
		n += c
	}
	return h.ttft / time.Duration(max(n, 1))
}

// Eight conversations cached on engine 0, twelve clients continuing them:
// engine 0 prefills only each request's new turn (16 blocks, 20 ms) where
// engine 1 would prefill the whole prompt (80 blocks, 37 ms), but with
// every request on engine 0 each waits behind up to eleven others, far
// longer than its cache saves. Engine 1 must get a fair share, and the
// mean time to first token must beat what engine 0 alone would give.
func TestHotConversationsDoNotStarveAnIdleEngine(t *testing.T) {
	h := newHotFleet(t, 2)
	h.warm(0)
	h.run(12, 12*time.Second)
	share := float64(h.routed[1]) / float64(h.routed[0]+h.routed[1])
	t.Logf("routed %v, mean TTFT %v", h.routed, h.meanTTFT())
	if share < 1.0/3 {
		t.Fatalf("the idle engine got %.0f %% of the requests (%v)", 100*share, h.routed)
	}

	alone := newHotFleet(t, 1)
	alone.warm(0)
	alone.run(12, 12*time.Second)
	if h.meanTTFT() >= alone.meanTTFT() {
		t.Fatalf("mean TTFT %v with two engines, %v with engine 0 alone", h.meanTTFT(), alone.meanTTFT())
	}
}

// An engine that restarts comes back empty while the other holds every
// conversation; it must get traffic again.
func TestRestartedEngineGetsTrafficBack(t *testing.T) {
	h := newHotFleet(t, 2)
	h.warm(0)
	h.warm(1)
	h.run(12, 4*time.Second)
	h.restart(1)
	h.reset()
	h.loop(h.clk.now().Add(12 * time.Second))
	share := float64(h.routed[1]) / float64(h.routed[0]+h.routed[1])
	t.Logf("after the restart: routed %v, mean TTFT %v", h.routed, h.meanTTFT())
	if share < 1.0/3 {
		t.Fatalf("the restarted engine got %.0f %% of the requests (%v)", 100*share, h.routed)
	}
}
