// Package sched decides which worker serves a request: the KV cost model,
// the routing modes, busy-worker filtering, the admission queue and session
// affinity.
//
// The package is pure so that routing decisions can be replayed and tested
// exactly: it does no I/O, starts no goroutines, reads no clock and owns no
// randomness. Time arrives as time.Time arguments and randomness through the
// Rand interface (a seeded *rand.Rand in tests, SharedRand in production).
// The few stateful types (Thresholds, Sessions, the round-robin counter) are
// safe for concurrent use; Queue is not, because its owner must already
// serialise queueing with dispatch.
//
// Flow for one request, as the router drives it:
//
//	params, warn, err := sched.Resolve(configOverrides, requestOverrides)
//	if sched.ShouldQueue(cands, threshold) { queue.Push(...) ; later Pop }
//	choice, err := scheduler.Select(&sched.Request{..., Busy: thresholds.Get(model)}, cands, rng)
package sched
