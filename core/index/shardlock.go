package index

import (
	"runtime"
	"sync/atomic"
	"time"
)

// shardLock is a shard's readers-writer lock. Unlike sync.RWMutex it waits
// by spinning, then yielding, and sleeps only when a hold lasts far longer
// than the index's own: a writer holds a shard for one chunk of an event
// (applyChunk blocks, a few microseconds) and a lookup for its walk of one
// shard. sync.RWMutex parks a goroutine that finds the lock taken, and on
// a virtual machine waking it again costs tens to hundreds of microseconds
// of an idle core: with two goroutines applying events and looking up,
// the wakeups left a fifth of the CPU idle while the waits they stood for
// were a hundredth of it (runtime/trace: 0.72 s of scheduling delay
// against 0.02 s blocked, in 2 s of bench index at 1000 workers).
//
// Fairness, both ways. A waiting writer keeps new readers out (writers),
// so lookups cannot starve event application. Readers that wait for a
// writer are let in before the next writer takes the lock (waitingReaders),
// so a writer releasing and retaking the lock between chunks cannot starve
// lookups.
//
// The zero value is unlocked. Not reentrant; Unlock and RUnlock must pair
// with Lock and RLock.
type shardLock struct {
	// state is the number of readers holding the lock, or writerHolds.
	state atomic.Int32
	// writers counts writers holding or waiting for the lock.
	writers atomic.Int32
	// waitingReaders counts readers waiting for a writer to leave.
	waitingReaders atomic.Int32
	// readerWaits counts the read holds that had to wait for a writer.
	readerWaits atomic.Uint64
}

const writerHolds = -1 << 30

// Lock takes the lock for writing.
func (l *shardLock) Lock() {
	for i := 0; l.waitingReaders.Load() > 0; i++ {
		backoff(i)
	}
	l.writers.Add(1)
	for i := 0; !l.state.CompareAndSwap(0, writerHolds); i++ {
		backoff(i)
	}
}

// Unlock releases a write hold. It adds rather than stores: a reader may
// have counted itself in for an instant and be about to count itself out.
func (l *shardLock) Unlock() {
	l.state.Add(-writerHolds)
	l.writers.Add(-1)
}

// RLock takes the lock for reading.
func (l *shardLock) RLock() {
	if l.tryRLock() {
		return
	}
	l.readerWaits.Add(1)
	l.waitingReaders.Add(1)
	for i := 0; !l.tryRLock(); i++ {
		backoff(i)
	}
	l.waitingReaders.Add(-1)
}

// tryRLock counts the reader in unless a writer holds or waits for the
// lock. The count can go up for an instant while a writer holds it; the
// writer's Unlock adds, so that instant does not disturb it.
func (l *shardLock) tryRLock() bool {
	if l.writers.Load() != 0 {
		return false
	}
	if l.state.Add(1) > 0 {
		return true
	}
	l.state.Add(-1)
	return false
}

// RUnlock releases a read hold.
func (l *shardLock) RUnlock() { l.state.Add(-1) }

// backoff waits a little longer each time: spinning while a hold is likely
// to end within microseconds, then yielding the processor (the holder may
// be a goroutine waiting for it), and past a millisecond or so sleeping.
func backoff(i int) {
	switch {
	case i < 64:
		spinPause(i)
	case i < 2048:
		runtime.Gosched()
	default:
		time.Sleep(20 * time.Microsecond)
	}
}

// spinSink keeps spinPause's loop from being optimised away.
var spinSink atomic.Uint32

//go:noinline
func spinPause(i int) {
	for range 8 + i {
		spinSink.Load()
	}
}
