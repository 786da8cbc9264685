package serve

import (
	"context"
	"slices"
	"time"
)

// DefaultShutdownTimeout is --shutdown-timeout's default.
const DefaultShutdownTimeout = 30 * time.Second

// abortGrace is how long requests cut at the end of a drain get to write
// their last event.
const abortGrace = 5 * time.Second

// Shutdown stops gracefully. /ready turns 503 at once and no new
// connection is accepted; requests in flight, streams included, run to
// their end for up to timeout; those still running then are ended,
// streams with an error event and "data: [DONE]"; then everything stops.
// The engines stay in routing until the end, so that requests still
// queued in the router find them.
func (s *Server) Shutdown(timeout time.Duration) error {
	s.fe.Drain()
	s.log.Info("draining", "timeout", timeout)
	eppDrained := make(chan struct{})
	go func() {
		defer close(eppDrained)
		s.drainEPP(timeout)
	}()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	err := s.http.Shutdown(ctx)
	cancel()
	<-eppDrained
	if err != nil {
		s.log.Warn("requests still in flight after the shutdown timeout; ending them", "timeout", timeout)
		s.fe.Abort()
		ctx, cancel := context.WithTimeout(context.Background(), abortGrace)
		_ = s.http.Shutdown(ctx)
		cancel()
	}
	return s.Close()
}

// models are the models of every engine meant to serve, in routing or
// not: /ready wants an engine in routing for each.
func (s *Server) models() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]string, 0, len(s.workers))
	for _, w := range s.workers {
		out = append(out, w.spec.Model)
	}
	slices.Sort(out)
	return slices.Compact(out)
}
