package serve

import (
	"cmp"
	"fmt"
	"strings"
	"time"
)

// dependencies reports, for /health, the NATS plane and the ranks whose
// index is being rebuilt from traffic (see router.Router.Recovering).
func (s *Server) dependencies() map[string]string {
	deps := s.planeHealth()
	if s.remote != nil {
		if deps == nil {
			deps = map[string]string{}
		}
		deps["remote_indexer"] = cmp.Or(s.remote.Health(), "ok")
	}
	if rec := s.router.Recovering(); len(rec) > 0 {
		if deps == nil {
			deps = map[string]string{}
		}
		now := time.Now()
		var b strings.Builder
		b.WriteString("recovering: kv events lost, index rebuilt from traffic for")
		for _, r := range rec {
			fmt.Fprintf(&b, " worker %d rank %d (for %s: %d events re-anchored, %d refused, %d blocks inferred);",
				r.Worker.ID, r.Worker.DPRank, now.Sub(r.Since).Round(time.Second), r.Reanchored, r.Refused, r.Inferred)
		}
		deps["kv_index"] = strings.TrimSuffix(b.String(), ";")
	}
	return deps
}
