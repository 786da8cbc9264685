package index

import (
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/kv"
)

// Writers exclude everyone: a writer keeps two fields equal except inside
// its hold, and no reader may see them differ; readers count themselves in
// while they hold the lock, and no writer may see one.
func TestShardLockExcludes(t *testing.T) {
	var (
		l       shardLock
		a, b    int
		readers atomic.Int32
		wg      sync.WaitGroup
	)
	const writers, readersN, rounds = 3, 3, 3000
	for range writers {
		wg.Go(func() {
			for range rounds {
				l.Lock()
				if n := readers.Load(); n != 0 {
					t.Errorf("a writer holds the lock with %d readers", n)
				}
				a++
				b++
				l.Unlock()
			}
		})
	}
	for range readersN {
		wg.Go(func() {
			for range rounds {
				l.RLock()
				readers.Add(1)
				if a != b {
					t.Errorf("a reader saw a write in progress: %d != %d", a, b)
				}
				readers.Add(-1)
				l.RUnlock()
			}
		})
	}
	wg.Wait()
	if a != writers*rounds || b != a {
		t.Fatalf("a = %d, b = %d, want %d", a, b, writers*rounds)
	}
	if l.state.Load() != 0 || l.writers.Load() != 0 || l.waitingReaders.Load() != 0 {
		t.Fatalf("lock not back to zero: state %d, writers %d, waiting readers %d", l.state.Load(), l.writers.Load(), l.waitingReaders.Load())
	}
}

// waitFor polls cond until it holds; the lock's rules are checked at
// states other goroutines reach, without sleeping for them.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		runtime.Gosched()
	}
}

// A writer waiting for readers to leave keeps new readers out: a stream
// of overlapping lookups cannot hold event application off for ever.
func TestShardLockWaitingWriterKeepsReadersOut(t *testing.T) {
	var l shardLock
	l.RLock()
	acquired := make(chan struct{})
	release := make(chan struct{})
	go func() {
		l.Lock()
		close(acquired)
		<-release
		l.Unlock()
	}()
	waitFor(t, "the writer to wait", func() bool { return l.writers.Load() == 1 })
	if l.tryRLock() {
		t.Fatal("a new reader entered while a writer waited")
	}
	l.RUnlock()
	<-acquired
	close(release)
	waitFor(t, "the writer to leave", func() bool { return l.writers.Load() == 0 })
	l.RLock()
	//lint:ignore SA2001 taking and releasing the lock is what is tested
	l.RUnlock()
}

// Readers that waited for a writer go before the next writer: a writer
// releasing and retaking the lock between chunks cannot starve lookups.
func TestShardLockWaitingReadersGoFirst(t *testing.T) {
	var (
		l        shardLock
		readerIn atomic.Bool
		order    = make(chan string, 2)
	)
	l.Lock()
	go func() {
		l.RLock()
		readerIn.Store(true)
		order <- "reader"
		l.RUnlock()
	}()
	waitFor(t, "the reader to wait", func() bool { return l.waitingReaders.Load() == 1 })
	go func() {
		l.Lock()
		if !readerIn.Load() {
			order <- "writer before the waiting reader"
		} else {
			order <- "writer"
		}
		l.Unlock()
	}()
	l.Unlock()
	if first, second := <-order, <-order; first != "reader" || second != "writer" {
		t.Fatalf("order %q, %q; want the waiting reader, then the writer", first, second)
	}
}

// Readers share the lock: two readers hold it together.
func TestShardLockReadersShare(t *testing.T) {
	var l shardLock
	l.RLock()
	done := make(chan struct{})
	go func() {
		l.RLock()
		//lint:ignore SA2001 taking and releasing the lock is what is tested
		l.RUnlock()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("a second reader waited for the first")
	}
	l.RUnlock()
}

// Under load from the other side, both sides still get through: writers
// releasing and retaking the lock in a loop, as Apply does between chunks,
// and readers overlapping one another.
//
// What is checked is progress, not a rate. A starved side gets nowhere: a
// lock without the writers' preference leaves the writer at 0 in 20 s.
// A fair lock's turn can still cost one of the scheduler's 10 ms time
// slices: the busy goroutines never yield, so the timers that wake the
// ones backing off fire only when the scheduler preempts one (at a load
// of 30, 1000 turns took from 0.5 ms to 17 s).
func TestShardLockProgressUnderLoad(t *testing.T) {
	for _, tc := range []struct {
		name          string
		busy, waiting func(l *shardLock)
	}{
		//lint:ignore SA2001 taking and releasing the lock is what is tested
		{"reader behind writers' chunks", func(l *shardLock) { l.Lock(); spinWork(); l.Unlock() }, func(l *shardLock) { l.RLock(); l.RUnlock() }},
		//lint:ignore SA2001 taking and releasing the lock is what is tested
		{"writer behind overlapping readers", func(l *shardLock) { l.RLock(); spinWork(); l.RUnlock() }, func(l *shardLock) { l.Lock(); l.Unlock() }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var (
				l    shardLock
				stop atomic.Bool
				wg   sync.WaitGroup
			)
			var busyTurns atomic.Int64
			for range 4 {
				wg.Go(func() {
					for !stop.Load() {
						tc.busy(&l)
						busyTurns.Add(1)
					}
				})
			}
			// The waiter starts once the others contend, or it could
			// finish before they run.
			for deadline := time.Now().Add(10 * time.Second); busyTurns.Load() < 1000; {
				if time.Now().After(deadline) {
					stop.Store(true)
					wg.Wait()
					t.Fatalf("the busy goroutines made %d turns in 10 s", busyTurns.Load())
				}
				time.Sleep(time.Millisecond) // polling, bounded by the deadline
			}
			done := make(chan struct{})
			var turns atomic.Int32
			go func() {
				for range 100 {
					tc.waiting(&l)
					turns.Add(1)
				}
				close(done)
			}()
			select {
			case <-done:
			case <-time.After(60 * time.Second):
				// A rate bound on a machine of unknown load: a starved
				// waiter makes no progress at all, a loaded machine
				// made 92 turns in 20 s.
				t.Errorf("starved: %d of 100 acquisitions in 60 s", turns.Load())
			}
			stop.Store(true)
			wg.Wait()
		})
	}
}

var workSink atomic.Int64

// spinWork holds the lock for about a chunk's worth of work.
func spinWork() {
	w := 0
	for i := range 1000 {
		w += i
	}
	workSink.Store(int64(w))
}

func BenchmarkShardLock(b *testing.B) {
	b.Run("uncontended write", func(b *testing.B) {
		var l shardLock
		for b.Loop() {
			l.Lock()
			//lint:ignore SA2001 taking and releasing the lock is what is tested
			l.Unlock()
		}
	})
	b.Run("uncontended read", func(b *testing.B) {
		var l shardLock
		for b.Loop() {
			l.RLock()
			//lint:ignore SA2001 taking and releasing the lock is what is tested
			l.RUnlock()
		}
	})
	// Writers holding for about a chunk's work while readers come and go:
	// the pattern of two goroutines applying events and looking up.
	for _, name := range []string{"shardLock", "sync.RWMutex"} {
		b.Run("contended/"+name, func(b *testing.B) {
			var sl shardLock
			var rw sync.RWMutex
			lock, unlock, rlock, runlock := sl.Lock, sl.Unlock, sl.RLock, sl.RUnlock
			if name == "sync.RWMutex" {
				lock, unlock, rlock, runlock = rw.Lock, rw.Unlock, rw.RLock, rw.RUnlock
			}
			var n atomic.Int64
			b.RunParallel(func(pb *testing.PB) {
				work := 0
				for pb.Next() {
					if n.Add(1)%2 == 0 {
						lock()
						for i := range 2000 {
							work += i
						}
						unlock()
					} else {
						rlock()
						for i := range 500 {
							work += i
						}
						runlock()
					}
				}
				_ = work
			})
		})
	}
}

// An event source applies events back to back while they keep coming,
// and the Go scheduler preempts a goroutine that ran 10 ms without
// yielding wherever it stands, mostly inside a shard. With one processor
// a lookup can find a shard taken only when its writer lost the processor
// while holding it, so lookups of a writer that yields outside its holds
// never wait.
func TestWriterIsNotPreemptedInsideAShard(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	ix := New(Config{Shards: 1})
	w := kv.Worker{ID: 1}
	rng := rand.New(rand.NewPCG(3, 4))
	// Events of a few chunks: a preemption that is the machine's, not the
	// writer's, lands inside a hold about as often as an event's holds are
	// long, and 512-block events let it catch a quarter of the lookups at
	// a load of 30 (a writer that does not yield: nine tenths either way).
	local := make([]uint64, 4*applyChunk)
	blocks := make([]kv.Block, len(local))
	engine := make([]uint64, len(local))
	for i := range blocks {
		local[i], engine[i] = rng.Uint64(), uint64(i+1)
		blocks[i] = kv.Block{EngineHash: engine[i], LocalHash: local[i]}
	}
	stored, removed := kv.StoredEvent(w, 0, nil, blocks...), kv.RemovedEvent(w, 0, engine...)
	seq := blockhash.SequenceHashes(local)
	var stop atomic.Bool
	done := make(chan error, 1)
	go func() {
		for !stop.Load() {
			if err := ix.Apply(&stored); err != nil {
				done <- err
				return
			}
			_ = ix.Apply(&removed)
		}
		done <- nil
	}()
	var m Matcher
	lookups := 0
	// A count of lookups, not a time: a loaded machine runs this process
	// seldom, and the test is about where the writer stops, not how fast.
	for deadline := time.Now().Add(20 * time.Second); lookups < 200 && time.Now().Before(deadline); lookups++ {
		ix.FindMatches(&m, seq)
		runtime.Gosched() // as a request handler does, waiting for its client
	}
	stop.Store(true)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	// A writer that does not yield is preempted inside nearly every time
	// (185 to 192 of 200 lookups waited). One that yields can still be
	// caught inside by a garbage collection's stop, or by a preemption
	// when the machine is loaded: the scheduler counts its 10 ms in wall
	// time, and a thread the kernel sets aside for that long is preempted
	// wherever it stands (0 to 6 of 200 at a load of 17 to 27).
	if waits := ix.Stats().LookupWaits; waits > uint64(lookups)/4 || lookups < 100 {
		t.Fatalf("%d of %d lookups waited for the writer", waits, lookups)
	}
}

// A writer lets a waiting lookup in at the next block, not at the end of
// its chunk: the wait a lookup pays for a writer that holds its core is
// one block's, whatever the event's length. Stored and removed chains
// alike stop after one block while a lookup waits.
func TestWriterStopsMidChunkForWaitingLookups(t *testing.T) {
	ix := New(Config{Shards: 1})
	w := kv.Worker{ID: 1}
	blocks := make([]kv.Block, 4*applyChunk)
	ids := make([]uint64, len(blocks))
	for i := range blocks {
		ids[i] = uint64(i + 1)
		blocks[i] = kv.Block{EngineHash: ids[i], LocalHash: uint64(1000 + i)}
	}
	sh := &ix.shards[0]
	for _, ev := range []kv.Event{kv.StoredEvent(w, 0, nil, blocks...), kv.RemovedEvent(w, 0, ids...)} {
		held := func() int {
			if s, ok := sh.t.slotOf[w]; ok {
				return sh.t.workers[s].blocks.Len()
			}
			return 0
		}
		before := held()
		// The lookup waits before the writer starts: the writer takes the
		// lock once, and stops at its first block boundary.
		sh.mu.Lock()
		sh.mu.waitingReaders.Add(1)
		done := make(chan error, 1)
		go func() {
			defer sh.mu.Unlock()
			if ev.Kind == kv.KindStored {
				done <- storeChunked(sh, sh.t, &ev)
				return
			}
			removeChunked(sh, sh.t, &ev)
			done <- nil
		}()
		waitFor(t, "the writer to let the lookup in", sh.mu.tryRLock)
		if got := held(); got != before+1 && got != before-1 {
			t.Errorf("%v event: the lookup got in with %d blocks held, %d before the event; want one block applied", ev.Kind, got, before)
		}
		sh.mu.RUnlock()
		sh.mu.waitingReaders.Add(-1)
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		if got, want := held(), map[bool]int{true: len(blocks), false: 0}[ev.Kind == kv.KindStored]; got != want {
			t.Fatalf("%v event: %d blocks held after it, want %d", ev.Kind, got, want)
		}
	}
}
