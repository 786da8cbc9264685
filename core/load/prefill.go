package load

import (
	"cmp"
	"math"
	"slices"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/core/kv"
)

// PrefillModel learns each worker's prefill time from what the router
// sees of its requests (--router-prefill-load-model learned): when a
// request was sent, its uncached and cached prompt tokens, the prompt
// tokens already waiting there and the requests running there, and when
// its first token came. It fits, per worker, by exponentially weighted
// least squares,
//
//	ttft = a + b × (uncached + waiting) + c × cached + d × running
//
// so b is the worker's seconds per prefilled token, and it predicts a
// request's own prefill, a + b × uncached + c × cached + d × running. A
// worker's prompt backlog is then time, not tokens: b × uncached of each
// of its requests awaiting their first token, the oldest one's decaying as
// time passes since it became the oldest, as Dynamo's AIC model decays it.
// The backlog leaves out each pending request's a and d × running:
// prompts queued together share their steps, whose fixed cost and decode
// are paid once a step, not once a request (counting them per request
// cost 5 % of p90 TTFT on a fleet of half-speed engines, see
// docs/benchmarks.md).
// Times are the caller's (an injected clock); it is safe for concurrent
// use.
type PrefillModel struct {
	mu      sync.Mutex
	workers map[kv.Worker]*prefillWorker
	// seen are the workers in the order first seen: fallback sums their
	// fits in it, where a map's order, new at every range, changed the
	// sum's last bits and so a decision from one run to the next.
	seen []*prefillWorker
	reqs map[string]*prefillReq
}

// prefillFeatures is the number of terms of the fit.
const prefillFeatures = 4

// Fit constants. Tokens enter in thousands so the normal equations stay
// well scaled; forget weighs the sample n back by forget^n (a window of
// about 200 first tokens), so a worker whose speed changes is refitted
// within a few hundred requests; ridge keeps a term the samples never
// vary (no cached prompts yet) from making the system singular, and pulls
// it towards 0.
const (
	tokenUnit       = 1000.0
	forget          = 0.995
	ridge           = 1e-6
	minFitSamples   = 8
	maxPendingPerWk = 1 << 16
	pendingTTL      = 300 * time.Second // the load tracker's default request TTL
)

type prefillWorker struct {
	xtx     [prefillFeatures][prefillFeatures]float64
	xty     [prefillFeatures]float64
	coef    [prefillFeatures]float64
	samples int
	// active are the worker's requests awaiting their first token, oldest
	// first; anchor is when the oldest one's prediction began to decay.
	active []*prefillReq
	anchor time.Time
}

type prefillReq struct {
	id    string
	w     kv.Worker
	start time.Time
	x     [prefillFeatures]float64
	// predicted is b × its uncached tokens, in seconds, as fitted at start:
	// its share of the worker's backlog.
	predicted float64
}

// NewPrefillModel returns an empty model: every worker unfitted.
func NewPrefillModel() *PrefillModel {
	return &PrefillModel{workers: map[kv.Worker]*prefillWorker{}, reqs: map[string]*prefillReq{}}
}

// PrefillSample is what the router knows of a request when it sends it.
type PrefillSample struct {
	Uncached, Cached int // prompt tokens to compute, and found cached
	Waiting          int // prompt tokens already awaiting prefill on the worker
	Running          int // requests running on the worker
}

func (s PrefillSample) features() [prefillFeatures]float64 {
	return [prefillFeatures]float64{1, float64(s.Uncached+s.Waiting) / tokenUnit, float64(s.Cached) / tokenUnit, float64(s.Running)}
}

// Start records that id was sent to w at now. A second Start of an id
// replaces the first.
func (m *PrefillModel) Start(id string, w kv.Worker, now time.Time, s PrefillSample) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.drop(id, now)
	pw := m.worker(w)
	// A request whose end never came (a lost stream the load tracker
	// expired) must not hold the backlog forever.
	for len(pw.active) > 0 && now.Sub(pw.active[0].start) > pendingTTL {
		m.drop(pw.active[0].id, now)
	}
	if len(pw.active) >= maxPendingPerWk {
		return
	}
	q := &prefillReq{id: id, w: w, start: now, x: s.features()}
	if coef := m.fallback(pw); coef != nil {
		q.predicted = max(coef[1]*float64(s.Uncached)/tokenUnit, 0)
	}
	if len(pw.active) == 0 {
		pw.anchor = now
	}
	pw.active = append(pw.active, q)
	m.reqs[id] = q
}

// Done records id's first token at now: a sample of the fit, and its
// prediction leaves the worker's backlog. It reports whether id was known.
func (m *PrefillModel) Done(id string, now time.Time) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	q := m.reqs[id]
	if q == nil {
		return false
	}
	m.drop(id, now)
	if ttft := now.Sub(q.start).Seconds(); ttft >= 0 {
		m.workers[q.w].observe(q.x, ttft)
	}
	return true
}

// Drop forgets id without a sample (it ended without a first token).
func (m *PrefillModel) Drop(id string, now time.Time) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.drop(id, now)
}

// RemoveWorker forgets w's pending requests; its fit is kept, for an engine
// that comes back is the same engine.
func (m *PrefillModel) RemoveWorker(w kv.Worker) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if pw := m.workers[w]; pw != nil {
		for _, q := range pw.active {
			delete(m.reqs, q.id)
		}
		pw.active = nil
	}
}

func (m *PrefillModel) drop(id string, now time.Time) {
	q := m.reqs[id]
	if q == nil {
		return
	}
	delete(m.reqs, id)
	pw := m.workers[q.w]
	for i, a := range pw.active {
		if a != q {
			continue
		}
		if i == 0 {
			// The next oldest starts decaying now, where the
			// oldest's prediction ended or was cut short.
			pw.anchor = now
		}
		pw.active = append(pw.active[:i], pw.active[i+1:]...)
		break
	}
}

func (m *PrefillModel) worker(w kv.Worker) *prefillWorker {
	pw := m.workers[w]
	if pw == nil {
		pw = &prefillWorker{}
		m.workers[w] = pw
		m.seen = append(m.seen, pw)
	}
	return pw
}

// fallback is the fit an unfitted worker borrows: the mean of the fitted
// workers' fits, or nil when none is fitted.
func (m *PrefillModel) fallback(pw *prefillWorker) *[prefillFeatures]float64 {
	if pw.fitted() {
		return &pw.coef
	}
	var mean [prefillFeatures]float64
	n := 0
	for _, o := range m.seen {
		if o.fitted() {
			for i := range mean {
				mean[i] += o.coef[i]
			}
			n++
		}
	}
	if n == 0 {
		return nil
	}
	for i := range mean {
		mean[i] /= float64(n)
	}
	return &mean
}

func (pw *prefillWorker) fitted() bool { return pw.samples >= minFitSamples && pw.coef[1] > 0 }

func (pw *prefillWorker) observe(x [prefillFeatures]float64, y float64) {
	for i := range x {
		for j := range x {
			pw.xtx[i][j] = forget*pw.xtx[i][j] + x[i]*x[j]
		}
		pw.xty[i] = forget*pw.xty[i] + x[i]*y
	}
	pw.samples++
	if coef, ok := solve(pw.xtx, pw.xty); ok {
		pw.coef = coef
	}
}

// solve is the ridge solution of (A + ridge·tr(A)/n·I) c = b by Gaussian
// elimination with partial pivoting; false when it is still singular.
func solve(a [prefillFeatures][prefillFeatures]float64, b [prefillFeatures]float64) ([prefillFeatures]float64, bool) {
	const n = prefillFeatures
	var tr float64
	for i := range n {
		tr += a[i][i]
	}
	for i := range n {
		a[i][i] += ridge * tr / n
	}
	for col := range n {
		p := col
		for r := col + 1; r < n; r++ {
			if math.Abs(a[r][col]) > math.Abs(a[p][col]) {
				p = r
			}
		}
		if math.Abs(a[p][col]) < 1e-300 {
			return [n]float64{}, false
		}
		a[col], a[p] = a[p], a[col]
		b[col], b[p] = b[p], b[col]
		for r := col + 1; r < n; r++ {
			f := a[r][col] / a[col][col]
			for k := col; k < n; k++ {
				a[r][k] -= f * a[col][k]
			}
			b[r] -= f * b[col]
		}
	}
	var c [n]float64
	for i := n - 1; i >= 0; i-- {
		s := b[i]
		for k := i + 1; k < n; k++ {
			s -= a[i][k] * c[k]
		}
		c[i] = s / a[i][i]
	}
	for _, v := range c {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return [n]float64{}, false
		}
	}
	return c, true
}

// PrefillEstimate is one worker's learned prefill, as a decision needs it.
type PrefillEstimate struct {
	// Known is false while neither the worker nor any other is fitted.
	Known bool
	// SecondsPerToken is the fit's b: what one more uncached token costs.
	SecondsPerToken float64
	// Fixed is the request's prefill time before its uncached tokens:
	// a + c × cached + d × running, in seconds.
	Fixed float64
	// Backlog is the predicted prefill still ahead of a request sent now,
	// in seconds, the oldest pending prediction decayed.
	Backlog float64
	// Fitted is true when the worker's own samples fitted it (false: it
	// borrows the fleet's mean fit).
	Fitted  bool
	Samples int
}

// Estimate is w's learned prefill at now for a request with cached tokens
// found there while running requests run.
func (m *PrefillModel) Estimate(w kv.Worker, now time.Time, cached, running int) PrefillEstimate {
	m.mu.Lock()
	defer m.mu.Unlock()
	pw := m.workers[w]
	if pw == nil {
		pw = &prefillWorker{}
	}
	coef := m.fallback(pw)
	if coef == nil {
		return PrefillEstimate{}
	}
	e := PrefillEstimate{
		Known: true, SecondsPerToken: coef[1] / tokenUnit, Fitted: pw.fitted(), Samples: pw.samples,
		Fixed: max(coef[0]+coef[2]*float64(cached)/tokenUnit+coef[3]*float64(running), 0),
	}
	for i, q := range pw.active {
		if i == 0 {
			e.Backlog += max(q.predicted-now.Sub(pw.anchor).Seconds(), 0)
		} else {
			e.Backlog += q.predicted
		}
	}
	return e
}

// WorkerFit is one worker's fit, for /health and the dashboard.
type WorkerFit struct {
	Worker kv.Worker
	// TokensPerSecond is the learned prefill rate, 1/b; 0 while unfitted.
	TokensPerSecond float64
	// FixedSeconds is the fit's a: a prefill's time before any token.
	FixedSeconds float64
	Samples      int
	Pending      int // requests awaiting their first token
}

// Fits lists every worker the model has seen.
func (m *PrefillModel) Fits() []WorkerFit {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]WorkerFit, 0, len(m.workers))
	for w, pw := range m.workers {
		f := WorkerFit{Worker: w, Samples: pw.samples, Pending: len(pw.active)}
		if pw.fitted() {
			f.TokensPerSecond, f.FixedSeconds = tokenUnit/pw.coef[1], pw.coef[0]
		}
		out = append(out, f)
	}
	slices.SortFunc(out, func(a, b WorkerFit) int {
		return cmp.Or(cmp.Compare(a.Worker.ID, b.Worker.ID), cmp.Compare(a.Worker.DPRank, b.Worker.DPRank))
	})
	return out
}
