// Package server runs simulated engines (package engine) behind the
// interfaces of a vLLM server: the OpenAI HTTP API, Prometheus metrics with
// vLLM's names and KV events on ZMQ. It is the mocker's edge; the
// simulation itself is pure and lives in mocker/engine.
package server

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/mocker/engine"
)

// Clock paces the simulation. The real clock sleeps; a virtual clock jumps,
// so tests run the same schedule faster than real time.
type Clock interface {
	Now() time.Time
	// SleepUntil returns at t, or early with ctx's error.
	SleepUntil(ctx context.Context, t time.Time) error
}

// RealClock is wall time.
type RealClock struct{}

func (RealClock) Now() time.Time { return time.Now() }

func (RealClock) SleepUntil(ctx context.Context, t time.Time) error {
	d := time.Until(t)
	if d <= 0 {
		return ctx.Err()
	}
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-timer.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// VirtualClock advances only when the runner sleeps: every step takes
// exactly its model time and no real time. One per runner.
type VirtualClock struct {
	mu  sync.Mutex
	now time.Time
}

// NewVirtualClock starts at start.
func NewVirtualClock(start time.Time) *VirtualClock { return &VirtualClock{now: start} }

func (c *VirtualClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *VirtualClock) SleepUntil(ctx context.Context, t time.Time) error {
	c.mu.Lock()
	if t.After(c.now) {
		c.now = t
	}
	c.mu.Unlock()
	return ctx.Err()
}

// maxLag is how far behind its schedule a runner may fall (a GC pause, an
// overloaded machine) before it stops catching up and restarts the
// schedule from now: catching up would compress later steps.
const maxLag = 50 * time.Millisecond

// Publisher receives the KV events of each step when the step completes.
type Publisher func(at time.Time, events []engine.BlockEvent)

// Runner drives one engine (one data-parallel rank) in real or virtual
// time and hands each request's outputs to its Stream.
type Runner struct {
	clock     Clock
	speedup   float64
	publish   Publisher
	blockSize int

	// mu guards eng, streams and the holds. The engine is stepped with mu
	// held; the sleep that gives a step its duration happens without it, so
	// requests can be added and aborted meanwhile.
	mu      sync.Mutex
	eng     *engine.Engine
	streams map[string]*Stream
	// holds are the deadlines of the requests whose blocks the engine holds
	// for a decode engine to pull (SubmitOptions.HoldFor); nextExpiry is
	// the earliest, so that checking them before every step is cheap.
	holds        map[string]time.Time
	nextExpiry   time.Time
	holdsExpired uint64

	wake  chan struct{} // new work for an idle engine; capacity 1
	snaps chan snapshot // Snapshot calls waiting for a point between steps

	timing Timing // written by the loop only; read through Timing()
	tmu    sync.Mutex
}

// Timing compares the steps' model durations (divided by the speedup) with
// the wall time they took, the mocker's own overhead included. A step's
// wall time runs from when it could start (its scheduled start, or the end
// of the step before if that was late) to its completion, so a lag is
// counted once, not again in every step that inherits it.
type Timing struct {
	Steps     uint64
	Model     time.Duration // Σ model duration / speedup
	Actual    time.Duration // Σ wall time of the steps
	LagResets uint64        // times the runner fell more than maxLag behind
}

// Drift is (actual − model) / model: 0 means the simulation kept the
// model's pace exactly.
func (t Timing) Drift() float64 {
	if t.Model == 0 {
		return 0
	}
	return float64(t.Actual-t.Model) / float64(t.Model)
}

// NewRunner wraps eng. speedup divides every model duration; publish may
// be nil.
func NewRunner(eng *engine.Engine, clock Clock, speedup float64, publish Publisher) *Runner {
	if speedup <= 0 {
		speedup = 1
	}
	return &Runner{clock: clock, speedup: speedup, publish: publish, blockSize: eng.Config().BlockSize, eng: eng, streams: map[string]*Stream{}, holds: map[string]time.Time{}, wake: make(chan struct{}, 1), snaps: make(chan snapshot)}
}

// Stream is one request's view of its outputs.
type Stream struct {
	mu     sync.Mutex
	outs   []engine.Output
	done   bool
	signal chan struct{} // capacity 1: something new

	Submitted time.Time // runner clock
	FirstAt   time.Time // runner clock, at the first output
	DoneAt    time.Time
	// HeldBlocks names the blocks the engine holds for a decode engine once
	// the request finished (SubmitOptions.HoldFor), in prompt order; nil if
	// it holds none. Read it after the last output.
	HeldBlocks []int

	holdFor time.Duration
}

// Next waits for outputs and returns those not seen yet; finished reports
// that the last one is among them.
func (s *Stream) Next(ctx context.Context) (outs []engine.Output, finished bool, err error) {
	for {
		s.mu.Lock()
		outs, finished = s.outs, s.done
		s.outs = nil
		s.mu.Unlock()
		if len(outs) > 0 || finished {
			return outs, finished, nil
		}
		select {
		case <-s.signal:
		case <-ctx.Done():
			return nil, false, ctx.Err()
		}
	}
}

// ErrStopped is returned for requests submitted to a stopped runner.
var ErrStopped = errors.New("server: engine stopped")

// Submit queues a request; its outputs arrive on the returned Stream.
func (r *Runner) Submit(req engine.Request) (*Stream, error) {
	return r.SubmitWith(req, SubmitOptions{})
}

// SubmitOptions are what a disaggregated request needs beyond Submit.
type SubmitOptions struct {
	// Arrived is when the request reached the engine, if before now: a
	// decode engine's request arrives, waits for its KV transfer, and only
	// then enters the engine, and its latencies count from its arrival, as
	// vLLM's do. Zero means now.
	Arrived time.Time
	// HoldFor makes the engine hold the request's prompt blocks after it
	// finishes (engine.Request.HoldBlocks) for at most this long on the
	// runner's clock, until Pull takes them; 0 holds nothing.
	HoldFor time.Duration
}

// SubmitWith is Submit with options.
func (r *Runner) SubmitWith(req engine.Request, opts SubmitOptions) (*Stream, error) {
	s := &Stream{signal: make(chan struct{}, 1), holdFor: opts.HoldFor}
	req.HoldBlocks = opts.HoldFor > 0
	r.mu.Lock()
	if err := r.eng.Add(req); err != nil {
		r.mu.Unlock()
		return nil, err
	}
	s.Submitted = opts.Arrived
	if s.Submitted.IsZero() {
		s.Submitted = r.clock.Now()
	}
	r.streams[req.ID] = s
	r.mu.Unlock()
	select {
	case r.wake <- struct{}{}:
	default:
	}
	return s, nil
}

// Abort drops a request whose client went away: its blocks are released now.
func (r *Runner) Abort(id string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, ok := r.streams[id]; ok {
		r.eng.Abort(id)
		delete(r.streams, id)
	}
}

// Load is the number of requests the engine holds, for spreading requests
// over ranks.
func (r *Runner) Load() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.streams)
}

// Metrics reads the engine's metrics, once the holds past their deadline
// are released: the runner loop releases them only before a step, and an
// idle engine does not step.
func (r *Runner) Metrics() engine.Metrics {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.expireHolds()
	return r.eng.Metrics()
}

// HoldsExpired counts the holds released because no decode engine pulled
// them in time (vLLM's vllm:nixl_num_kv_expired_reqs).
func (r *Runner) HoldsExpired() uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.expireHolds()
	return r.holdsExpired
}

// ErrNoHold is returned by Pull for a request whose blocks are not held:
// unknown, already pulled, or expired.
var ErrNoHold = errors.New("server: no KV blocks held for this request")

// Pull hands a held request's blocks over to a decode engine and ends the
// hold: the blocks join the prefix cache. blockIDs, the blocks the decode
// engine lacks, must be among the held ones; it may be empty when the decode
// engine caches them all and only releases the hold. It returns how many
// blocks it served.
func (r *Runner) Pull(id string, blockIDs []int) (int, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.expireHolds()
	if _, ok := r.holds[id]; !ok {
		return 0, fmt.Errorf("%w: %q", ErrNoHold, id)
	}
	held := r.eng.HeldBlocks(id)
	for _, b := range blockIDs {
		if !slices.Contains(held, b) {
			return 0, fmt.Errorf("%w: request %q holds blocks %v, not %d", ErrNoHold, id, held, b)
		}
	}
	r.eng.Release(id)
	delete(r.holds, id)
	return len(blockIDs), nil
}

// expireHolds releases the holds whose deadline passed, the earliest first
// so that the prefix cache's LRU order does not depend on map order. The
// caller holds mu.
func (r *Runner) expireHolds() {
	if len(r.holds) == 0 {
		return
	}
	now := r.clock.Now()
	if now.Before(r.nextExpiry) {
		return
	}
	var due []string
	r.nextExpiry = time.Time{}
	for id, until := range r.holds {
		switch {
		case !now.Before(until):
			due = append(due, id)
		case r.nextExpiry.IsZero() || until.Before(r.nextExpiry):
			r.nextExpiry = until
		}
	}
	slices.SortFunc(due, func(a, b string) int { return cmp.Or(r.holds[a].Compare(r.holds[b]), cmp.Compare(a, b)) })
	for _, id := range due {
		r.eng.Release(id)
		delete(r.holds, id)
		r.holdsExpired++
	}
}

// CachedPrefixBlocks is how many leading full blocks of tokens the engine
// caches now (see engine.Engine.CachedPrefixBlocks).
func (r *Runner) CachedPrefixBlocks(tokens []uint32) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.eng.CachedPrefixBlocks(tokens)
}

// BlockSize is the engine's tokens per KV block.
func (r *Runner) BlockSize() int { return r.blockSize }

// Delay waits d of model time (divided by the speedup, like a step) on the
// runner's clock: what a KV transfer takes. A VirtualClock moves on at
// once, which keeps virtual time exact while nothing else runs meanwhile.
func (r *Runner) Delay(ctx context.Context, d time.Duration) error {
	return r.clock.SleepUntil(ctx, r.clock.Now().Add(time.Duration(float64(d)/r.speedup)))
}

// CachedBlocks lists the engine's cached blocks (see
// engine.Engine.CachedBlocks).
func (r *Runner) CachedBlocks() []engine.CachedBlock {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.eng.CachedBlocks()
}

// Timing returns the pacing figures so far.
func (r *Runner) Timing() Timing {
	r.tmu.Lock()
	defer r.tmu.Unlock()
	return r.timing
}

// Speedup is the factor model durations are divided by.
func (r *Runner) Speedup() float64 { return r.speedup }

// Now is the runner's clock.
func (r *Runner) Now() time.Time { return r.clock.Now() }

type snapshot struct {
	fn   func(*engine.Engine)
	done chan struct{}
}

// Snapshot runs fn on the engine between two steps, once every event of
// the steps before has been handed to the publisher and before the next
// step changes anything: what fn reads is exactly the state those events
// add up to. It waits for the run loop, so it fails with ctx's error when
// the runner is not running.
func (r *Runner) Snapshot(ctx context.Context, fn func(*engine.Engine)) error {
	s := snapshot{fn: fn, done: make(chan struct{})}
	select {
	case r.snaps <- s:
	case <-ctx.Done():
		return ctx.Err()
	}
	<-s.done
	return nil
}

func (r *Runner) runSnapshot(s snapshot) {
	r.mu.Lock()
	defer r.mu.Unlock()
	defer close(s.done)
	s.fn(r.eng)
}

// Run steps the engine until ctx ends. Steps are scheduled back to back on
// absolute deadlines (each starts when the previous one was due to end),
// so sleep overshoot and the engine's own computing time do not add up
// into drift.
func (r *Runner) Run(ctx context.Context) error {
	var next, lastDone time.Time
	for {
		select {
		case snap := <-r.snaps:
			r.runSnapshot(snap)
		default:
		}
		r.mu.Lock()
		for r.eng.Idle() {
			r.mu.Unlock()
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-r.wake:
			case snap := <-r.snaps:
				r.runSnapshot(snap)
			}
			next = time.Time{}
			r.mu.Lock()
		}
		r.expireHolds()
		now := r.clock.Now()
		if next.IsZero() {
			next = now
		} else if now.Sub(next) > maxLag {
			next = now
			r.tmu.Lock()
			r.timing.LagResets++
			r.tmu.Unlock()
		}
		res := r.eng.Step()
		r.mu.Unlock()

		wall := time.Duration(float64(res.Duration) / r.speedup)
		due := next.Add(wall)
		if err := r.clock.SleepUntil(ctx, due); err != nil {
			return err
		}
		done := r.clock.Now()
		began := next
		if lastDone.After(began) {
			began = lastDone
		}
		r.tmu.Lock()
		r.timing.Steps++
		r.timing.Model += wall
		r.timing.Actual += done.Sub(began)
		r.tmu.Unlock()
		lastDone = done
		if r.publish != nil && len(res.Events) > 0 {
			r.publish(done, res.Events)
		}
		r.deliver(res.Outputs, done)
		next = due
	}
}

func (r *Runner) deliver(outs []engine.Output, at time.Time) {
	if len(outs) == 0 {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, o := range outs {
		s := r.streams[o.ID]
		if s == nil {
			// Aborted meanwhile: a hold nobody will learn of is released.
			r.eng.Release(o.ID)
			continue
		}
		s.mu.Lock()
		if s.FirstAt.IsZero() {
			s.FirstAt = at
		}
		s.outs = append(s.outs, o)
		if o.Finished {
			s.done = true
			s.DoneAt = at
			delete(r.streams, o.ID)
			if s.holdFor > 0 {
				s.HeldBlocks = r.eng.HeldBlocks(o.ID)
				if s.HeldBlocks != nil {
					until := at.Add(s.holdFor)
					r.holds[o.ID] = until
					if r.nextExpiry.IsZero() || until.Before(r.nextExpiry) {
						r.nextExpiry = until
					}
				}
			}
		}
		s.mu.Unlock()
		select {
		case s.signal <- struct{}{}:
		default:
		}
	}
}
