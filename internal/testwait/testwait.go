// Package testwait lets tests of asynchronous parts (NATS, sockets, engines)
// wait for a state instead of for a fixed time.
package testwait

import (
	"testing"
	"time"
)

// Until polls cond every few milliseconds until it holds, and fails the
// test, naming what, if it does not within the given time.
func Until(t testing.TB, within time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("not within %v: %s", within, what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
