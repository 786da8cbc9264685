package serve

import (
	"fmt"

	"github.com/kvrouter/kvrouter/core/router"
)

// blockSizeLearned tells the operator, once per engine and block size,
// that an engine's blocks are not the router's: a configuration error
// that would otherwise only show as a low hit rate. The router routes such
// an engine correctly anyway (see router.BlockSizeChange).
func (s *Server) blockSizeLearned(c router.BlockSizeChange) {
	s.mu.Lock()
	name := "worker-" + fmt.Sprint(c.ID)
	if w := s.workers[c.ID]; w != nil {
		name = w.spec.Name
	}
	s.mu.Unlock()
	s.warnBlockSize(c.ID, name, c.BlockSize, "publishes")
}

// warnBlockSize logs an engine's block size when it differs from the
// router's and was not logged before, and when such an engine comes back
// to the router's; how says where the size comes from.
func (s *Server) warnBlockSize(id uint64, name string, size int, how string) {
	routerSize := s.router.BlockSize()
	s.sizesMu.Lock()
	prev, logged := s.sizesWarned[id]
	news := size > 0 && prev != size && (logged || size != routerSize)
	if news {
		s.sizesWarned[id] = size
	}
	s.sizesMu.Unlock()
	switch {
	case !news:
	case size != routerSize:
		s.log.Warn(fmt.Sprintf("engine %s %s %d-token blocks, the router was started with --kv-cache-block-size %d: routing it with %d-token hashes",
			name, how, size, routerSize, size), "worker", name, "id", id, "engine_block_size", size, "router_block_size", routerSize)
	default:
		s.log.Info("engine now uses the router's block size", "worker", name, "id", id, "block_size", size)
	}
}
