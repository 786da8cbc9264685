// Package eventlog keeps KV events continuous across a lossy plane
// (SPEC §3.3, NATS-core mode). It has two sides:
//
//   - Log, on the worker: numbers each rank's events 1, 2, 3, ..., keeps the
//     last RingSize of them and the rank's current blocks, so that it can
//     answer "events from..to" or, when those have left the ring, "everything
//     you hold now" (a dump).
//   - Cursor, on the router: remembers the last event applied per rank and
//     tells a fresh event apart from a duplicate and from one that reveals
//     a gap that must be recovered first.
//
// Like the rest of core it does no I/O.
package eventlog

import (
	"fmt"
	"slices"
	"sync"

	"github.com/kvrouter/kvrouter/core/index"
	"github.com/kvrouter/kvrouter/core/kv"
)

// DefaultRingSize is how many recent events each rank keeps (SPEC §3.3).
const DefaultRingSize = 1024

// Log is one worker's numbered event history. Safe for concurrent use.
type Log struct {
	worker   uint64
	ringSize int

	mu    sync.Mutex // guards ranks and everything in them
	ranks map[uint32]*rankLog
}

type rankLog struct {
	last uint64     // id of the newest event; 0 before the first
	ring []kv.Event // ring[(id-1) % len]
	ix   *index.Index
}

// New returns an empty log for worker; ringSize ≤ 0 means DefaultRingSize.
func New(worker uint64, ringSize int) *Log {
	if ringSize <= 0 {
		ringSize = DefaultRingSize
	}
	return &Log{worker: worker, ringSize: ringSize, ranks: map[uint32]*rankLog{}}
}

func (l *Log) rank(r uint32) *rankLog {
	rl := l.ranks[r]
	if rl == nil {
		rl = &rankLog{ring: make([]kv.Event, l.ringSize), ix: index.New(index.Config{Shards: 1})}
		l.ranks[r] = rl
	}
	return rl
}

// Append numbers ev (its Worker.ID is forced to the log's worker), applies
// it to the rank's blocks and keeps it. An event the index refuses (a parent
// the worker never stored, no blocks) is not numbered: no router could
// apply it either, and numbering it would make every router ask for it.
func (l *Log) Append(ev kv.Event) (kv.Event, error) {
	ev.Worker.ID = l.worker
	l.mu.Lock()
	defer l.mu.Unlock()
	rl := l.rank(ev.Worker.DPRank)
	if err := rl.ix.Apply(&ev); err != nil {
		return kv.Event{}, err
	}
	rl.last++
	ev.EventID = rl.last
	rl.ring[(rl.last-1)%uint64(len(rl.ring))] = ev
	return ev, nil
}

// Last is the id of rank's newest event, 0 if none.
func (l *Log) Last(rank uint32) uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	if rl := l.ranks[rank]; rl != nil {
		return rl.last
	}
	return 0
}

// Range returns rank's events from..to inclusive; ok is false when the
// ring no longer holds all of them or they do not exist yet.
func (l *Log) Range(rank uint32, from, to uint64) (events []kv.Event, ok bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	rl := l.ranks[rank]
	if rl == nil || from == 0 || from > to || to > rl.last {
		return nil, false
	}
	size := uint64(len(rl.ring))
	if rl.last-from >= size {
		return nil, false
	}
	events = make([]kv.Event, 0, to-from+1)
	for id := from; id <= to; id++ {
		events = append(events, rl.ring[(id-1)%size])
	}
	return events, true
}

// Dump returns single-block Stored events that rebuild the rank's current
// blocks on an empty rank, and the id of the last event they include.
func (l *Log) Dump(rank uint32) (events []kv.Event, last uint64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	rl := l.ranks[rank]
	if rl == nil {
		return nil, 0
	}
	return rl.ix.Dump(), rl.last
}

// Ranks lists the ranks that logged events, in order.
func (l *Log) Ranks() []uint32 {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make([]uint32, 0, len(l.ranks))
	for r := range l.ranks {
		out = append(out, r)
	}
	slices.Sort(out)
	return out
}

// Verdict is what a router should do with an incoming event.
type Verdict uint8

const (
	// Apply: the event is the next one expected.
	Apply Verdict = iota
	// Duplicate: already applied (or covered by a dump); drop it.
	Duplicate
	// Gap: events are missing before this one; recover them first.
	Gap
	// Unsynced: the rank has not been synced yet (no dump applied); the
	// router must fetch its state before applying anything.
	Unsynced
)

func (v Verdict) String() string {
	switch v {
	case Apply:
		return "apply"
	case Duplicate:
		return "duplicate"
	case Gap:
		return "gap"
	case Unsynced:
		return "unsynced"
	}
	return fmt.Sprintf("verdict(%d)", uint8(v))
}

// Cursor is the router's position in every rank's event sequence. Not safe
// for concurrent use: the plane applies events on one goroutine.
type Cursor struct {
	last map[kv.Worker]uint64
}

// NewCursor returns a cursor that knows no rank.
func NewCursor() *Cursor { return &Cursor{last: map[kv.Worker]uint64{}} }

// Check classifies event id of rank w.
func (c *Cursor) Check(w kv.Worker, id uint64) Verdict {
	last, ok := c.last[w]
	switch {
	case !ok:
		return Unsynced
	case id <= last:
		return Duplicate
	case id == last+1:
		return Apply
	}
	return Gap
}

// Behind reports whether the rank's newest event (as the worker announces
// it) is past what was applied: events were lost and nothing newer came to
// reveal it.
func (c *Cursor) Behind(w kv.Worker, newest uint64) bool {
	last, ok := c.last[w]
	return ok && newest > last
}

// Next is the id expected next for w (1 for an unsynced rank).
func (c *Cursor) Next(w kv.Worker) uint64 { return c.last[w] + 1 }

// Set records that every event of w up to id is applied.
func (c *Cursor) Set(w kv.Worker, id uint64) { c.last[w] = id }

// Synced reports whether w has a position.
func (c *Cursor) Synced(w kv.Worker) bool {
	_, ok := c.last[w]
	return ok
}

// Forget drops every rank of worker.
func (c *Cursor) Forget(worker uint64) {
	for w := range c.last {
		if w.ID == worker {
			delete(c.last, w)
		}
	}
}
