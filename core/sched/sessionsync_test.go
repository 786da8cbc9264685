package sched

import (
	"math/rand/v2"
	"testing"
	"time"
)

// replicaPair is two routers' session stores whose booked changes reach
// each other at once, as replica sync delivers them.
type replicaPair struct {
	stores [2]*Sessions
	scheds [2]*Scheduler
	sent   [2][]SessionUpdate
}

func newReplicaPair(t *testing.T) *replicaPair {
	rp := &replicaPair{}
	for i := range 2 {
		rp.stores[i] = NewSessions(SessionLimits{})
		rp.scheds[i] = mustNew(t, ModeKV, rp.stores[i])
		rp.stores[i].SetObserver(func(u SessionUpdate) { rp.sent[i] = append(rp.sent[i], u) })
	}
	return rp
}

// deliver applies what replica from sent to the other replica.
func (rp *replicaPair) deliver(t *testing.T, from int, now time.Time) {
	t.Helper()
	for _, u := range rp.sent[from] {
		if _, err := rp.stores[1-from].ApplyRemote(u, now); err != nil {
			t.Fatal(err)
		}
	}
	rp.sent[from] = nil
}

func TestSessionBindingsTravelBetweenReplicas(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	c := &clock{now: t0}
	rp := newReplicaPair(t)
	sel := func(r int, cands []Candidate, action SessionAction, commit bool) Choice {
		t.Helper()
		ch, err := rp.scheds[r].Select(&Request{BlockSize: 16, Params: costOnly, Now: c.now, Commit: commit,
			Session: &SessionControl{ID: "s", Action: action, Timeout: time.Minute}}, cands, rng)
		if err != nil {
			t.Fatal(err)
		}
		return ch
	}

	// Replica 0 binds the session to worker 2, its cheapest; replica 1,
	// whose costs prefer worker 3, follows the binding it learned.
	if ch := sel(0, withCosts(5, 1, 9), SessionOpen, true); ch.Worker != worker(2) {
		t.Fatalf("open: %+v", ch)
	}
	if len(rp.sent[0]) != 1 || rp.sent[0][0].Kind != SessionBound || rp.sent[0][0].Seq != 1 || rp.sent[0][0].TTL != time.Minute {
		t.Fatalf("sent %+v, want one bind numbered 1 with the request's TTL", rp.sent[0])
	}
	rp.deliver(t, 0, c.now)
	if ch := sel(1, withCosts(5, 9, 1), SessionUse, true); ch.Worker != worker(2) || ch.Via != ViaSession {
		t.Fatalf("replica 1 ignored the binding: %+v", ch)
	}

	// Each use refreshes the binding on the other replica: 50 s apart,
	// three times, the binding of a minute outlives them all.
	for range 3 {
		rp.deliver(t, 1, c.now)
		rp.deliver(t, 0, c.now)
		c.advance(50 * time.Second)
		if ch := sel(0, withCosts(9, 9, 1), SessionUse, true); ch.Worker != worker(2) {
			t.Fatalf("the binding expired on replica 0 although replica 1 used it: %+v", ch)
		}
		rp.deliver(t, 0, c.now)
		c.advance(50 * time.Second)
		if ch := sel(1, withCosts(9, 9, 1), SessionUse, true); ch.Worker != worker(2) {
			t.Fatalf("the binding expired on replica 1 although replica 0 used it: %+v", ch)
		}
	}
	// A query is not observed.
	if sel(0, withCosts(9, 9, 1), SessionUse, false); len(rp.sent[0]) != 0 {
		t.Fatalf("a query was published: %+v", rp.sent[0])
	}

	// A close on replica 1 unbinds replica 0.
	rp.deliver(t, 1, c.now)
	sel(1, withCosts(9, 9, 1), SessionClose, true)
	rp.deliver(t, 1, c.now)
	if rp.stores[0].Len() != 0 || rp.stores[1].Len() != 0 {
		t.Fatalf("pins after close: %d, %d", rp.stores[0].Len(), rp.stores[1].Len())
	}

	// Two replicas bind the same new session at once to different workers:
	// once each hears of the other's both keep the lower worker.
	sel(0, withCosts(9, 9, 1), SessionBind, true)
	sel(1, withCosts(9, 1, 9), SessionBind, true)
	rp.deliver(t, 0, c.now)
	rp.deliver(t, 1, c.now)
	for r := range 2 {
		if w, ok := rp.stores[r].Lookup("s", c.now); !ok || w != worker(2) {
			t.Fatalf("replica %d holds %v %v after a race, want worker 2", r, w, ok)
		}
	}

	// A move (the worker left) takes the next number: the other replica
	// takes it over its own, and a late close of the older binding leaves
	// it.
	stale := SessionUpdate{Kind: SessionClosed, ID: "s", Seq: 1}
	if ch := sel(0, withCosts(1), SessionUse, true); ch.Worker != worker(1) || rp.sent[0][0].Seq != 2 {
		t.Fatalf("move: %+v, sent %+v", ch, rp.sent[0])
	}
	rp.deliver(t, 0, c.now)
	if changed, _ := rp.stores[1].ApplyRemote(stale, c.now); changed {
		t.Fatal("a close of an older binding unbound the newer one")
	}
	if w, ok := rp.stores[1].Lookup("s", c.now); !ok || w != worker(1) {
		t.Fatalf("replica 1 holds %v %v, want the moved binding to worker 1", w, ok)
	}
	// An older binding arriving late changes nothing either.
	if changed, _ := rp.stores[1].ApplyRemote(SessionUpdate{Kind: SessionBound, ID: "s", Worker: worker(3), Seq: 1}, c.now); changed {
		t.Fatal("an older binding replaced a newer one")
	}

	// A binding learned from a peer expires by its TTL.
	if _, err := rp.stores[1].ApplyRemote(SessionUpdate{Kind: SessionBound, ID: "t", Worker: worker(3), Seq: 1, TTL: 10 * time.Second}, c.now); err != nil {
		t.Fatal(err)
	}
	if _, ok := rp.stores[1].Lookup("t", c.now.Add(9*time.Second)); !ok {
		t.Fatal("the learned binding expired early")
	}
	if _, ok := rp.stores[1].Lookup("t", c.now.Add(19*time.Second)); ok {
		t.Fatal("the learned binding outlived its TTL")
	}
	if _, err := rp.stores[1].ApplyRemote(SessionUpdate{Kind: SessionBound, Worker: worker(3), Seq: 1}, c.now); err == nil {
		t.Fatal("an update without a session id was applied")
	}
}
