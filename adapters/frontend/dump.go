package frontend

import (
	"net/http"
	"strconv"
	"time"

	"github.com/kvrouter/kvrouter/core/index"
	"github.com/kvrouter/kvrouter/core/kv"
)

// dumpEvents streams the index as a JSON list of KV events, a bounded
// batch at a time (index.DumpBatch events, encoded, written and flushed),
// so that its memory follows the largest engine, not the index. Serving
// one costs the router a pass over the whole index: one is served at a
// time, a second caller gets 429 with Retry-After. Each batch written
// renews the write deadline, so that a large dump read at a steady pace
// finishes while a stalled reader lets go within the write timeout.
func (f *Frontend) dumpEvents(w http.ResponseWriter, r *http.Request) {
	if !f.dumping.CompareAndSwap(false, true) {
		f.m.dumpsRefused.Inc()
		w.Header().Set("Retry-After", strconv.Itoa(retryAfterSeconds))
		writeError(w, http.StatusTooManyRequests, "rate_limit_error", "dump_in_progress", "",
			"the index is being dumped to another client; one dump is served at a time, retry after %d s", retryAfterSeconds)
		return
	}
	defer f.dumping.Store(false)
	w.Header().Set("Content-Type", "application/json")
	rc := http.NewResponseController(w)
	buf := make([]byte, 0, 128<<10)
	buf = append(buf, '[')
	first := true
	err := f.cfg.Router.DumpEventsTo(&index.Dumper{}, func(evs []kv.Event) error {
		if err := r.Context().Err(); err != nil {
			return err
		}
		for i := range evs {
			if !first {
				buf = append(buf, ',')
			}
			first = false
			buf, _ = evs[i].AppendJSON(buf)
		}
		if f.cfg.WriteTimeout > 0 {
			_ = rc.SetWriteDeadline(time.Now().Add(f.cfg.WriteTimeout))
		}
		if _, err := w.Write(buf); err != nil {
			return err
		}
		buf = buf[:0]
		return rc.Flush()
	})
	if err != nil {
		// The answer has begun: ending it here leaves the client a list
		// that does not close, which no JSON decoder takes for a dump.
		f.log.Debug("dump_events cut short", "err", err)
		return
	}
	_, _ = w.Write(append(buf, "]\n"...))
}
