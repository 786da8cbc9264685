package main

import (
	"fmt"
	"time"

	"github.com/spf13/pflag"

	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/core/sched"
	"github.com/kvrouter/kvrouter/internal/serve"
)

// limitFlags are the bounds on what clients can make the frontend hold:
// body size, connections and their time, sessions, busy-threshold models.
// --http-body-limit-mb is Dynamo's DYN_HTTP_BODY_LIMIT_MB.
type limitFlags struct {
	http               serve.HTTPLimits
	bodyLimitMB        int
	inflightBodyMB     int
	maxSessions        int
	maxSessionTimeout  float64
	sessionAffinity    string
	minInitialWorkers  int
	maxThresholdModels int
}

func (f *limitFlags) register(fs *pflag.FlagSet) {
	fs.IntVar(&f.bodyLimitMB, "http-body-limit-mb", 16, "largest request body in MiB; 413 beyond")
	fs.IntVar(&f.inflightBodyMB, "http-max-inflight-body-mb", serve.DefaultMaxInflightBodyBytes>>20, "request bodies held at once, in MiB; more are answered 503 with Retry-After; 0 = no limit")
	fs.DurationVar(&f.http.ReadTimeout, "http-read-timeout", serve.DefaultReadTimeout, "time to read a whole request, body included; 0 = none")
	fs.DurationVar(&f.http.IdleTimeout, "http-idle-timeout", serve.DefaultIdleTimeout, "keep-alive connections idle this long are closed; 0 = none")
	fs.DurationVar(&f.http.WriteTimeout, "http-write-timeout", serve.DefaultWriteTimeout, "time to write a non-streamed response, from its first byte (streams are not bounded); 0 = none")
	fs.IntVar(&f.http.MaxConcurrentRequests, "http-max-concurrent-requests", serve.DefaultMaxConcurrentRequests, "requests served at once, probes, /metrics and /ui aside; more are answered 503 with Retry-After; 0 = no limit")
	fs.IntVar(&f.http.MaxConnections, "http-max-connections", serve.DefaultMaxConnections, "client connections open at once; more are answered 503 with Retry-After; 0 = no limit")
	fs.IntVar(&f.maxSessions, "router-max-sessions", sched.DefaultMaxSessions, "live session pins (nvext.session_control) at once; a new session beyond is answered 429")
	fs.Float64Var(&f.maxSessionTimeout, "router-max-session-timeout-secs", sched.DefaultMaxSessionTimeout.Seconds(), "longest session_control.timeout a request may ask for")
	fs.StringVar(&f.sessionAffinity, "router-session-affinity-mode", string(sched.AffinityHard), "how firmly a session keeps its engine: hard (while the engine serves), soft (it moves when its engine is busy or carries over twice the least loaded engine's load plus the request's prompt)")
	fs.IntVar(&f.minInitialWorkers, "router-min-initial-workers", 0, "hold routing (503 with Retry-After, /ready 503) until this many engines have been in routing at once; 0 = route from the first")
	fs.IntVar(&f.maxThresholdModels, "busy-threshold-max-models", sched.DefaultMaxThresholdModels, "models POST /busy_threshold can hold thresholds for")
}

// check reports a bound out of range.
func (f *limitFlags) check() error {
	if f.minInitialWorkers < 0 {
		return fmt.Errorf("--router-min-initial-workers must be at least 0, got %d", f.minInitialWorkers)
	}
	return nil
}

// applyRouter sets the router's session and threshold bounds.
func (f *limitFlags) applyRouter(cfg *router.Config) {
	cfg.Sessions = sched.SessionLimits{MaxSessions: f.maxSessions, MaxTimeout: time.Duration(f.maxSessionTimeout * float64(time.Second))}
	cfg.SessionAffinity = sched.SessionAffinity(f.sessionAffinity)
	cfg.MaxThresholdModels = f.maxThresholdModels
}

// httpLimits are the frontend's HTTP bounds.
func (f *limitFlags) httpLimits() serve.HTTPLimits {
	l := f.http
	l.MaxBodyBytes = int64(f.bodyLimitMB) << 20
	l.MaxInflightBodyBytes = int64(f.inflightBodyMB) << 20
	if l.MaxInflightBodyBytes == 0 {
		l.MaxInflightBodyBytes = -1
	}
	// On the command line 0 switches a bound off; in serve.HTTPLimits it
	// takes the default, and a negative value switches it off.
	for _, d := range []*time.Duration{&l.ReadTimeout, &l.IdleTimeout, &l.WriteTimeout} {
		if *d == 0 {
			*d = -1
		}
	}
	for _, n := range []*int{&l.MaxConcurrentRequests, &l.MaxConnections} {
		if *n == 0 {
			*n = -1
		}
	}
	return l
}
