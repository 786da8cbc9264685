package router

import (
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/core/index"
	"github.com/kvrouter/kvrouter/core/kv"
)

// An engine that publishes no KV events (vLLM started without
// --kv-events-config, or an events endpoint pointing where nothing
// publishes) looks, to an event-fed index, like an engine with an empty
// cache: it would be routed by load alone, every conversation scattered,
// and nothing would say why. The router notices it from its own traffic
// and routes that rank as approximate mode does, by the prompts it sent
// there, until the rank's events arrive.
//
// The contract, per worker rank, while the router follows KV events in a
// mode that scores cached prefixes (sched.Mode.ScoresOverlap) and
// Config.KVEventsGrace is above 0:
//
//   - A rank registers as *awaited*: routed by the event-fed index, while
//     the prompts booked to it are also recorded in a separate predicted
//     index (never read for it yet).
//   - The grace period starts at the first evidence that the rank has
//     computed a prompt: the prefill of a request booked there, holding at
//     least one full block, completed (MarkPrefillCompleted), or Served was
//     called (e.g. its prefix-cache query counter grew). The engine has
//     then stored that block and, with events on, published it.
//   - When the grace period has passed, by the injected clock, without any
//     stored or removed event of the rank (applied or refused), the rank is
//     *missing*: its overlap is read from the predicted index. Other ranks
//     are untouched. Cleared events do not count: routers synthesise them
//     when they rebuild a rank.
//   - The first such event of the rank makes it *received* for as long as
//     it is registered: its predicted blocks are dropped and no more are
//     recorded, so the exact index is never mixed with predictions.
//   - RemoveWorker forgets all of it: an engine that comes back is awaited
//     again.
//
// An engine that publishes events but whose prompts, for the whole grace
// period after its first one, are all already cached stores no block and
// publishes nothing, and is mistaken for a missing one; its next event
// corrects that. Replay at the router's start makes this rare: an engine
// that ever published anything answers it.

// DefaultKVEventsGrace is how long after a rank's first computed prompt
// the router waits for its first KV event (--router-kv-events-grace-secs).
// An engine publishes a step's events when the step ends, before or with
// the first token, so a healthy engine is heard within milliseconds; the
// margin covers a subscriber still connecting and the replay asked after
// 3 s of silence, which recovers events a slow subscription lost, and it
// stays short enough to be seen within an operator's first minute.
const DefaultKVEventsGrace = 10 * time.Second

// maxAwaiting bounds the requests remembered until their prefill
// completes: one completion is all the evidence needed.
const maxAwaiting = 1024

// EventsState is what the router knows of one rank's KV events.
type EventsState int

const (
	// EventsNotFollowed: the router keeps no event-fed index
	// (approximate mode, no overlap credit), its mode ignores caches,
	// detection is off, or the rank is not registered.
	EventsNotFollowed EventsState = iota
	// EventsAwaited: no event yet, and the grace period has not run out
	// (or not started: the rank has computed no prompt yet).
	EventsAwaited
	// EventsReceived: the rank's events arrive; routed by the exact index.
	EventsReceived
	// EventsMissing: the rank computed prompts but sent no event within
	// the grace period; routed by predicted blocks.
	EventsMissing
)

func (s EventsState) String() string {
	switch s {
	case EventsAwaited:
		return "awaited"
	case EventsReceived:
		return "received"
	case EventsMissing:
		return "missing"
	}
	return "not_followed"
}

// Eventless describes a rank routed by predicted blocks for want of KV
// events.
type Eventless struct {
	Worker kv.Worker
	Served time.Time // the first evidence that it computed a prompt
	Since  time.Time // the end of the grace period: routed by prediction since
}

type eventWatch struct {
	grace time.Duration
	now   func() time.Time
	// predicted holds the prompts booked to ranks that never sent an
	// event; only those of missing ranks are read.
	predicted *index.Approx

	// heard holds the registered ranks that sent an event (kv.Worker →
	// struct{}); read without a lock on every event and booking.
	heard sync.Map
	// unheard counts the registered ranks not in heard, and awaitingN
	// the entries of awaiting, so that booking and prefill completions
	// skip the lock once every rank is heard.
	unheard, awaitingN atomic.Int32
	// due is the earliest end of a running grace period (Unix ns),
	// math.MaxInt64 when none runs.
	due atomic.Int64
	// missing is the set of missing ranks, replaced whole on change.
	missing atomic.Pointer[map[kv.Worker]struct{}]

	mu       sync.Mutex // guards ranks and awaiting; taken before predicted's lock
	ranks    map[kv.Worker]*unheardRank
	awaiting map[string]kv.Worker // booked on an unheard rank, prefill not done
}

type unheardRank struct {
	served time.Time // zero: no evidence yet
	since  time.Time // zero: not missing (yet)
}

func newEventWatch(grace time.Duration, now func() time.Time, approx index.ApproxConfig) *eventWatch {
	wt := &eventWatch{grace: grace, now: now, predicted: index.NewApprox(approx), ranks: map[kv.Worker]*unheardRank{}, awaiting: map[string]kv.Worker{}}
	wt.due.Store(math.MaxInt64)
	return wt
}

// register awaits the events of a rank that is neither heard nor awaited.
func (wt *eventWatch) register(w kv.Worker) {
	if wt == nil {
		return
	}
	wt.mu.Lock()
	defer wt.mu.Unlock()
	if _, ok := wt.heard.Load(w); ok || wt.ranks[w] != nil {
		return
	}
	wt.ranks[w] = &unheardRank{}
	wt.unheard.Add(1)
}

// forget drops every rank of engine id for which drop holds.
func (wt *eventWatch) forget(drop func(kv.Worker) bool) {
	if wt == nil {
		return
	}
	wt.mu.Lock()
	defer wt.mu.Unlock()
	wt.heard.Range(func(k, _ any) bool {
		if drop(k.(kv.Worker)) {
			wt.heard.Delete(k)
		}
		return true
	})
	changed := false
	for w, rk := range wt.ranks {
		if drop(w) {
			delete(wt.ranks, w)
			wt.unheard.Add(-1)
			wt.predicted.RemoveRank(w)
			changed = changed || !rk.since.IsZero()
		}
	}
	wt.dropAwaitingLocked(drop)
	if changed {
		wt.publishMissingLocked()
	}
	wt.scheduleLocked()
}

// dropAwaitingLocked forgets the requests awaited on the ranks for which
// drop holds.
func (wt *eventWatch) dropAwaitingLocked(drop func(kv.Worker) bool) {
	for id, w := range wt.awaiting {
		if drop(w) {
			delete(wt.awaiting, id)
			wt.awaitingN.Add(-1)
		}
	}
}

// lockUnheard locks wt and returns w's entry when w is registered and has
// sent no event; otherwise it returns nil and leaves wt unlocked. A heard
// rank costs no lock.
func (wt *eventWatch) lockUnheard(w kv.Worker) *unheardRank {
	if wt == nil {
		return nil
	}
	if _, ok := wt.heard.Load(w); ok {
		return nil
	}
	wt.mu.Lock()
	if rk := wt.ranks[w]; rk != nil {
		return rk
	}
	wt.mu.Unlock()
	return nil
}

// heardFrom records an event of w: a registered rank that was awaited or
// missing switches to the exact index for good, its predictions dropped.
func (wt *eventWatch) heardFrom(w kv.Worker) {
	rk := wt.lockUnheard(w)
	if rk == nil {
		return
	}
	defer wt.mu.Unlock()
	delete(wt.ranks, w)
	wt.unheard.Add(-1)
	wt.heard.Store(w, struct{}{})
	wt.predicted.RemoveRank(w)
	wt.dropAwaitingLocked(func(aw kv.Worker) bool { return aw == w })
	if !rk.since.IsZero() {
		wt.publishMissingLocked()
	}
	wt.scheduleLocked()
}

// booked records a prompt booked to w while w has sent no event.
func (wt *eventWatch) booked(id string, w kv.Worker, local, seq []uint64) {
	if wt == nil || wt.unheard.Load() == 0 {
		return
	}
	rk := wt.lockUnheard(w)
	if rk == nil {
		return
	}
	defer wt.mu.Unlock()
	// Under mu, so that a concurrent first event cannot drop the rank's
	// predictions before these land.
	wt.predicted.Insert(w, local, seq)
	if rk.served.IsZero() && len(seq) > 0 && len(wt.awaiting) < maxAwaiting {
		if _, dup := wt.awaiting[id]; !dup {
			wt.awaiting[id] = w
			wt.awaitingN.Add(1)
		}
	}
}

// prefillDone takes the completed prefill of request id as evidence that
// its rank computed a prompt.
func (wt *eventWatch) prefillDone(id string) {
	if wt == nil || wt.awaitingN.Load() == 0 {
		return
	}
	wt.mu.Lock()
	defer wt.mu.Unlock()
	w, ok := wt.awaiting[id]
	if !ok {
		return
	}
	delete(wt.awaiting, id)
	wt.awaitingN.Add(-1)
	wt.servedLocked(w)
}

// freed forgets a request that ends; without a completed prefill it
// proves nothing.
func (wt *eventWatch) freed(id string) {
	if wt == nil || wt.awaitingN.Load() == 0 {
		return
	}
	wt.mu.Lock()
	defer wt.mu.Unlock()
	if _, ok := wt.awaiting[id]; ok {
		delete(wt.awaiting, id)
		wt.awaitingN.Add(-1)
	}
}

func (wt *eventWatch) served(w kv.Worker) {
	if wt == nil || wt.unheard.Load() == 0 {
		return
	}
	wt.mu.Lock()
	defer wt.mu.Unlock()
	wt.servedLocked(w)
}

// servedLocked starts w's grace period, if w is unheard and it has not
// started yet.
func (wt *eventWatch) servedLocked(w kv.Worker) {
	rk := wt.ranks[w]
	if rk == nil || !rk.served.IsZero() {
		return
	}
	rk.served = wt.now()
	wt.dropAwaitingLocked(func(aw kv.Worker) bool { return aw == w })
	wt.scheduleLocked()
}

// missingAt returns the missing ranks at now, first turning those whose
// grace period has run out missing; nil when there are none.
func (wt *eventWatch) missingAt(now time.Time) map[kv.Worker]struct{} {
	if wt == nil {
		return nil
	}
	if now.UnixNano() >= wt.due.Load() {
		wt.mu.Lock()
		changed := false
		for _, rk := range wt.ranks {
			if !rk.served.IsZero() && rk.since.IsZero() && !now.Before(rk.served.Add(wt.grace)) {
				rk.since = rk.served.Add(wt.grace)
				changed = true
			}
		}
		if changed {
			wt.publishMissingLocked()
		}
		wt.scheduleLocked()
		wt.mu.Unlock()
	}
	if m := wt.missing.Load(); m != nil {
		return *m
	}
	return nil
}

// scheduleLocked sets due to the end of the earliest running grace period.
func (wt *eventWatch) scheduleLocked() {
	due := int64(math.MaxInt64)
	for _, rk := range wt.ranks {
		if !rk.served.IsZero() && rk.since.IsZero() {
			due = min(due, rk.served.Add(wt.grace).UnixNano())
		}
	}
	wt.due.Store(due)
}

func (wt *eventWatch) publishMissingLocked() {
	var m map[kv.Worker]struct{}
	for w, rk := range wt.ranks {
		if !rk.since.IsZero() {
			if m == nil {
				m = map[kv.Worker]struct{}{}
			}
			m[w] = struct{}{}
		}
	}
	if m == nil {
		wt.missing.Store(nil)
		return
	}
	wt.missing.Store(&m)
}

func (wt *eventWatch) state(w kv.Worker) EventsState {
	if wt == nil {
		return EventsNotFollowed
	}
	if _, ok := wt.missingAt(wt.now())[w]; ok {
		return EventsMissing
	}
	if _, ok := wt.heard.Load(w); ok {
		return EventsReceived
	}
	wt.mu.Lock()
	defer wt.mu.Unlock()
	if wt.ranks[w] != nil {
		return EventsAwaited
	}
	return EventsNotFollowed
}

func (wt *eventWatch) eventless() []Eventless {
	if wt == nil || len(wt.missingAt(wt.now())) == 0 {
		return nil
	}
	wt.mu.Lock()
	var out []Eventless
	for w, rk := range wt.ranks {
		if !rk.since.IsZero() {
			out = append(out, Eventless{Worker: w, Served: rk.served, Since: rk.since})
		}
	}
	wt.mu.Unlock()
	slices.SortFunc(out, func(a, b Eventless) int {
		if c := cmpU64(a.Worker.ID, b.Worker.ID); c != 0 {
			return c
		}
		return cmpU64(uint64(a.Worker.DPRank), uint64(b.Worker.DPRank))
	})
	return out
}

// KVEvents tells how rank w is routed as far as its KV events go.
func (r *Router) KVEvents(w kv.Worker) EventsState { return r.watch.state(w) }

// Eventless lists the ranks routed by predicted blocks because their KV
// events never arrived (see DefaultKVEventsGrace), by worker and rank.
func (r *Router) Eventless() []Eventless { return r.watch.eventless() }

// Served is evidence from outside the router that rank w has computed a
// prompt, e.g. its prefix-cache query counter grew: if w has sent no KV
// event, its grace period starts now (if it has not already).
func (r *Router) Served(w kv.Worker) { r.watch.served(w) }
