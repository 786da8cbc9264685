// Package outlier decides which engines to take out of routing for failing
// requests while their health probe still answers: outlier detection as
// Envoy does it (consecutive failures, an ejection time that grows with
// each ejection, a cap on the share of a pool ejected at once).
//
// An engine is ejected after Consecutive failures in a row (an error
// status, a reset, a timeout, a malformed stream); any success resets the
// count. An ejection lasts BaseEjection times the engine's ejection count,
// at most MaxEjection. When it ends the engine is back on probation: its
// first failure ejects it again at once, its first success ends the
// probation. The ejection count falls by one for every BaseEjection the
// engine goes without a failure, so an engine that failed once a day is
// not punished as one that keeps failing.
//
// No more than MaxEjectionPercent of a pool (the engines that could take
// the ejected engine's requests) are ejected at once: a fleet that fails
// everywhere is a fleet problem, and routing to it beats routing nowhere.
//
// The package does no I/O; time comes from its callers.
package outlier

import (
	"cmp"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"
)

// Defaults of Config. Five failures in a row, as Envoy's consecutive_5xx,
// tell a broken engine from an unlucky one; 30 s and 300 s are Envoy's
// base_ejection_time and max_ejection_time. Envoy caps ejections at 10 %
// of a cluster, which in a fleet of fewer than ten engines would let none
// (Envoy then ejects one anyway); half a pool keeps the other half serving
// while letting one of two engines go.
const (
	DefaultConsecutive        = 5
	DefaultBaseEjection       = 30 * time.Second
	DefaultMaxEjection        = 300 * time.Second
	DefaultMaxEjectionPercent = 50
)

// Config tunes a Detector. Zero fields take the defaults; Consecutive < 0
// switches ejection off (failures are still counted).
type Config struct {
	Consecutive        int
	BaseEjection       time.Duration
	MaxEjection        time.Duration
	MaxEjectionPercent int
}

// WithDefaults fills the zero fields.
func (c Config) WithDefaults() Config {
	if c.Consecutive == 0 {
		c.Consecutive = DefaultConsecutive
	}
	if c.BaseEjection <= 0 {
		c.BaseEjection = DefaultBaseEjection
	}
	if c.MaxEjection <= 0 {
		c.MaxEjection = DefaultMaxEjection
	}
	c.MaxEjection = max(c.MaxEjection, c.BaseEjection)
	if c.MaxEjectionPercent == 0 {
		c.MaxEjectionPercent = DefaultMaxEjectionPercent
	}
	return c
}

// Validate rejects settings that cannot be meant.
func (c Config) Validate() error {
	switch {
	case c.BaseEjection < 0:
		return fmt.Errorf("the base ejection time must be positive, got %s", c.BaseEjection)
	case c.MaxEjection < 0:
		return fmt.Errorf("the maximum ejection time must be positive, got %s", c.MaxEjection)
	case c.MaxEjectionPercent < 0 || c.MaxEjectionPercent > 100:
		return fmt.Errorf("the maximum ejection percent must be within 0..100, got %d", c.MaxEjectionPercent)
	}
	return nil
}

// Ejection is one engine out of routing.
type Ejection struct {
	Worker uint64
	Reason string // the failure that ejected it
	Since  time.Time
	Until  time.Time
	Count  int // its ejections so far, this one included
}

// Detector tracks every engine's failures. It is safe for concurrent use.
type Detector struct {
	cfg   Config
	mu    sync.Mutex
	hosts map[uint64]*host
	// out counts the engines ejected at the last look; Ejected skips the
	// lock while it is 0, as it is nearly always.
	out atomic.Int64
}

type host struct {
	failures  int // in a row
	ejections int // the backoff multiplier
	probation bool
	ejected   bool
	// calm is when the multiplier last fell, or the engine last failed.
	calm time.Time
	last Ejection
}

// New returns a Detector with cfg, defaults filled in.
func New(cfg Config) *Detector {
	return &Detector{cfg: cfg.WithDefaults(), hosts: map[uint64]*host{}}
}

// Config is the configuration in force.
func (d *Detector) Config() Config { return d.cfg }

// Failure records that id failed a request at now, for reason. pool lists
// the engines (id among them) that could take id's requests, for the cap
// on ejections. It returns the ejection it made, if any.
func (d *Detector) Failure(id uint64, reason string, pool []uint64, now time.Time) (Ejection, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.expire(now)
	h := d.hosts[id]
	if h == nil {
		h = &host{}
		d.hosts[id] = h
	}
	h.calm = now
	if h.ejected { // a request that left before the ejection
		return Ejection{}, false
	}
	h.failures++
	if d.cfg.Consecutive < 0 || (!h.probation && h.failures < d.cfg.Consecutive) {
		return Ejection{}, false
	}
	if !d.roomIn(pool) {
		return Ejection{}, false
	}
	h.ejections++
	h.ejected, h.probation, h.failures = true, false, 0
	span := min(time.Duration(h.ejections)*d.cfg.BaseEjection, d.cfg.MaxEjection)
	h.last = Ejection{Worker: id, Reason: reason, Since: now, Until: now.Add(span), Count: h.ejections}
	d.out.Add(1)
	return h.last, true
}

// roomIn reports whether one more engine of pool may be ejected.
func (d *Detector) roomIn(pool []uint64) bool {
	out := 0
	for _, id := range pool {
		if h := d.hosts[id]; h != nil && h.ejected {
			out++
		}
	}
	return (out+1)*100 <= d.cfg.MaxEjectionPercent*len(pool)
}

// Success records that id served a request at now.
func (d *Detector) Success(id uint64, now time.Time) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.expire(now)
	h := d.hosts[id]
	if h == nil || h.ejected {
		return
	}
	h.failures, h.probation = 0, false
	if h.ejections == 0 {
		delete(d.hosts, id)
		return
	}
	if n := int(now.Sub(h.calm) / d.cfg.BaseEjection); n > 0 {
		h.ejections = max(0, h.ejections-n)
		h.calm = h.calm.Add(time.Duration(n) * d.cfg.BaseEjection)
	}
}

// expire returns the engines whose ejection has ended to routing, on
// probation. Callers hold d.mu.
func (d *Detector) expire(now time.Time) {
	if d.out.Load() == 0 {
		return
	}
	for _, h := range d.hosts {
		if h.ejected && !now.Before(h.last.Until) {
			h.ejected, h.probation = false, true
			h.calm = now
			d.out.Add(-1)
		}
	}
}

// Ejected appends to dst the engines out of routing at now.
func (d *Detector) Ejected(now time.Time, dst []uint64) []uint64 {
	if d.out.Load() == 0 {
		return dst
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	d.expire(now)
	for id, h := range d.hosts {
		if h.ejected {
			dst = append(dst, id)
		}
	}
	return dst
}

// Ejections lists the engines out of routing at now, by id.
func (d *Detector) Ejections(now time.Time) []Ejection {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.expire(now)
	var out []Ejection
	for _, h := range d.hosts {
		if h.ejected {
			out = append(out, h.last)
		}
	}
	slices.SortFunc(out, func(a, b Ejection) int { return cmp.Compare(a.Worker, b.Worker) })
	return out
}
