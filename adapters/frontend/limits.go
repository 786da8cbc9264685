package frontend

import (
	"net/http"
	"strconv"
	"time"
)

// limit admits at most Config.MaxConcurrentRequests requests at once and
// answers the others 503 with Retry-After at once, rather than letting
// every request slow down together; /health and /metrics are always
// answered, so that probes see an overloaded router as alive. It also
// bounds how long writing a non-streamed response may take.
func (f *Frontend) limit(next http.Handler) http.Handler {
	maxInflight := int64(f.cfg.MaxConcurrentRequests)
	timeout := f.cfg.WriteTimeout
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if maxInflight > 0 && r.URL.Path != "/health" && r.URL.Path != "/metrics" {
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
		if timeout > 0 {
			w = &deadlineWriter{ResponseWriter: w, rc: http.NewResponseController(w), timeout: timeout}
		}
		next.ServeHTTP(w, r)
	})
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
