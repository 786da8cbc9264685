// Package ratelog keeps a repeated warning from flooding the log: an
// engine that stays unreachable fails every request and every health
// probe, and one line per failure buries everything else. A Handler lets
// the first record of a kind through, drops the repeats for an interval,
// then lets the next one through with the number it dropped.
package ratelog

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"time"
)

// SuppressedKey is the attribute that carries how many records of the
// same kind were dropped since the last one logged.
const SuppressedKey = "suppressed"

// maxKinds bounds the kinds remembered; past it they are forgotten at once,
// which at worst lets one more of each through.
const maxKinds = 4096

// Handler wraps another slog.Handler. Records below MinLevel pass as they
// are. Two records are of the same kind when they have the same level,
// message and "worker" attribute (the engine they are about), so that one
// failing engine does not hide another.
type Handler struct {
	inner    slog.Handler
	state    *state
	minLevel slog.Level
	prefix   string // attributes and groups added with WithAttrs / WithGroup
}

type state struct {
	interval time.Duration
	now      func() time.Time
	mu       sync.Mutex // guards kinds
	kinds    map[string]*kind
}

type kind struct {
	last       time.Time
	suppressed int
}

// New limits records at minLevel and above to one per kind per interval;
// now is the clock (nil: time.Now).
func New(inner slog.Handler, minLevel slog.Level, interval time.Duration, now func() time.Time) *Handler {
	if now == nil {
		now = time.Now
	}
	return &Handler{inner: inner, minLevel: minLevel, state: &state{interval: interval, now: now, kinds: map[string]*kind{}}}
}

func (h *Handler) Enabled(ctx context.Context, l slog.Level) bool { return h.inner.Enabled(ctx, l) }

func (h *Handler) Handle(ctx context.Context, r slog.Record) error {
	if r.Level < h.minLevel {
		return h.inner.Handle(ctx, r)
	}
	var key strings.Builder
	key.WriteString(h.prefix)
	key.WriteString(r.Level.String())
	key.WriteByte(0)
	key.WriteString(r.Message)
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == "worker" {
			key.WriteByte(0)
			key.WriteString(a.Value.String())
			return false
		}
		return true
	})
	suppressed, ok := h.state.admit(key.String())
	if !ok {
		return nil
	}
	if suppressed > 0 {
		r = r.Clone()
		r.AddAttrs(slog.Int(SuppressedKey, suppressed))
	}
	return h.inner.Handle(ctx, r)
}

// admit says whether a record of kind k is logged now and, if so, how many
// were dropped before it.
func (s *state) admit(k string) (int, bool) {
	now := s.now()
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.kinds[k]
	if e == nil {
		if len(s.kinds) >= maxKinds {
			clear(s.kinds)
		}
		s.kinds[k] = &kind{last: now}
		return 0, true
	}
	if now.Sub(e.last) < s.interval {
		e.suppressed++
		return 0, false
	}
	n := e.suppressed
	e.last, e.suppressed = now, 0
	return n, true
}

func (h *Handler) WithAttrs(as []slog.Attr) slog.Handler {
	c := *h
	c.inner = h.inner.WithAttrs(as)
	for _, a := range as {
		c.prefix += a.String() + "\x00"
	}
	return &c
}

func (h *Handler) WithGroup(name string) slog.Handler {
	c := *h
	c.inner = h.inner.WithGroup(name)
	c.prefix += name + ".\x00"
	return &c
}
