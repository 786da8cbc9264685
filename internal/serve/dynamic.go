package serve

import (
	"context"
)

// Discovery is a source of engines that come and go, such as the pods of a
// Kubernetes namespace: each engine it reports joins routing as a
// configured one does (its health probed, its KV events followed), and
// leaves at once when the source says it is gone, as POST /router/drain
// takes one out.
type Discovery interface {
	// Start reports the engines present before returning, and the later
	// ones until Close.
	Start(ctx context.Context, h DiscoveryHandler) error
	Close()
}

// DiscoveryHandler receives a Discovery's engines, one call at a time.
type DiscoveryHandler struct {
	Join  func(WorkerSpec)
	Leave func(id uint64, why string)
}

// dynamicJoin adds an engine reported by Config.Discovery and supervises it
// until it leaves.
func (s *Server) dynamicJoin(ctx context.Context, spec WorkerSpec) {
	if err := spec.validate(); err != nil {
		s.log.Warn("discovered engine skipped", "worker", spec.Name, "err", err)
		return
	}
	s.mu.Lock()
	if old := s.workers[spec.ID]; old != nil && old.stop == nil {
		s.mu.Unlock()
		s.log.Warn("discovered engine has the id of a configured one; skipped", "id", spec.ID, "worker", spec.Name)
		return
	}
	s.mu.Unlock()
	s.dynamicLeave(spec.ID, "replaced")
	wctx, stop := context.WithCancel(ctx)
	w := &supervised{spec: spec, wake: make(chan struct{}, 1), stop: stop}
	s.mu.Lock()
	s.workers[spec.ID] = w
	s.notifyLocked()
	s.mu.Unlock()
	s.toks.engine(spec.Model, spec.Tokenizer)
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		s.supervise(wctx, w)
	}()
}

// dynamicLeave takes an engine reported gone out of routing at once.
func (s *Server) dynamicLeave(id uint64, why string) {
	s.mu.Lock()
	w := s.workers[id]
	if w == nil || w.stop == nil {
		s.mu.Unlock()
		return
	}
	delete(s.workers, id)
	w.gone = true
	s.notifyLocked()
	s.mu.Unlock()
	w.stop()
	s.leave(w, why)
}
