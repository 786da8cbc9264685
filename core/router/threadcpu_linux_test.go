package router

import (
	"syscall"
	"time"
)

// rusageThread is Linux's RUSAGE_THREAD, which package syscall does not name.
const rusageThread = 1

// threadCPU is the calling thread's CPU time so far, user and system; ok
// is false where it cannot be read. The caller locks its goroutine to
// the thread. On a machine shared with other work the wall clock counts
// the time other processes hold the core; the thread's CPU time does not.
func threadCPU() (time.Duration, bool) {
	var ru syscall.Rusage
	if syscall.Getrusage(rusageThread, &ru) != nil {
		return 0, false
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()), true
}
