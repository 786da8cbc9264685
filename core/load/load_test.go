package load

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/kv"
)

type fakeClock struct{ t time.Time }

func (c *fakeClock) Now() time.Time          { return c.t }
func (c *fakeClock) Advance(d time.Duration) { c.t = c.t.Add(d) }

func newClock() *fakeClock { return &fakeClock{t: time.Unix(1_700_000_000, 0)} }

func ptr(b bool) *bool { return &b }

// chain turns local block values into sequence hashes, as the router does.
func chain(local ...uint64) []uint64 {
	return blockhash.SequenceHashes(local)
}

func seqOf(start uint64, n int) []uint64 {
	local := make([]uint64, n)
	for i := range local {
		local[i] = start + uint64(i)
	}
	return chain(local...)
}

var (
	w1 = kv.Worker{ID: 1}
	w2 = kv.Worker{ID: 2}
	w3 = kv.Worker{ID: 1, DPRank: 1}
)

func mustAdd(t testing.TB, tr *Tracker, r Request) {
	t.Helper()
	if err := tr.AddRequest(r); err != nil {
		t.Fatalf("AddRequest(%s): %v", r.ID, err)
	}
}

func wantLoad(t *testing.T, tr *Tracker, w kv.Worker, want WorkerLoad) {
	t.Helper()
	if got := tr.Load(w); math.Abs(got.ActiveDecodeBlocks-want.ActiveDecodeBlocks) > 1e-9 ||
		got.ActivePrefillTokens != want.ActivePrefillTokens || got.ActiveRequests != want.ActiveRequests {
		t.Fatalf("Load(%v) = %+v, want %+v", w, got, want)
	}
}

func TestSharedBlocksCountOnce(t *testing.T) {
	tr := New(DefaultConfig())
	p := seqOf(0, 10)
	mustAdd(t, tr, Request{ID: "a", Worker: w1, Blocks: p[:6], ISL: 6 * 16})
	mustAdd(t, tr, Request{ID: "b", Worker: w1, Blocks: p, ISL: 10*16 + 5, OverlapBlocks: 6})
	mustAdd(t, tr, Request{ID: "c", Worker: w2, Blocks: p[:4], ISL: 64, OverlapBlocks: 9})
	wantLoad(t, tr, w1, WorkerLoad{ActiveDecodeBlocks: 10, ActivePrefillTokens: 96 + 69, ActiveRequests: 2})
	wantLoad(t, tr, w2, WorkerLoad{ActiveDecodeBlocks: 4, ActiveRequests: 1})
	if !tr.Free("b") {
		t.Fatal("Free(b) = false")
	}
	wantLoad(t, tr, w1, WorkerLoad{ActiveDecodeBlocks: 6, ActivePrefillTokens: 96, ActiveRequests: 1})
	if st := tr.Stats(); st.Blocks != 6 || st.Active != 2 || st.Workers != 2 {
		t.Fatalf("Stats = %+v", st)
	}
}

func TestRequestLifecycle(t *testing.T) {
	tests := []struct {
		name string
		run  func(t *testing.T, tr *Tracker)
	}{
		{"free twice", func(t *testing.T, tr *Tracker) {
			mustAdd(t, tr, Request{ID: "a", Worker: w1, Blocks: seqOf(0, 3), ISL: 48})
			if !tr.Free("a") || tr.Free("a") {
				t.Fatal("Free should succeed once, then report false")
			}
			wantLoad(t, tr, w1, WorkerLoad{})
			if st := tr.Stats(); st.Freed != 1 || st.Blocks != 0 || st.Active != 0 {
				t.Fatalf("Stats = %+v", st)
			}
		}},
		{"free unknown", func(t *testing.T, tr *Tracker) {
			if tr.Free("nope") || tr.MarkPrefillCompleted("nope") || tr.AddOutputTokens("nope", 3) {
				t.Fatal("calls on an unknown id must report false")
			}
			if st := tr.Stats(); st != (Stats{}) {
				t.Fatalf("Stats = %+v", st)
			}
		}},
		{"duplicate id", func(t *testing.T, tr *Tracker) {
			mustAdd(t, tr, Request{ID: "a", Worker: w1, Blocks: seqOf(0, 3), ISL: 48})
			err := tr.AddRequest(Request{ID: "a", Worker: w2, Blocks: seqOf(7, 5), ISL: 80})
			if !errors.Is(err, ErrDuplicateRequest) {
				t.Fatalf("err = %v, want ErrDuplicateRequest", err)
			}
			wantLoad(t, tr, w1, WorkerLoad{ActiveDecodeBlocks: 3, ActivePrefillTokens: 48, ActiveRequests: 1})
			wantLoad(t, tr, w2, WorkerLoad{})
			if st := tr.Stats(); st.Added != 1 || st.Blocks != 3 {
				t.Fatalf("Stats = %+v", st)
			}
		}},
		{"invalid", func(t *testing.T, tr *Tracker) {
			for _, r := range []Request{{Worker: w1}, {ID: "x", ISL: -1}, {ID: "x", OverlapBlocks: -1}, {ID: "x", OSL: -1}} {
				if tr.AddRequest(r) == nil {
					t.Fatalf("AddRequest(%+v) accepted", r)
				}
			}
			if st := tr.Stats(); st != (Stats{}) {
				t.Fatalf("Stats = %+v", st)
			}
		}},
		{"prefill completed once", func(t *testing.T, tr *Tracker) {
			mustAdd(t, tr, Request{ID: "a", Worker: w1, Blocks: seqOf(0, 3), ISL: 50, OverlapBlocks: 1})
			mustAdd(t, tr, Request{ID: "b", Worker: w1, Blocks: seqOf(0, 3), ISL: 50, OverlapBlocks: 5})
			wantLoad(t, tr, w1, WorkerLoad{ActiveDecodeBlocks: 3, ActivePrefillTokens: 34, ActiveRequests: 2})
			if !tr.MarkPrefillCompleted("a") || tr.MarkPrefillCompleted("a") {
				t.Fatal("MarkPrefillCompleted should change state once")
			}
			wantLoad(t, tr, w1, WorkerLoad{ActiveDecodeBlocks: 3, ActiveRequests: 2})
			tr.Free("a")
			wantLoad(t, tr, w1, WorkerLoad{ActiveDecodeBlocks: 3, ActiveRequests: 1})
		}},
		{"remove worker", func(t *testing.T, tr *Tracker) {
			mustAdd(t, tr, Request{ID: "a", Worker: w1, Blocks: seqOf(0, 3), ISL: 48})
			mustAdd(t, tr, Request{ID: "b", Worker: w1, Blocks: seqOf(0, 4), ISL: 64})
			mustAdd(t, tr, Request{ID: "c", Worker: w3, Blocks: seqOf(0, 4), ISL: 64})
			if n := tr.RemoveWorker(w1); n != 2 {
				t.Fatalf("RemoveWorker = %d, want 2", n)
			}
			if tr.Free("a") || tr.RemoveWorker(w1) != 0 {
				t.Fatal("removed worker's requests must be gone")
			}
			wantLoad(t, tr, w1, WorkerLoad{})
			wantLoad(t, tr, w3, WorkerLoad{ActiveDecodeBlocks: 4, ActivePrefillTokens: 64, ActiveRequests: 1})
			if st := tr.Stats(); st.Dropped != 2 || st.Workers != 1 || st.Blocks != 4 {
				t.Fatalf("Stats = %+v", st)
			}
			mustAdd(t, tr, Request{ID: "a", Worker: w2, Blocks: seqOf(0, 2), ISL: 32})
			wantLoad(t, tr, w2, WorkerLoad{ActiveDecodeBlocks: 2, ActivePrefillTokens: 32, ActiveRequests: 1})
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) { tc.run(t, New(DefaultConfig())) })
	}
}

// A caller's reading of the clock stands for the tracker's own: a request
// booked with an old Now ages from then, and a query's Now decides expiry.
func TestCallersClockReading(t *testing.T) {
	clk := newClock()
	cfg := DefaultConfig()
	cfg.Now = clk.Now
	tr := New(cfg)
	booked := clk.Now()
	clk.Advance(250 * time.Second)
	mustAdd(t, tr, Request{Now: booked, ID: "a", Worker: w1, Blocks: seqOf(0, 2), ISL: 32})
	// At 330 s by the clock "a" is past the 300 s TTL, but a query that
	// read the clock at 290 s scans and keeps it.
	clk.Advance(80 * time.Second)
	q := Query{Now: booked.Add(290 * time.Second), Blocks: seqOf(0, 2), ISL: 32}
	if got := tr.PotentialLoads(q, []kv.Worker{w1}, nil, nil); got[0].ActiveRequests != 1 {
		t.Fatalf("at a reading of 290 s: %+v, want the request active", got[0])
	}
	q.Now = time.Time{}
	if got := tr.PotentialLoads(q, []kv.Worker{w1}, nil, nil); got[0].ActiveRequests != 0 {
		t.Fatalf("on the clock, 330 s: %+v, want the request expired", got[0])
	}
}

func TestExpiry(t *testing.T) {
	clk := newClock()
	cfg := DefaultConfig()
	cfg.Now = clk.Now
	tr := New(cfg)
	mustAdd(t, tr, Request{ID: "old", Worker: w1, Blocks: seqOf(0, 2), ISL: 32})
	clk.Advance(200 * time.Second)
	mustAdd(t, tr, Request{ID: "new", Worker: w1, Blocks: seqOf(0, 3), ISL: 48})

	// At 301 s a scan is due (last one at 200 s) and "old" is past its TTL.
	clk.Advance(101 * time.Second)
	wantLoad(t, tr, w1, WorkerLoad{ActiveDecodeBlocks: 3, ActivePrefillTokens: 48, ActiveRequests: 1})
	if tr.Free("old") {
		t.Fatal("expired request freed again")
	}
	// A scan at 490 s keeps "new" (290 s old). At 519 s it is past its TTL
	// but no scan is due until 520 s.
	clk.Advance(189 * time.Second)
	mustAdd(t, tr, Request{ID: "x", Worker: w2, ISL: 1})
	clk.Advance(29 * time.Second)
	wantLoad(t, tr, w1, WorkerLoad{ActiveDecodeBlocks: 3, ActivePrefillTokens: 48, ActiveRequests: 1})
	clk.Advance(time.Second)
	wantLoad(t, tr, w1, WorkerLoad{})
	if st := tr.Stats(); st.Expired != 2 || st.Freed != 0 || st.Active != 1 || st.Blocks != 0 {
		t.Fatalf("Stats = %+v", st)
	}

	cfg.RequestTTL = -1
	tr = New(cfg)
	mustAdd(t, tr, Request{ID: "a", Worker: w1, ISL: 1})
	clk.Advance(time.Hour)
	if st := tr.Stats(); st.Active != 1 || st.Expired != 0 {
		t.Fatalf("expiry disabled: Stats = %+v", st)
	}
}

func TestNoReuseSharesNothing(t *testing.T) {
	p := seqOf(0, 8)
	for _, tc := range []struct {
		name      string
		cfgReuse  bool
		a, b      *bool
		wantBlock float64
		wantPot   float64 // scoring the same prompt, with reuse
	}{
		{"config off", false, nil, nil, 16, 24},
		{"request off", true, ptr(false), ptr(false), 16, 24},
		{"one request off", true, nil, ptr(false), 16, 16},
		{"request on", false, ptr(true), ptr(true), 8, 8},
		{"config on", true, nil, nil, 8, 8},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.AssumeKVReuse = tc.cfgReuse
			tr := New(cfg)
			mustAdd(t, tr, Request{ID: "a", Worker: w1, Blocks: p, ISL: 128, AssumeReuse: tc.a})
			mustAdd(t, tr, Request{ID: "b", Worker: w1, Blocks: p, ISL: 128, AssumeReuse: tc.b})
			wantLoad(t, tr, w1, WorkerLoad{ActiveDecodeBlocks: tc.wantBlock, ActivePrefillTokens: 256, ActiveRequests: 2})
			got := tr.PotentialLoads(Query{Blocks: p, ISL: 128, AssumeReuse: ptr(true)}, []kv.Worker{w1}, nil, nil)
			if want := tc.wantPot; got[0].PotentialDecodeBlocks != want {
				t.Fatalf("potential decode = %v, want %v", got[0].PotentialDecodeBlocks, want)
			}
			got = tr.PotentialLoads(Query{Blocks: p, ISL: 128, AssumeReuse: ptr(false)}, []kv.Worker{w1}, nil, got)
			if want := tc.wantBlock + 8; got[0].PotentialDecodeBlocks != want {
				t.Fatalf("potential decode without reuse = %v, want %v", got[0].PotentialDecodeBlocks, want)
			}
			tr.Free("a")
			tr.Free("b")
			if st := tr.Stats(); st.Blocks != 0 {
				t.Fatalf("Stats = %+v", st)
			}
			wantLoad(t, tr, w1, WorkerLoad{})
		})
	}
}

func TestOutputBlocks(t *testing.T) {
	// Block size 4, prompt of 6 tokens: one full prompt block, and the
	// partial one becomes the first output block at 2 generated tokens.
	type step struct {
		n    int
		want float64 // decode blocks after adding n tokens
	}
	for _, tc := range []struct {
		name  string
		osl   int
		steps []step
	}{
		{"no hint", 0, []step{{1, 1}, {1, 2}, {4, 3}, {9, 5}}},
		{"osl 8", 8, []step{
			{1, 1},          // gen 1, no output block yet
			{1, 1 + 1*0.75}, // gen 2: 1 block × (1 − 2/8)
			{4, 1 + 2*0.25}, // gen 6: 2 blocks × (1 − 6/8)
			{2, 1},          // gen 8: weight 0
			{10, 1},         // past the hint: still 0, never negative
		}},
		{"osl 20", 20, []step{{6, 1 + 2*0.7}, {5, 1 + 3*0.45}, {1, 1 + 3*0.4}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.BlockSize = 4
			cfg.TrackOutputBlocks = true
			tr := New(cfg)
			mustAdd(t, tr, Request{ID: "a", Worker: w1, Blocks: seqOf(0, 1), ISL: 6, OSL: tc.osl})
			for i, s := range tc.steps {
				if !tr.AddOutputTokens("a", s.n) {
					t.Fatal("AddOutputTokens = false")
				}
				if got := tr.Load(w1).ActiveDecodeBlocks; math.Abs(got-s.want) > 1e-9 {
					t.Fatalf("step %d: decode blocks = %v, want %v", i, got, s.want)
				}
			}
			tr.Free("a")
			if got := tr.Load(w1).ActiveDecodeBlocks; got != 0 {
				t.Fatalf("after free: decode blocks = %v", got)
			}
		})
	}
}

func TestSwitchesOff(t *testing.T) {
	p := seqOf(0, 8)
	ws := []kv.Worker{w1, w2}
	for _, tc := range []struct {
		name       string
		mod        func(*Config)
		trackPref  *bool
		trackBlk   *bool
		osl        int
		wantLoad   WorkerLoad
		wantPotDec float64
		wantPotPre int
	}{
		{"all on", func(*Config) {}, nil, nil, 0, WorkerLoad{ActiveDecodeBlocks: 8 + 1, ActivePrefillTokens: 128 - 32, ActiveRequests: 1}, 9 + 4, 96 + 128 - 16},
		{"blocks off", func(c *Config) { c.TrackActiveBlocks = false }, nil, nil, 0, WorkerLoad{ActivePrefillTokens: 96, ActiveRequests: 1}, 0, 96 + 112},
		{"blocks off per request (prefill pool)", func(*Config) {}, nil, ptr(false), 0, WorkerLoad{ActivePrefillTokens: 96, ActiveRequests: 1}, 0, 96 + 112},
		{"blocks off per request, with an OSL", func(*Config) {}, nil, ptr(false), 64, WorkerLoad{ActivePrefillTokens: 96, ActiveRequests: 1}, 0, 96 + 112},
		{"blocks on per request, off in config", func(c *Config) { c.TrackActiveBlocks = false }, nil, ptr(true), 0, WorkerLoad{ActivePrefillTokens: 96, ActiveRequests: 1}, 0, 96 + 112},
		{"prefill off", func(c *Config) { c.TrackPrefillTokens = false }, nil, nil, 0, WorkerLoad{ActiveDecodeBlocks: 9, ActiveRequests: 1}, 13, 0},
		{"prefill off per request", func(*Config) {}, ptr(false), nil, 0, WorkerLoad{ActiveDecodeBlocks: 9, ActiveRequests: 1}, 13, 0},
		{"prefill on per request, off in config", func(c *Config) { c.TrackPrefillTokens = false }, ptr(true), nil, 0, WorkerLoad{ActiveDecodeBlocks: 9, ActiveRequests: 1}, 13, 0},
		{"output off", func(c *Config) { c.TrackOutputBlocks = false }, nil, nil, 0, WorkerLoad{ActiveDecodeBlocks: 8, ActivePrefillTokens: 96, ActiveRequests: 1}, 12, 96 + 112},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.TrackOutputBlocks = true
			tc.mod(&cfg)
			tr := New(cfg)
			mustAdd(t, tr, Request{ID: "a", Worker: w1, Blocks: p, ISL: 128, OverlapBlocks: 2, OSL: tc.osl, TrackPrefill: tc.trackPref, TrackBlocks: tc.trackBlk})
			tr.AddOutputTokens("a", 16)
			wantLoad(t, tr, w1, tc.wantLoad)
			got := tr.PotentialLoads(Query{Blocks: seqOf(0, 12), ISL: 128, TrackPrefill: tc.trackPref, TrackBlocks: tc.trackBlk}, ws, []int{1, 0}, nil)
			if got[0].PotentialDecodeBlocks != tc.wantPotDec || got[0].PotentialPrefillTokens != tc.wantPotPre {
				t.Fatalf("potential = %+v, want decode %v prefill %v", got[0], tc.wantPotDec, tc.wantPotPre)
			}
			if got[1].WorkerLoad != (WorkerLoad{}) || got[1].Worker != w2 {
				t.Fatalf("idle worker: %+v", got[1])
			}
			tr.Free("a")
			wantLoad(t, tr, w1, WorkerLoad{})
		})
	}
}

func TestPotentialLoadsLeadingRun(t *testing.T) {
	tr := New(DefaultConfig())
	a := chain(1, 2, 3, 4, 5, 6)
	b := chain(1, 2, 9)
	mustAdd(t, tr, Request{ID: "a", Worker: w1, Blocks: a[:4], ISL: 64})
	mustAdd(t, tr, Request{ID: "b", Worker: w2, Blocks: a[:2], ISL: 32})
	mustAdd(t, tr, Request{ID: "c", Worker: w3, Blocks: b, ISL: 48})
	tr.MarkPrefillCompleted("a")
	tr.MarkPrefillCompleted("b")
	tr.MarkPrefillCompleted("c")
	ws := []kv.Worker{w1, w2, w3, {ID: 9}, w1}
	got := tr.PotentialLoads(Query{Blocks: a, ISL: 100}, ws, []int{4, 2, 2, 0, 0}, make([]Potential, 1, 8))
	want := []struct {
		dec float64
		pre int
	}{{4 + 2, 36}, {2 + 4, 68}, {3 + 4, 68}, {6, 100}, {6, 100}}
	if len(got) != len(ws) {
		t.Fatalf("len = %d", len(got))
	}
	for i, w := range want {
		if got[i].Worker != ws[i] || got[i].PotentialDecodeBlocks != w.dec || got[i].PotentialPrefillTokens != w.pre {
			t.Errorf("worker %v: got %+v, want decode %v prefill %v", ws[i], got[i], w.dec, w.pre)
		}
	}
	if got := tr.PotentialLoads(Query{Blocks: a}, nil, nil, got); len(got) != 0 {
		t.Fatalf("no workers: %v", got)
	}
}

// Blocks that are not a chain from block 0 break the subset property the
// walk relies on; it must still count leading blocks only, not be fooled by
// two consecutive blocks with the same number of holders.
func TestPotentialLoadsBrokenChain(t *testing.T) {
	cfg := DefaultConfig()
	cfg.TrackPrefillTokens = false
	tr := New(cfg)
	mustAdd(t, tr, Request{ID: "a", Worker: w1, Blocks: []uint64{10, 11}})
	mustAdd(t, tr, Request{ID: "b", Worker: w2, Blocks: []uint64{20, 12}})
	got := tr.PotentialLoads(Query{Blocks: []uint64{10, 11, 12, 13}}, []kv.Worker{w1, w2}, nil, nil)
	if got[0].PotentialDecodeBlocks != 2+2 || got[1].PotentialDecodeBlocks != 2+4 {
		t.Fatalf("potential decode = %v, %v; want 4, 6", got[0].PotentialDecodeBlocks, got[1].PotentialDecodeBlocks)
	}
}

// model is the brute-force reference: it keeps requests as plain records
// and recomputes every figure from scratch.
type model struct {
	cfg      Config
	now      func() time.Time
	reqs     map[string]*modelReq
	lastScan time.Time
	expired  int
}

type modelReq struct {
	w                      kv.Worker
	added                  time.Time
	blocks                 []uint64
	private                int
	isl, osl, prefill, gen int
}

func (m *model) expire() {
	now := m.now()
	if m.cfg.RequestTTL < 0 || now.Sub(m.lastScan) < m.cfg.ExpiryInterval {
		return
	}
	m.lastScan = now
	for id, r := range m.reqs {
		if now.Sub(r.added) > m.cfg.RequestTTL {
			delete(m.reqs, id)
			m.expired++
		}
	}
}

func (m *model) add(r Request) bool {
	m.expire()
	if _, ok := m.reqs[r.ID]; ok {
		return false
	}
	q := &modelReq{w: r.Worker, added: m.now(), isl: r.ISL, osl: r.OSL}
	if or(r.AssumeReuse, m.cfg.AssumeKVReuse) {
		q.blocks = append([]uint64(nil), r.Blocks...)
	} else {
		q.private = len(r.Blocks)
	}
	if m.cfg.TrackPrefillTokens && or(r.TrackPrefill, true) {
		q.prefill = max(0, r.ISL-r.OverlapBlocks*m.cfg.BlockSize)
	}
	m.reqs[r.ID] = q
	return true
}

func (m *model) mark(id string) bool {
	m.expire()
	q := m.reqs[id]
	if q == nil || q.prefill < 0 {
		return false
	}
	q.prefill = -1 // completed
	return true
}

func (m *model) output(id string, n int) bool {
	m.expire()
	q := m.reqs[id]
	if q != nil && n > 0 {
		q.gen += n
	}
	return q != nil
}

func (m *model) free(id string) bool {
	m.expire()
	_, ok := m.reqs[id]
	delete(m.reqs, id)
	return ok
}

func (m *model) removeWorker(w kv.Worker) int {
	m.expire()
	n := 0
	for id, r := range m.reqs {
		if r.w == w {
			delete(m.reqs, id)
			n++
		}
	}
	return n
}

func (m *model) active(w kv.Worker) (map[uint64]bool, WorkerLoad) {
	m.expire()
	set := map[uint64]bool{}
	var l WorkerLoad
	bs := m.cfg.BlockSize
	for _, r := range m.reqs {
		if r.w != w {
			continue
		}
		l.ActiveRequests++
		l.ActivePrefillTokens += max(r.prefill, 0)
		for _, h := range r.blocks {
			set[h] = true
		}
		l.ActiveDecodeBlocks += float64(r.private)
		if m.cfg.TrackOutputBlocks {
			out := float64((r.isl+r.gen)/bs - r.isl/bs)
			if r.osl > 0 {
				out *= max(0, 1-float64(r.gen)/float64(r.osl))
			}
			l.ActiveDecodeBlocks += out
		}
	}
	l.ActiveDecodeBlocks += float64(len(set))
	if !m.cfg.TrackActiveBlocks {
		l.ActiveDecodeBlocks = 0
	}
	return set, l
}

func (m *model) potential(q Query, ws []kv.Worker, overlaps []int) []Potential {
	var out []Potential
	for i, w := range ws {
		set, l := m.active(w)
		p := Potential{Worker: w, WorkerLoad: l}
		if m.cfg.TrackActiveBlocks {
			n := len(q.Blocks)
			if or(q.AssumeReuse, m.cfg.AssumeKVReuse) {
				for _, h := range q.Blocks {
					if set[h] {
						n--
					}
				}
			}
			p.PotentialDecodeBlocks = l.ActiveDecodeBlocks + float64(n)
		}
		if m.cfg.TrackPrefillTokens && or(q.TrackPrefill, true) {
			p.PotentialPrefillTokens = l.ActivePrefillTokens + max(0, q.ISL-overlaps[i]*m.cfg.BlockSize)
		}
		out = append(out, p)
	}
	return out
}

func samePotential(a, b Potential) bool {
	return a.Worker == b.Worker && a.ActivePrefillTokens == b.ActivePrefillTokens &&
		a.ActiveRequests == b.ActiveRequests && a.PotentialPrefillTokens == b.PotentialPrefillTokens &&
		math.Abs(a.ActiveDecodeBlocks-b.ActiveDecodeBlocks) <= 1e-9 &&
		math.Abs(a.PotentialDecodeBlocks-b.PotentialDecodeBlocks) <= 1e-9
}

// randomPrompt draws prompts from a small tree so that prefixes are shared
// often, at every depth.
func randomPrompt(rng *rand.Rand) []uint64 {
	n := rng.IntN(14)
	local := make([]uint64, n)
	for i := range local {
		if i < 6 {
			local[i] = uint64(rng.IntN(2))
		} else {
			local[i] = rng.Uint64()
		}
	}
	return chain(local...)
}

func randBool(rng *rand.Rand) *bool {
	switch rng.IntN(4) {
	case 0:
		return ptr(false)
	case 1:
		return ptr(true)
	}
	return nil
}

func TestAgainstModel(t *testing.T) {
	configs := map[string]func(*Config){
		"defaults":      func(*Config) {},
		"output blocks": func(c *Config) { c.TrackOutputBlocks = true },
		"no reuse":      func(c *Config) { c.AssumeKVReuse = false; c.TrackOutputBlocks = true },
		"blocks off":    func(c *Config) { c.TrackActiveBlocks = false; c.TrackOutputBlocks = true },
		"prefill off":   func(c *Config) { c.TrackPrefillTokens = false },
		"short ttl": func(c *Config) {
			c.RequestTTL = 90 * time.Second
			c.ExpiryInterval = 7 * time.Second
			c.TrackOutputBlocks = true
		},
		"block size 1": func(c *Config) { c.BlockSize = 1; c.TrackOutputBlocks = true },
		"nothing on":   func(c *Config) { *c = Config{BlockSize: 3} },
	}
	workers := []kv.Worker{w1, w2, w3, {ID: 4}, {ID: 5, DPRank: 2}}
	for name, mod := range configs {
		t.Run(name, func(t *testing.T) {
			clk := newClock()
			cfg := DefaultConfig()
			cfg.BlockSize = 4
			mod(&cfg)
			cfg.Now = clk.Now
			tr := New(cfg)
			ref := &model{cfg: cfg, now: clk.Now, reqs: map[string]*modelReq{}, lastScan: clk.Now()}
			if ref.cfg.RequestTTL == 0 {
				ref.cfg.RequestTTL = 300 * time.Second
			}
			if ref.cfg.ExpiryInterval == 0 {
				ref.cfg.ExpiryInterval = 30 * time.Second
			}
			rng := rand.New(rand.NewPCG(1, uint64(len(name))))
			var ids []string
			var dst []Potential
			var st Stats
			for step := range 20000 {
				id := fmt.Sprint("r", rng.IntN(60))
				switch op := rng.IntN(100); {
				case op < 30:
					blocks := randomPrompt(rng)
					r := Request{
						ID: id, Worker: workers[rng.IntN(len(workers))], Blocks: blocks,
						ISL: len(blocks)*cfg.BlockSize + rng.IntN(cfg.BlockSize), OverlapBlocks: rng.IntN(len(blocks) + 2),
						TrackPrefill: randBool(rng), AssumeReuse: randBool(rng),
					}
					if rng.IntN(2) == 0 {
						r.OSL = 1 + rng.IntN(60)
					}
					ok := ref.add(r)
					if err := tr.AddRequest(r); (err == nil) != ok {
						t.Fatalf("step %d: AddRequest(%s) = %v, model ok %v", step, id, err, ok)
					}
					if ok {
						st.Added++
						ids = append(ids, id)
					}
				case op < 45:
					if got, want := tr.MarkPrefillCompleted(id), ref.mark(id); got != want {
						t.Fatalf("step %d: MarkPrefillCompleted(%s) = %v, want %v", step, id, got, want)
					}
				case op < 70:
					n := rng.IntN(12)
					if got, want := tr.AddOutputTokens(id, n), ref.output(id, n); got != want {
						t.Fatalf("step %d: AddOutputTokens(%s) = %v, want %v", step, id, got, want)
					}
				case op < 90:
					got, want := tr.Free(id), ref.free(id)
					if got != want {
						t.Fatalf("step %d: Free(%s) = %v, want %v", step, id, got, want)
					}
					if got {
						st.Freed++
					}
				case op < 91:
					w := workers[rng.IntN(len(workers))]
					got, want := tr.RemoveWorker(w), ref.removeWorker(w)
					if got != want {
						t.Fatalf("step %d: RemoveWorker = %d, want %d", step, got, want)
					}
					st.Dropped += uint64(got)
				default:
					clk.Advance(time.Duration(rng.IntN(20)) * time.Second)
				}

				if err := checkTrie(tr); err != nil {
					t.Fatalf("step %d: %v", step, err)
				}
				w := workers[rng.IntN(len(workers))]
				_, want := ref.active(w)
				if got := tr.Load(w); !samePotential(Potential{WorkerLoad: got}, Potential{WorkerLoad: want}) {
					t.Fatalf("step %d: Load(%v) = %+v, want %+v", step, w, got, want)
				}
				q := Query{Blocks: randomPrompt(rng), TrackPrefill: randBool(rng), AssumeReuse: randBool(rng)}
				q.ISL = len(q.Blocks) * cfg.BlockSize
				ws := workers[:1+rng.IntN(len(workers))]
				overlaps := make([]int, len(ws))
				for i := range overlaps {
					overlaps[i] = rng.IntN(len(q.Blocks) + 1)
				}
				wantP := ref.potential(q, ws, overlaps)
				dst = tr.PotentialLoads(q, ws, overlaps, dst)
				for i := range wantP {
					if !samePotential(dst[i], wantP[i]) {
						t.Fatalf("step %d: PotentialLoads[%d] = %+v, want %+v", step, i, dst[i], wantP[i])
					}
				}
			}
			got := tr.Stats()
			st.Expired = uint64(ref.expired)
			st.Active = len(ref.reqs)
			if got.Added != st.Added || got.Freed != st.Freed || got.Expired != st.Expired ||
				got.Dropped != st.Dropped || got.Active != st.Active {
				t.Fatalf("Stats = %+v, want %+v", got, st)
			}
			if name == "short ttl" && st.Expired == 0 {
				t.Fatal("short ttl: nothing expired; the test does not exercise expiry")
			}
			for _, id := range ids {
				tr.Free(id)
			}
			for _, w := range workers {
				wantLoad(t, tr, w, WorkerLoad{})
			}
			if got := tr.Stats(); got.Blocks != 0 || got.Active != 0 {
				t.Fatalf("after freeing all: Stats = %+v", got)
			}
		})
	}
}

func TestConcurrent(t *testing.T) {
	cfg := DefaultConfig()
	cfg.TrackOutputBlocks = true
	cfg.ExpiryInterval = time.Nanosecond // scan on every call
	tr := New(cfg)
	workers := []kv.Worker{w1, w2, w3}
	prefix := seqOf(0, 32)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var dst []Potential
			for i := range 300 {
				id := fmt.Sprintf("g%d-%d", g, i)
				w := workers[(g+i)%len(workers)]
				if err := tr.AddRequest(Request{ID: id, Worker: w, Blocks: prefix[:1+i%32], ISL: 512, OSL: 40}); err != nil {
					t.Error(err)
					return
				}
				dst = tr.PotentialLoads(Query{Blocks: prefix, ISL: 512}, workers, []int{1, 2, 3}, dst)
				tr.MarkPrefillCompleted(id)
				tr.AddOutputTokens(id, 20)
				_ = tr.Load(w)
				if i%50 == 49 {
					tr.RemoveWorker(kv.Worker{ID: uint64(100 + g)})
				}
				tr.Free(id)
			}
		}()
	}
	wg.Wait()
	for _, w := range workers {
		wantLoad(t, tr, w, WorkerLoad{})
	}
	if st := tr.Stats(); st.Added != 2400 || st.Freed != 2400 || st.Blocks != 0 {
		t.Fatalf("Stats = %+v", st)
	}
}

func BenchmarkAddFree512(b *testing.B) {
	tr := New(DefaultConfig())
	r := Request{ID: "req", Worker: w1, Blocks: seqOf(0, 512), ISL: 8192, OverlapBlocks: 100}
	b.ReportAllocs()
	for b.Loop() {
		if err := tr.AddRequest(r); err != nil {
			b.Fatal(err)
		}
		tr.Free(r.ID)
	}
}

// BenchmarkAddFreeLong books and frees prompts of 2,000 16-token blocks
// (32 K tokens, longer than a recycled node's buffer), 16 of them active.
func BenchmarkAddFreeLong(b *testing.B) {
	tr := New(DefaultConfig())
	var reqs [16]Request
	for i := range reqs {
		reqs[i] = Request{ID: fmt.Sprint(i), Worker: w1, Blocks: seqOf(uint64(i+1)<<40, 2000), ISL: 32000}
		mustAdd(b, tr, reqs[i])
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		r := &reqs[i%len(reqs)]
		tr.Free(r.ID)
		r.Blocks[0]++ // a new chain, not the one just freed
		if err := tr.AddRequest(*r); err != nil {
			b.Fatal(err)
		}
		i++
	}
}

// BenchmarkPotentialLoads scores a 512-block prompt over 64 workers, half of
// which hold its first 100 blocks; each worker also carries 8 unrelated
// 512-block requests so the block map is realistically large.
func BenchmarkPotentialLoads(b *testing.B) {
	tr := New(DefaultConfig())
	prompt := seqOf(0, 512)
	workers := make([]kv.Worker, 64)
	overlaps := make([]int, 64)
	for i := range workers {
		workers[i] = kv.Worker{ID: uint64(i)}
		if i%2 == 0 {
			tr.AddRequest(Request{ID: fmt.Sprint("p", i), Worker: workers[i], Blocks: prompt[:100], ISL: 1600})
			overlaps[i] = 100
		}
		for j := range 8 {
			tr.AddRequest(Request{ID: fmt.Sprint("bg", i, "-", j), Worker: workers[i], Blocks: seqOf(uint64(1e6*(i*8+j+1)), 512), ISL: 8192})
		}
	}
	q := Query{Blocks: prompt, ISL: 8192}
	dst := tr.PotentialLoads(q, workers, overlaps, nil)
	if dst[0].PotentialDecodeBlocks != dst[0].ActiveDecodeBlocks+412 || dst[1].PotentialDecodeBlocks != dst[1].ActiveDecodeBlocks+512 {
		b.Fatalf("unexpected potentials %+v %+v", dst[0], dst[1])
	}
	b.ReportAllocs()
	for b.Loop() {
		dst = tr.PotentialLoads(q, workers, overlaps, dst)
	}
}

// steadyState books 128 requests round-robin on 64 workers, each a 64-block
// system prompt shared by all followed by 448 blocks of its own: the
// router's steady state. It returns the tracker, the workers and a ring of
// 256 prompts (with IDs) where prompt i is booked for i < 128.
func steadyState(b *testing.B) (*Tracker, []kv.Worker, [][]uint64, []string) {
	tr := New(DefaultConfig())
	workers := make([]kv.Worker, 64)
	for i := range workers {
		workers[i] = kv.Worker{ID: uint64(i)}
	}
	prompts := make([][]uint64, 256)
	ids := make([]string, len(prompts))
	for i := range prompts {
		local := make([]uint64, 512)
		for j := range local {
			local[j] = uint64(j)
			if j >= 64 {
				local[j] = uint64(1e6*(i+1) + j)
			}
		}
		prompts[i] = chain(local...)
		ids[i] = fmt.Sprint("req", i)
	}
	for i := range 128 {
		if err := tr.AddRequest(Request{ID: ids[i], Worker: workers[i%64], Blocks: prompts[i], ISL: 8192, OverlapBlocks: 64}); err != nil {
			b.Fatal(err)
		}
	}
	return tr, workers, prompts, ids
}

// BenchmarkSteadyState adds one request to the steady state and frees the
// oldest, keeping 128 in flight.
func BenchmarkSteadyState(b *testing.B) {
	tr, workers, prompts, ids := steadyState(b)
	b.ReportAllocs()
	i := 128
	for b.Loop() {
		k := i % len(prompts)
		if err := tr.AddRequest(Request{ID: ids[k], Worker: workers[i%64], Blocks: prompts[k], ISL: 8192, OverlapBlocks: 64}); err != nil {
			b.Fatal(err)
		}
		tr.Free(ids[(i-128)%len(prompts)])
		i++
	}
	if st := tr.Stats(); st.Active != 128 {
		b.Fatalf("Stats = %+v", st)
	}
}

// BenchmarkSteadyStatePotentialLoads scores a new prompt that shares the
// system prompt against all 64 workers of the steady state.
func BenchmarkSteadyStatePotentialLoads(b *testing.B) {
	tr, workers, prompts, _ := steadyState(b)
	q := Query{Blocks: prompts[200], ISL: 8192}
	overlaps := make([]int, len(workers))
	dst := tr.PotentialLoads(q, workers, overlaps, nil)
	if d := dst[5].PotentialDecodeBlocks - dst[5].ActiveDecodeBlocks; d != 448 {
		b.Fatalf("new blocks = %v, want 448", d)
	}
	b.ReportAllocs()
	for b.Loop() {
		dst = tr.PotentialLoads(q, workers, overlaps, dst)
	}
}

// checkTrie verifies the trie's invariants: keys, parents and totals are
// consistent, no node is mergeable into its only child, the block counts
// match the runs, and every active request's end node is in the trie with
// totals equal to the requests ending at or below each node.
func checkTrie(tr *Tracker) error {
	ends := map[*node]int{}
	for _, q := range tr.requests {
		if q.end != nil && q.end != tr.root {
			ends[q.end]++
		}
	}
	shared := make([]int, len(tr.slots))
	blocks := 0
	seen := 0
	var visit func(n *node) (int, error)
	visit = func(n *node) (int, error) {
		covered := ends[n]
		if n != tr.root {
			seen++
			blocks += len(n.run)
			if len(n.run) == 0 {
				return 0, fmt.Errorf("empty run")
			}
			refs := 0
			slots := map[int32]bool{}
			for _, hd := range n.holders {
				if hd.refs <= 0 || slots[hd.slot] {
					return 0, fmt.Errorf("bad holder %+v in %v", hd, n.holders)
				}
				slots[hd.slot] = true
				refs += int(hd.refs)
				shared[hd.slot] += len(n.run)
			}
			if int(n.total) != refs || refs == 0 {
				return 0, fmt.Errorf("total %d, refs %d", n.total, refs)
			}
		}
		var kids []*node
		if n.kids.m != nil {
			if len(n.kids.keys) != 0 {
				return 0, fmt.Errorf("both map and slice children")
			}
			for h, c := range n.kids.m {
				if c.run[0] != h {
					return 0, fmt.Errorf("child keyed %x starts %x", h, c.run[0])
				}
				kids = append(kids, c)
			}
		} else {
			for i, h := range n.kids.keys {
				if c := n.kids.nodes[i]; c.run[0] != h {
					return 0, fmt.Errorf("child keyed %x starts %x", h, c.run[0])
				}
			}
			kids = append(kids, n.kids.nodes...)
		}
		if n.kids.len() != len(kids) {
			return 0, fmt.Errorf("kids.len %d, want %d", n.kids.len(), len(kids))
		}
		for _, c := range kids {
			if c.parent != n {
				return 0, fmt.Errorf("wrong parent")
			}
			if n != tr.root {
				for _, hd := range c.holders {
					ok := false
					for _, p := range n.holders {
						ok = ok || p.slot == hd.slot && p.refs >= hd.refs
					}
					if !ok {
						return 0, fmt.Errorf("child holder %+v not under parent's %v", hd, n.holders)
					}
				}
				if len(kids) == 1 && c.total == n.total {
					return 0, fmt.Errorf("mergeable node left (total %d)", n.total)
				}
			}
			k, err := visit(c)
			if err != nil {
				return 0, err
			}
			covered += k
		}
		if n != tr.root && covered != int(n.total) {
			return 0, fmt.Errorf("total %d, but %d requests end at or below", n.total, covered)
		}
		return covered, nil
	}
	if _, err := visit(tr.root); err != nil {
		return err
	}
	if len(ends) > seen {
		return fmt.Errorf("request ends at a node not in the trie")
	}
	if blocks != tr.blocks {
		return fmt.Errorf("blocks %d, runs sum to %d", tr.blocks, blocks)
	}
	for si := range tr.slots {
		if shared[si] != tr.slots[si].shared {
			return fmt.Errorf("slot %d: shared %d, runs sum to %d", si, tr.slots[si].shared, shared[si])
		}
	}
	return nil
}

// checkPotentials compares the tracker's potentials for q, with no
// overlaps, with the model's; it returns the potentials for reuse.
func checkPotentials(t *testing.T, step int, tr *Tracker, ref *model, q Query, workers []kv.Worker, dst []Potential) []Potential {
	t.Helper()
	overlaps := make([]int, len(workers))
	want := ref.potential(q, workers, overlaps)
	dst = tr.PotentialLoads(q, workers, overlaps, dst)
	for i := range want {
		if !samePotential(dst[i], want[i]) {
			t.Fatalf("step %d: PotentialLoads[%d] = %+v, want %+v", step, i, dst[i], want[i])
		}
	}
	return dst
}

// TestTrieAgainstModel drives the trie through splits, merges and wide
// fan-outs (past the children slice into a map and back) with long prompts
// branching at every depth, checking loads, potentials and the number of
// distinct blocks against the brute-force model, and the trie's invariants
// after every step.
func TestTrieAgainstModel(t *testing.T) {
	cfg := DefaultConfig()
	cfg.BlockSize = 4
	cfg.RequestTTL = -1
	tr := New(cfg)
	ref := &model{cfg: cfg, now: time.Now, reqs: map[string]*modelReq{}, lastScan: time.Now()}
	workers := []kv.Worker{w1, w2, w3, {ID: 4}}
	rng := rand.New(rand.NewPCG(7, 7))
	prompt := func() []uint64 {
		n := rng.IntN(40)
		local := make([]uint64, n)
		for i := range local {
			// Few values early and at a few depths, so chains share and
			// fan out widely at several places.
			switch {
			case i < 2 || i%10 == 0:
				local[i] = uint64(rng.IntN(12))
			case i%10 < 5:
				local[i] = uint64(rng.IntN(2))
			default:
				local[i] = uint64(rng.IntN(1 + i/5))
			}
		}
		return chain(local...)
	}
	var dst []Potential
	for step := range 30000 {
		id := fmt.Sprint("r", rng.IntN(120))
		switch op := rng.IntN(100); {
		case op < 50:
			b := prompt()
			r := Request{ID: id, Worker: workers[rng.IntN(len(workers))], Blocks: b, ISL: 4 * len(b)}
			if (tr.AddRequest(r) == nil) != ref.add(r) {
				t.Fatalf("step %d: AddRequest(%s) disagrees", step, id)
			}
		case op < 98:
			if tr.Free(id) != ref.free(id) {
				t.Fatalf("step %d: Free(%s) disagrees", step, id)
			}
		default:
			w := workers[rng.IntN(len(workers))]
			if tr.RemoveWorker(w) != ref.removeWorker(w) {
				t.Fatalf("step %d: RemoveWorker disagrees", step)
			}
		}
		if err := checkTrie(tr); err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		all := map[uint64]bool{}
		for _, w := range workers {
			set, want := ref.active(w)
			for h := range set {
				all[h] = true
			}
			if got := tr.Load(w); !samePotential(Potential{WorkerLoad: got}, Potential{WorkerLoad: want}) {
				t.Fatalf("step %d: Load(%v) = %+v, want %+v", step, w, got, want)
			}
		}
		if got := tr.Stats().Blocks; got != len(all) {
			t.Fatalf("step %d: Stats.Blocks = %d, want %d", step, got, len(all))
		}
		dst = checkPotentials(t, step, tr, ref, Query{Blocks: prompt()}, workers, dst)
	}
	if len(tr.freeNodes) == 0 {
		t.Fatal("no node was ever recycled")
	}
}

// TestFreedLongPromptLeavesNoBuffer: the nodes kept for reuse after a
// request ends must not keep the buffer of a huge prompt, or one burst of
// long prompts holds its memory for the life of the router.
func TestFreedLongPromptLeavesNoBuffer(t *testing.T) {
	tr := New(DefaultConfig())
	const blocks = 1 << 20 // a 16 Mi-token prompt: 8 MiB of hashes
	prompt := seqOf(0, blocks)
	heap := func() uint64 {
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return m.HeapAlloc
	}
	mustAdd(t, tr, Request{ID: "short", Worker: w1, Blocks: seqOf(1<<40, 8), ISL: 128})
	tr.Free("short")
	before := heap()
	for i := range 4 {
		// Sharing a prefix splits the first chain's node, so both the
		// node it was booked as and the nodes split off it are recycled.
		mustAdd(t, tr, Request{ID: fmt.Sprint("long", i), Worker: w1, Blocks: prompt[:blocks-i], ISL: 16 * (blocks - i)})
	}
	for i := range 4 {
		tr.Free(fmt.Sprint("long", i))
	}
	prompt = nil
	if grown := int64(heap()) - int64(before); grown > 1<<20 {
		t.Fatalf("the tracker keeps %d KiB after the long prompts were freed, want < 1 MiB", grown>>10)
	}
	if st := tr.Stats(); st.Blocks != 0 || st.Active != 0 {
		t.Fatalf("Stats = %+v", st)
	}
	// The recycled nodes still serve ordinary prompts.
	mustAdd(t, tr, Request{ID: "after", Worker: w1, Blocks: seqOf(0, 512), ISL: 8192})
	wantLoad(t, tr, w1, WorkerLoad{ActiveDecodeBlocks: 512, ActivePrefillTokens: 8192, ActiveRequests: 1})
	runtime.KeepAlive(tr)
}

// PotentialLoads remembers which slot each worker of the list it was last
// given has; a worker removed, and its slot taken by another, must not
// lend that other worker's load to the same list asked again.
func TestPotentialLoadsFollowsSlotChanges(t *testing.T) {
	tr := New(DefaultConfig())
	workers := []kv.Worker{w1, w2}
	q := Query{Blocks: seqOf(0, 4), ISL: 64}
	mustAdd(t, tr, Request{ID: "a", Worker: w1, Blocks: seqOf(0, 4), ISL: 64})
	if p := tr.PotentialLoads(q, workers, nil, nil); p[0].ActiveRequests != 1 || p[1].ActiveRequests != 0 {
		t.Fatalf("before: %+v", p)
	}
	tr.RemoveWorker(w1)
	other := kv.Worker{ID: 9}
	mustAdd(t, tr, Request{ID: "b", Worker: other, Blocks: seqOf(100, 3), ISL: 48})
	mustAdd(t, tr, Request{ID: "c", Worker: other, Blocks: seqOf(200, 3), ISL: 48})
	if p := tr.PotentialLoads(q, workers, nil, nil); p[0].ActiveRequests != 0 || p[1].ActiveRequests != 0 {
		t.Fatalf("after w1 left and worker 9 took its slot: %+v", p)
	}
	mustAdd(t, tr, Request{ID: "d", Worker: w2, Blocks: seqOf(0, 4), ISL: 64})
	if p := tr.PotentialLoads(q, workers, nil, nil); p[1].ActiveRequests != 1 || p[1].PotentialDecodeBlocks != 4 {
		t.Fatalf("after w2 booked: %+v", p)
	}
}

// A workers list named by WorkersID is trusted to be the list last named
// so, and a worker that gains a slot since is still seen.
func TestWorkersIDNamesTheList(t *testing.T) {
	tr := New(DefaultConfig())
	mustAdd(t, tr, Request{ID: "a", Worker: w1, Blocks: seqOf(0, 2), ISL: 32})
	list := []kv.Worker{w1, w2}
	q := Query{WorkersID: 7, Blocks: seqOf(0, 2), ISL: 32}
	if got := tr.PotentialLoads(q, list, nil, nil); got[0].ActiveRequests != 1 || got[1].ActiveRequests != 0 {
		t.Fatalf("first call: %+v", got)
	}
	mustAdd(t, tr, Request{ID: "b", Worker: w2, Blocks: seqOf(5, 2), ISL: 32})
	if got := tr.PotentialLoads(q, list, nil, nil); got[0].ActiveRequests != 1 || got[1].ActiveRequests != 1 {
		t.Fatalf("after w2 gained a slot: %+v", got)
	}
	// Another list under another id is resolved afresh.
	q.WorkersID = 8
	if got := tr.PotentialLoads(q, []kv.Worker{w2}, nil, nil); got[0].Worker != w2 || got[0].ActiveRequests != 1 {
		t.Fatalf("another list: %+v", got)
	}
}

// TestLongPromptsReuseBuffers: a prompt longer than a recycled node's
// buffer books into a buffer kept from a freed one instead of a new one,
// and what is kept stays within maxLongRuns buffers of maxLongRun blocks.
func TestLongPromptsReuseBuffers(t *testing.T) {
	tr := New(DefaultConfig())
	long := func(i, n int) Request {
		return Request{ID: "long", Worker: w1, Blocks: seqOf(uint64(i)<<32, n), ISL: 16 * n}
	}
	for i := range 4 {
		mustAdd(t, tr, long(i, 3000))
		tr.Free("long")
	}
	var reqs []Request
	for i := range 60 {
		reqs = append(reqs, long(4+i, 2000+i*10))
	}
	i := 0
	if allocs := testing.AllocsPerRun(50, func() {
		mustAdd(t, tr, reqs[i])
		tr.Free("long")
		i++
	}); allocs != 0 {
		t.Fatalf("%.1f allocations to book and free a long prompt, want 0", allocs)
	}
	for n := range 3 * maxLongRuns {
		mustAdd(t, tr, Request{ID: fmt.Sprint(n), Worker: w1, Blocks: seqOf(uint64(n+1)<<40, maxRecycledRun+1+n*(maxLongRun/maxLongRuns)), ISL: 16})
	}
	for n := range 3 * maxLongRuns {
		tr.Free(fmt.Sprint(n))
	}
	kept := 0
	for _, r := range tr.longRuns {
		if cap(r) > maxLongRun {
			t.Fatalf("kept a buffer of %d blocks, over %d", cap(r), maxLongRun)
		}
		kept += cap(r)
	}
	if len(tr.longRuns) > maxLongRuns || kept > maxLongRuns*maxLongRun {
		t.Fatalf("kept %d long buffers of %d blocks in all", len(tr.longRuns), kept)
	}
	if st := tr.Stats(); st.Blocks != 0 || st.Active != 0 {
		t.Fatalf("Stats = %+v", st)
	}
}

// BenchmarkAddFreeLongMixed books and frees prompts of 1,100 to 6,000
// blocks (longer than a recycled node's buffer, of every length), 64 of
// them active, a third sharing a long prefix with the one before, so
// that runs are split and merged back: the long buffers kept must serve
// prompts of other lengths.
func BenchmarkAddFreeLongMixed(b *testing.B) {
	tr := New(DefaultConfig())
	rng := rand.New(rand.NewPCG(3, 4))
	base := seqOf(1<<50, 6000)
	prompt := func(i int) []uint64 {
		n := maxRecycledRun + 76 + rng.IntN(6000-maxRecycledRun-76)
		if i%3 == 0 {
			p := slices.Clone(base[:n])
			base[rng.IntN(len(base))]++ // later prompts diverge from this one somewhere
			return p
		}
		return seqOf(uint64(i+1)<<40, n)
	}
	var reqs [64]Request
	for i := range reqs {
		reqs[i] = Request{ID: fmt.Sprint(i), Worker: w1, Blocks: prompt(i), ISL: 16000}
		mustAdd(b, tr, reqs[i])
	}
	prompts := make([][]uint64, 1024)
	for i := range prompts {
		prompts[i] = prompt(i)
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		r := &reqs[i%len(reqs)]
		tr.Free(r.ID)
		r.Blocks = prompts[i%len(prompts)]
		if err := tr.AddRequest(*r); err != nil {
			b.Fatal(err)
		}
		i++
	}
}
