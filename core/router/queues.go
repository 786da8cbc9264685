package router

import (
	"cmp"
	"slices"

	"github.com/kvrouter/kvrouter/core/sched"
)

// queueKey names one admission queue: the requests that wait for the same
// workers, those of one model's prefill pool or of its decode-capable one.
type queueKey struct {
	model   string
	prefill bool
}

// queues are the admission queues by key, each in the queue policy's
// order. Guarded by Router.mu.
type queues struct {
	policy sched.QueuePolicy
	byKey  map[queueKey]*sched.Queue
	where  map[string]queueKey // request id → its queue
	order  []queueKey          // scratch of keys
}

func newQueues(policy sched.QueuePolicy) *queues {
	return &queues{policy: policy, byKey: map[queueKey]*sched.Queue{}, where: map[string]queueKey{}}
}

func (qs *queues) len(k queueKey) int {
	if q := qs.byKey[k]; q != nil {
		return q.Len()
	}
	return 0
}

func (qs *queues) push(k queueKey, it sched.QueueItem) error {
	q := qs.byKey[k]
	if q == nil {
		var err error
		if q, err = sched.NewQueue(qs.policy); err != nil {
			return err
		}
		qs.byKey[k] = q
	}
	if err := q.Push(it); err != nil {
		return err
	}
	qs.where[it.ID] = k
	return nil
}

func (qs *queues) remove(id string) bool {
	k, ok := qs.where[id]
	if !ok {
		return false
	}
	delete(qs.where, id)
	return qs.byKey[k].Remove(id)
}

// keys lists the keys of the non-empty queues in a stable order (by
// model, prefill pool first: a prefill dispatched is a decode on its way).
func (qs *queues) keys() []queueKey {
	keys := qs.order[:0]
	for k, q := range qs.byKey {
		if q.Len() > 0 {
			keys = append(keys, k)
		}
	}
	slices.SortFunc(keys, func(a, b queueKey) int {
		if c := cmp.Compare(a.model, b.model); c != 0 {
			return c
		}
		switch {
		case a.prefill == b.prefill:
			return 0
		case a.prefill:
			return -1
		}
		return 1
	})
	qs.order = keys
	return keys
}

func (qs *queues) peek(k queueKey) (sched.QueueItem, bool) {
	if q := qs.byKey[k]; q != nil {
		return q.Peek()
	}
	return sched.QueueItem{}, false
}

func (qs *queues) pop(k queueKey) {
	if it, ok := qs.byKey[k].Pop(); ok {
		delete(qs.where, it.ID)
	}
}

// prune forgets the queues left empty, so that they do not accumulate
// with the models ever seen.
func (qs *queues) prune() {
	for k, q := range qs.byKey {
		if q.Len() == 0 {
			delete(qs.byKey, k)
		}
	}
}

func (qs *queues) total() int {
	n := 0
	for _, q := range qs.byKey {
		n += q.Len()
	}
	return n
}

func (qs *queues) pendingTokens() int {
	n := 0
	for _, q := range qs.byKey {
		n += q.PendingTokens()
	}
	return n
}
