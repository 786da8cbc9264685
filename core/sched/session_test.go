package sched

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"
)

// clock is a fake time source the tests advance by hand.
type clock struct{ now time.Time }

func (c *clock) advance(d time.Duration) time.Time { c.now = c.now.Add(d); return c.now }

func TestSessionSlidingTTL(t *testing.T) {
	c := &clock{now: t0}
	s := NewSessions(SessionLimits{})
	s.Bind("a", worker(7), 10*time.Second, c.now)
	s.Bind("b", worker(8), 0, c.now) // default timeout
	for _, step := range []struct {
		after time.Duration
		ok    bool
	}{
		{9 * time.Second, true}, // each lookup restarts the TTL...
		{9 * time.Second, true},
		{9 * time.Second, true},
		{10 * time.Second, false}, // ...until a gap reaches it
		{0, false},                // and then it is gone for good
	} {
		w, ok := s.Lookup("a", c.advance(step.after))
		if ok != step.ok || (ok && w != worker(7)) {
			t.Fatalf("at +%v: %v, %v; want ok %v", c.now.Sub(t0), w, ok, step.ok)
		}
	}
	if s.Len() != 1 {
		t.Errorf("Len = %d, want 1 (only b)", s.Len())
	}
	if _, ok := s.Lookup("b", t0.Add(DefaultSessionTimeout-time.Second)); !ok {
		t.Error("default-timeout pin expired early")
	}
	s.Unbind("b")
	if _, ok := s.Lookup("b", t0); ok {
		t.Error("Unbind left the pin")
	}
}

func TestSessionSweep(t *testing.T) {
	s := NewSessions(SessionLimits{})
	for i := range 10 {
		s.Bind(fmt.Sprint(i), worker(1), time.Duration(i+1)*time.Second, t0)
	}
	if got := s.Sweep(t0.Add(5 * time.Second)); got != 5 {
		t.Errorf("swept %d, want 5", got)
	}
	if s.Len() != 5 {
		t.Errorf("Len = %d, want 5", s.Len())
	}
}

func TestSchedulerSessions(t *testing.T) {
	c := &clock{now: t0}
	sessions := NewSessions(SessionLimits{})
	s := mustNew(t, ModeKV, sessions)
	rng := rand.New(rand.NewPCG(1, 2))
	cands := withCosts(5, 1, 9) // worker 2 is cheapest
	sel := func(cands []Candidate, action SessionAction, busy BusyThreshold) Choice {
		t.Helper()
		ch, err := s.Select(&Request{BlockSize: 16, Params: costOnly, Busy: busy, Now: c.now,
			Session: &SessionControl{ID: "s1", Action: action, Timeout: time.Minute}}, cands, rng)
		if err != nil {
			t.Fatal(err)
		}
		return ch
	}

	// A plain session request without a pin routes normally and pins nothing.
	if ch := sel(cands, SessionUse, BusyThreshold{}); ch.Index != 1 || ch.Via != ViaPolicy || sessions.Len() != 0 {
		t.Fatalf("unpinned use: %+v, %d pins", ch, sessions.Len())
	}
	// bind pins the routed worker.
	if ch := sel(cands, SessionBind, BusyThreshold{}); ch.Worker != worker(2) || ch.Via != ViaPolicy {
		t.Fatalf("bind: %+v", ch)
	}
	// Costs change; the pin holds, even with worker 2 busy.
	cands = withCosts(1, 50, 9)
	cands[1].ActivePrefillTokens = 99
	c.advance(50 * time.Second)
	if ch := sel(cands, SessionUse, BusyThreshold{ActivePrefillTokens: n(10)}); ch.Worker != worker(2) || ch.Via != ViaSession {
		t.Fatalf("pinned use: %+v", ch)
	}
	// close routes by the pin once more, then unpins.
	c.advance(50 * time.Second) // 50 s after the last use: still live
	if ch := sel(cands, SessionClose, BusyThreshold{}); ch.Worker != worker(2) || ch.Via != ViaSession {
		t.Fatalf("close: %+v", ch)
	}
	if ch := sel(cands, SessionUse, BusyThreshold{}); ch.Worker != worker(1) || sessions.Len() != 0 {
		t.Fatalf("after close: %+v, %d pins", ch, sessions.Len())
	}

	// open pins too; after the TTL the pin is gone and scoring resumes.
	if ch := sel(cands, SessionOpen, BusyThreshold{}); ch.Worker != worker(1) {
		t.Fatalf("open: %+v", ch)
	}
	c.advance(time.Minute)
	cands = withCosts(7, 50, 3)
	if ch := sel(cands, SessionUse, BusyThreshold{}); ch.Worker != worker(3) || ch.Via != ViaPolicy || sessions.Len() != 0 {
		t.Fatalf("after expiry: %+v, %d pins", ch, sessions.Len())
	}

	// A pin to a worker that left is ignored and moved to the new choice.
	sessions.Bind("s1", worker(99), time.Minute, c.now)
	if ch := sel(cands, SessionUse, BusyThreshold{}); ch.Worker != worker(3) || ch.Via != ViaPolicy {
		t.Fatalf("stale pin: %+v", ch)
	}
	if w, ok := sessions.Lookup("s1", c.now); !ok || w != worker(3) {
		t.Fatalf("stale pin not moved: %v %v", w, ok)
	}
	// Closing a stale pin drops it.
	sessions.Bind("s1", worker(99), time.Minute, c.now)
	sel(cands, SessionClose, BusyThreshold{})
	if sessions.Len() != 0 {
		t.Fatal("stale pin survived close")
	}

	// Without a store, session control is ignored.
	plain := mustNew(t, ModeKV, nil)
	ch, err := plain.Select(&Request{BlockSize: 16, Params: costOnly, Session: &SessionControl{ID: "s1", Action: SessionBind}}, cands, rng)
	if err != nil || ch.Via != ViaPolicy {
		t.Fatalf("no store: %+v %v", ch, err)
	}
}

func TestSessionsConcurrent(t *testing.T) {
	sessions := NewSessions(SessionLimits{})
	s := mustNew(t, ModeRandom, sessions)
	cands := withCosts(1, 2, 3, 4)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 300 {
				now := t0.Add(time.Duration(i) * time.Second)
				id := fmt.Sprint("s", (g+i)%5)
				action := []SessionAction{SessionUse, SessionBind, SessionOpen, SessionClose}[i%4]
				if _, err := s.Select(&Request{BlockSize: 16, Now: now, Session: &SessionControl{ID: id, Action: action, Timeout: 3 * time.Second}}, cands, SharedRand); err != nil {
					t.Error(err)
					return
				}
				sessions.Sweep(now)
			}
		})
	}
	wg.Wait()
}

// TestSessionLimits holds the store to its bounds: ids and timeouts beyond
// the limits are invalid requests, and a new session finding the store full
// of live pins is refused while existing ones keep working; expired pins
// make room again.
func TestSessionLimits(t *testing.T) {
	sessions := NewSessions(SessionLimits{MaxSessions: 100, MaxIDBytes: 64, MaxTimeout: time.Hour})
	s := mustNew(t, ModeKV, sessions)
	cands := withCosts(5, 1, 9)
	rng := rand.New(rand.NewPCG(1, 2))
	open := func(id string, timeout time.Duration, now time.Time) error {
		_, err := s.Select(&Request{BlockSize: 16, Params: costOnly, Now: now,
			Session: &SessionControl{ID: id, Action: SessionOpen, Timeout: timeout}}, cands, rng)
		return err
	}
	for _, tc := range []struct {
		id      string
		timeout time.Duration
	}{{strings.Repeat("x", 65), time.Minute}, {"ok", time.Hour + time.Second}, {"", time.Minute}} {
		if err := open(tc.id, tc.timeout, t0); !errors.Is(err, ErrInvalidRequest) {
			t.Errorf("id of %d bytes, timeout %v: %v, want ErrInvalidRequest", len(tc.id), tc.timeout, err)
		}
	}
	for i := range 100 {
		if err := open(fmt.Sprint("s", i), time.Minute, t0); err != nil {
			t.Fatalf("session %d: %v", i, err)
		}
	}
	if err := open("s100", time.Minute, t0); !errors.Is(err, ErrTooManySessions) {
		t.Fatalf("101st session: %v, want ErrTooManySessions", err)
	}
	if err := open("s7", time.Minute, t0); err != nil {
		t.Fatalf("re-opening a held session: %v", err)
	}
	if sessions.Len() != 100 {
		t.Fatalf("Len = %d, want 100", sessions.Len())
	}
	if err := open("s100", time.Minute, t0.Add(time.Minute)); err != nil {
		t.Fatalf("after the pins expired: %v", err)
	}
	if sessions.Len() != 1 {
		t.Fatalf("Len = %d after the sweep, want 1", sessions.Len())
	}
}

func TestSessionAffinityModes(t *testing.T) {
	// Worker 1 holds the session; the request's prompt is 4 blocks, so a
	// soft binding gives way above 2 × the least load + 4 blocks.
	for _, tc := range []struct {
		name        string
		mode        SessionAffinity
		pinned      float64 // active decode blocks of the session's worker
		other       float64 // and of the other worker
		prefill     int     // prompt tokens awaiting prefill on the session's worker
		busy        BusyThreshold
		gone        bool // the session's worker left
		want        uint64
		viaSession  bool
		pinnedAfter uint64
	}{
		{name: "hard holds a much busier worker", mode: AffinityHard, pinned: 100, want: 1, viaSession: true, pinnedAfter: 1},
		{name: "hard holds a busy worker", mode: AffinityHard, prefill: 99, busy: BusyThreshold{ActivePrefillTokens: n(10)}, want: 1, viaSession: true, pinnedAfter: 1},
		{name: "the default is hard", pinned: 100, want: 1, viaSession: true, pinnedAfter: 1},
		{name: "soft gives way to a much busier worker", mode: AffinitySoft, pinned: 100, want: 2, pinnedAfter: 2},
		{name: "soft holds at low load", mode: AffinitySoft, pinned: 4, want: 1, viaSession: true, pinnedAfter: 1},
		{name: "soft holds at the bound", mode: AffinitySoft, pinned: 10, other: 3, want: 1, viaSession: true, pinnedAfter: 1},
		{name: "soft gives way past the bound", mode: AffinitySoft, pinned: 11, other: 3, want: 2, pinnedAfter: 2},
		{name: "prompt tokens count as load", mode: AffinitySoft, prefill: 16 * 11, other: 3, want: 2, pinnedAfter: 2},
		{name: "soft gives way to a busy worker", mode: AffinitySoft, prefill: 20, busy: BusyThreshold{ActivePrefillTokens: n(10)}, want: 2, pinnedAfter: 2},
		{name: "hard moves from a worker gone", mode: AffinityHard, gone: true, want: 2, pinnedAfter: 2},
		{name: "soft moves from a worker gone", mode: AffinitySoft, gone: true, want: 2, pinnedAfter: 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sessions := NewSessions(SessionLimits{})
			s := mustNew(t, ModeKV, sessions)
			if tc.mode != "" {
				s.SetSessionAffinity(tc.mode)
			}
			sessions.Bind("s", worker(1), time.Minute, t0)
			cands := withCosts(tc.pinned+float64(tc.prefill)/16+1, tc.other) // the policy prefers worker 2
			cands[0].ActiveDecodeBlocks, cands[1].ActiveDecodeBlocks = tc.pinned, tc.other
			cands[0].ActivePrefillTokens = tc.prefill
			if tc.gone {
				cands = cands[1:]
			}
			ch, err := s.Select(&Request{ISL: 64, BlockSize: 16, Params: costOnly, Busy: tc.busy, Now: t0,
				Session: &SessionControl{ID: "s", Action: SessionUse}}, cands, rand.New(rand.NewPCG(1, 2)))
			if err != nil {
				t.Fatal(err)
			}
			if ch.Worker != worker(tc.want) || (ch.Via == ViaSession) != tc.viaSession {
				t.Fatalf("chose %v via %v, want worker %d (via session: %v)", ch.Worker, ch.Via, tc.want, tc.viaSession)
			}
			if w, ok := sessions.Lookup("s", t0); !ok || w != worker(tc.pinnedAfter) {
				t.Fatalf("the session is bound to %v (%v) after, want worker %d", w, ok, tc.pinnedAfter)
			}
		})
	}
}

func TestParseSessionAffinity(t *testing.T) {
	for in, want := range map[string]SessionAffinity{"hard": AffinityHard, " Soft ": AffinitySoft} {
		if got, err := ParseSessionAffinity(in); err != nil || got != want {
			t.Errorf("%q: %v %v", in, got, err)
		}
	}
	if _, err := ParseSessionAffinity("sticky"); err == nil || !strings.Contains(err.Error(), "hard, soft") {
		t.Errorf("an unknown mode: %v", err)
	}
}
