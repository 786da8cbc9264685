package frontend

import (
	"net/http"
	"strconv"
	"sync"
	"time"
)

// limit admits at most Config.MaxConcurrentRequests requests at once, and
// request bodies up to Config.MaxInflightBodyBytes in all, and answers the
// others 503 with Retry-After at once, rather than letting
// every request slow down together; the probes, /metrics and the
// dashboard are always answered, so that an overloaded router is seen
// alive, and seen. It also
// bounds how long writing a non-streamed response may take.
func (f *Frontend) limit(next http.Handler) http.Handler {
	maxInflight := int64(f.cfg.MaxConcurrentRequests)
	timeout := f.cfg.WriteTimeout
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if maxInflight > 0 && !probePath(r.URL.Path) {
			if n := f.inflight.Add(1); n > maxInflight {
				f.inflight.Add(-1)
				f.m.rejected.Inc()
				w.Header().Set("Retry-After", strconv.Itoa(retryAfterSeconds))
				writeError(w, http.StatusServiceUnavailable, "server_error", "overloaded", "",
					"the router is serving its maximum of %d concurrent requests; retry after %d s", maxInflight, retryAfterSeconds)
				return
			}
			defer f.inflight.Add(-1)
		}
		if budget := f.cfg.MaxInflightBodyBytes; budget > 0 && r.ContentLength > 0 {
			// Bodies are the largest buffers clients control; their total
			// is bounded, not only each one's size.
			if n := f.bodyBytes.Add(r.ContentLength); n > budget && n != r.ContentLength {
				f.bodyBytes.Add(-r.ContentLength)
				f.m.rejected.Inc()
				w.Header().Set("Retry-After", strconv.Itoa(retryAfterSeconds))
				writeError(w, http.StatusServiceUnavailable, "server_error", "overloaded", "",
					"the router holds its maximum of %d MiB of request bodies; retry after %d s", budget>>20, retryAfterSeconds)
				return
			}
			defer f.bodyBytes.Add(-r.ContentLength)
		}
		if timeout > 0 {
			w = &deadlineWriter{ResponseWriter: w, rc: http.NewResponseController(w), timeout: timeout}
		}
		if r.ContentLength >= largeBody && f.cfg.AfterBurst != nil {
			f.largeBodies.start(r.ContentLength)
			defer func() {
				if f.largeBodies.end(r.ContentLength) {
					f.cfg.AfterBurst()
				}
			}()
		}
		next.ServeHTTP(w, r)
	})
}

// A burst is large bodies, each of largeBody bytes or more, reaching
// burstBytes in flight at once: the heap grew for them, and the Go runtime
// keeps what it grew to for minutes unless told otherwise.
const (
	largeBody  = 1 << 20
	burstBytes = 64 << 20
)

// bodyBurst follows the large bodies in flight.
type bodyBurst struct {
	mu       sync.Mutex
	inflight int64
	peak     int64 // since the last burst ended
}

func (b *bodyBurst) start(n int64) {
	b.mu.Lock()
	b.inflight += n
	b.peak = max(b.peak, b.inflight)
	b.mu.Unlock()
}

// end reports whether the body of n bytes was the last of a burst.
func (b *bodyBurst) end(n int64) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.inflight -= n
	if b.inflight > 0 || b.peak < burstBytes {
		return false
	}
	b.peak = 0
	return true
}

// retryAfterSeconds is what an overloaded router asks clients to wait: a
// request typically finishes within it.
const retryAfterSeconds = 1

// deadlineWriter starts the write timeout when the response starts, not
// when the request arrived: a non-streamed answer waits for the whole
// generation first, and only the writing to a slow client is bounded. A
// stream lifts the deadline (streamStarted) since it lasts as long as the
// generation does.
type deadlineWriter struct {
	http.ResponseWriter
	rc          *http.ResponseController
	timeout     time.Duration
	wroteHeader bool
}

func (d *deadlineWriter) WriteHeader(status int) {
	if !d.wroteHeader {
		d.wroteHeader = true
		_ = d.rc.SetWriteDeadline(time.Now().Add(d.timeout))
	}
	d.ResponseWriter.WriteHeader(status)
}

func (d *deadlineWriter) Write(b []byte) (int, error) {
	if !d.wroteHeader {
		d.WriteHeader(http.StatusOK)
	}
	return d.ResponseWriter.Write(b)
}

// Unwrap lets http.ResponseController reach the connection's writer.
func (d *deadlineWriter) Unwrap() http.ResponseWriter { return d.ResponseWriter }

// probePath tells the paths that must answer under any load: a probe
// refused for overload would pull a working router out of service, and
// an overloaded router is when an operator most needs its dashboard.
func probePath(path string) bool {
	switch path {
	case "/health", "/live", "/ready", "/metrics", "/ui", "/ui/api/state":
		return true
	}
	return false
}
