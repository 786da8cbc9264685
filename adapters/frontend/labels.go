package frontend

import (
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
)

// Metric labels. Every distinct label value is a series the registry keeps
// for the life of the process, and a client names any model it likes: a
// fleet serving every model (workers without a model) took a request each
// for 50,000 made-up names to 1.15 M series, 87 MB of /metrics and 437 MB
// of heap. The model label therefore takes only the models the fleet
// serves: those a worker declares, and, for workers serving every model,
// those an engine has answered with a 2xx, at most maxLearntModels of
// them (an engine that answers any name cannot grow it either). Any other
// model counts under otherModel. The other labels are bounded by
// construction: endpoints, statuses, phases, pools and reasons are the
// frontend's own words; worker ids and ranks come from the registered
// fleet (events of unknown workers or ranks are refused before they
// count).
const (
	otherModel      = "other"
	maxLearntModels = 64
)

type modelLabels struct {
	mu     sync.RWMutex
	learnt map[string]bool
}

func (l *modelLabels) has(model string) bool {
	l.mu.RLock()
	defer l.mu.RUnlock()
	return l.learnt[model]
}

// learn records that an engine served model.
func (l *modelLabels) learn(model string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.learnt == nil {
		l.learnt = make(map[string]bool)
	}
	if len(l.learnt) < maxLearntModels {
		l.learnt[model] = true
	}
}

// modelLabel is the value the model label takes for model.
func (f *Frontend) modelLabel(model string) string {
	if model == "" {
		return otherModel
	}
	for _, w := range f.cfg.Workers() {
		if w.Model == model {
			return model
		}
	}
	if f.labels.has(model) {
		return model
	}
	return otherModel
}

// MaxConcurrentScrapes is how many /metrics answers are built at once. A
// scrape renders every series, which costs memory and CPU in proportion;
// Prometheus scrapes one at a time, so more at once is a client's doing,
// answered 429 with Retry-After.
const MaxConcurrentScrapes = 2

func (f *Frontend) limitScrapes(h http.Handler) http.HandlerFunc {
	var inflight atomic.Int32
	return func(w http.ResponseWriter, r *http.Request) {
		if inflight.Add(1) > MaxConcurrentScrapes {
			inflight.Add(-1)
			f.m.refusedReads.WithLabelValues("metrics").Inc()
			w.Header().Set("Retry-After", strconv.Itoa(retryAfterSeconds))
			writeError(w, http.StatusTooManyRequests, "rate_limit_error", "too_many_scrapes", "",
				"%d scrapes of /metrics are being served; retry after %d s", MaxConcurrentScrapes, retryAfterSeconds)
			return
		}
		defer inflight.Add(-1)
		h.ServeHTTP(w, r)
	}
}
