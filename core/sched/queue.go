package sched

import (
	"container/heap"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"
)

// DefaultQueueThreshold is --router-queue-threshold's default: queue once
// every worker has 16 steps' worth of prompt tokens waiting.
const DefaultQueueThreshold = 16.0

// DefaultRefreshAfter is how long a request may wait in the queue before
// its overlaps are worth recomputing at dispatch.
const DefaultRefreshAfter = 10 * time.Second

// ParseQueueThreshold reads --router-queue-threshold. "none" (any case)
// disables queueing and yields nil; otherwise the value must be a finite
// number > 0.
func ParseQueueThreshold(s string) (*float64, error) {
	s = strings.TrimSpace(s)
	if strings.EqualFold(s, "none") {
		return nil, nil
	}
	v, err := strconv.ParseFloat(s, 64)
	if err != nil || !(v > 0) || math.IsInf(v, 1) {
		return nil, fmt.Errorf("sched: queue threshold %q: want a number > 0 or \"none\"", s)
	}
	return &v, nil
}

// ShouldQueue reports whether a request should wait rather than be routed
// now: true only when every candidate has more active prefill tokens than
// threshold × its MaxNumBatchedTokens. A worker whose budget is unknown
// cannot be shown saturated, so it keeps the gate open; so does an empty
// fleet, since waiting would not make a worker appear. A nil threshold
// disables queueing.
func ShouldQueue(cands []Candidate, threshold *float64) bool {
	if threshold == nil || len(cands) == 0 {
		return false
	}
	for i := range cands {
		c := &cands[i]
		if c.MaxNumBatchedTokens <= 0 || float64(c.ActivePrefillTokens) <= *threshold*float64(c.MaxNumBatchedTokens) {
			return false
		}
	}
	return true
}

// NeedsRefresh reports whether a request that arrived at arrival and is
// dispatched at now has waited long enough (≥ refreshAfter) that the cache
// state it was scored against may be stale. refreshAfter 0 disables it.
func NeedsRefresh(arrival, now time.Time, refreshAfter time.Duration) bool {
	return refreshAfter > 0 && now.Sub(arrival) >= refreshAfter
}

// QueuePolicy orders waiting requests (--router-queue-policy).
type QueuePolicy string

const (
	// FCFS serves the oldest first; a priority jump of p seconds lets a
	// request overtake those that arrived up to p seconds before it. It
	// bounds waiting, hence tail TTFT.
	FCFS QueuePolicy = "fcfs"
	// LCFS serves the newest first; it exists for comparison experiments.
	LCFS QueuePolicy = "lcfs"
	// WSPT (weighted shortest processing time) serves the highest
	// (1 + priority jump) / uncached tokens first, which minimises mean TTFT.
	WSPT QueuePolicy = "wspt"
)

// ParseQueuePolicy reads a --router-queue-policy value.
func ParseQueuePolicy(s string) (QueuePolicy, error) {
	switch p := QueuePolicy(strings.ToLower(strings.TrimSpace(s))); p {
	case FCFS, LCFS, WSPT:
		return p, nil
	}
	return "", fmt.Errorf("sched: unknown queue policy %q (valid: fcfs, lcfs, wspt)", s)
}

// QueueItem is one waiting request.
type QueueItem struct {
	ID      string
	Arrival time.Time
	// Priority is agent_hints.priority; only its positive part counts, as a
	// jump in seconds for fcfs/lcfs and as a weight for wspt, so a client
	// cannot push others' requests back by asking for negative priority.
	Priority float64
	// Tier is agent_hints.strict_priority: every waiting request of a
	// higher tier is served before any of a lower one, whatever the
	// policy; the policy orders requests within a tier.
	Tier           uint32
	UncachedTokens int // prompt tokens not cached anywhere, the prefill work
	Payload        any
}

// ErrDuplicateID is returned by Push for an ID already waiting.
var ErrDuplicateID = errors.New("sched: request already queued")

// Queue holds requests in policy order. It is not safe for concurrent use:
// its owner decides under one lock both what waits and what is dispatched.
type Queue struct {
	policy QueuePolicy
	h      queueHeap
	byID   map[string]*queued
	tokens int
	seq    uint64
	// epoch is the first arrival ever pushed. Arrival offsets are measured
	// from it so that keys stay small, precise floats.
	epoch    time.Time
	hasEpoch bool
}

type queued struct {
	item  QueueItem
	key   float64 // higher is served first
	seq   uint64  // push order, breaks key ties first-in first-out
	index int     // position in the heap, kept by Swap for Remove
}

// NewQueue returns an empty queue ordered by policy.
func NewQueue(policy QueuePolicy) (*Queue, error) {
	if _, err := ParseQueuePolicy(string(policy)); err != nil {
		return nil, err
	}
	return &Queue{policy: policy, byID: map[string]*queued{}}, nil
}

func (q *Queue) key(it *QueueItem) float64 {
	jump := 0.0
	if it.Priority > 0 { // also maps NaN to 0, which would break the heap order
		jump = it.Priority
	}
	switch q.policy {
	case FCFS:
		return jump - it.Arrival.Sub(q.epoch).Seconds()
	case LCFS:
		return jump + it.Arrival.Sub(q.epoch).Seconds()
	default: // WSPT
		return (1 + jump) / float64(max(1, it.UncachedTokens))
	}
}

// Push adds it.
func (q *Queue) Push(it QueueItem) error {
	if _, ok := q.byID[it.ID]; ok {
		return fmt.Errorf("%w: %q", ErrDuplicateID, it.ID)
	}
	if !q.hasEpoch {
		q.epoch, q.hasEpoch = it.Arrival, true
	}
	e := &queued{item: it, key: q.key(&it), seq: q.seq}
	q.seq++
	heap.Push(&q.h, e)
	q.byID[it.ID] = e
	q.tokens += max(0, it.UncachedTokens)
	return nil
}

// Peek returns the item Pop would return, leaving it queued.
func (q *Queue) Peek() (QueueItem, bool) {
	if len(q.h) == 0 {
		return QueueItem{}, false
	}
	return q.h[0].item, true
}

// Pop removes and returns the item to serve next.
func (q *Queue) Pop() (QueueItem, bool) {
	if len(q.h) == 0 {
		return QueueItem{}, false
	}
	e := heap.Pop(&q.h).(*queued)
	q.forget(e)
	return e.item, true
}

// Remove drops the item with id, for a client that gave up waiting, and
// reports whether it was queued.
func (q *Queue) Remove(id string) bool {
	e, ok := q.byID[id]
	if !ok {
		return false
	}
	heap.Remove(&q.h, e.index)
	q.forget(e)
	return true
}

func (q *Queue) forget(e *queued) {
	delete(q.byID, e.item.ID)
	q.tokens -= max(0, e.item.UncachedTokens)
}

// Len is the number of waiting requests.
func (q *Queue) Len() int { return len(q.h) }

// PendingTokens is the sum of the waiting requests' uncached tokens, the
// prefill work the queue holds back.
func (q *Queue) PendingTokens() int { return q.tokens }

type queueHeap []*queued

func (h queueHeap) Len() int { return len(h) }

func (h queueHeap) Less(i, j int) bool {
	if h[i].item.Tier != h[j].item.Tier {
		return h[i].item.Tier > h[j].item.Tier
	}
	if h[i].key != h[j].key {
		return h[i].key > h[j].key
	}
	return h[i].seq < h[j].seq
}

func (h queueHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].index = i
	h[j].index = j
}

func (h *queueHeap) Push(x any) {
	e := x.(*queued)
	e.index = len(*h)
	*h = append(*h, e)
}

func (h *queueHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return e
}
