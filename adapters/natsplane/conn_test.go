package natsplane

import (
	"context"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/testwait"
)

// records keeps the log records a test looks at.
type records struct {
	mu   sync.Mutex
	msgs []string
	lvls []slog.Level
}

func (r *records) Enabled(context.Context, slog.Level) bool { return true }
func (r *records) Handle(_ context.Context, rec slog.Record) error {
	r.mu.Lock()
	r.msgs = append(r.msgs, rec.Message)
	r.lvls = append(r.lvls, rec.Level)
	r.mu.Unlock()
	return nil
}
func (r *records) WithAttrs([]slog.Attr) slog.Handler { return r }
func (r *records) WithGroup(string) slog.Handler      { return r }

func (r *records) seen(msg string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, m := range r.msgs {
		if m == msg {
			return true
		}
	}
	return false
}

func (r *records) warnings() (n int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, l := range r.lvls {
		if l >= slog.LevelWarn {
			n++
		}
	}
	return n
}

func TestCleanCloseLogsNoLostConnection(t *testing.T) {
	srv := startServer(t)
	rec := &records{}
	nc, err := Connect(srv.URL(), t.Name(), slog.New(rec))
	if err != nil {
		t.Fatal(err)
	}
	nc.Close()
	testwait.Until(t, 5*time.Second, "the close reported", func() bool { return rec.seen("NATS connection closed") })
	if n := rec.warnings(); n != 0 {
		t.Fatalf("a clean close logged %d warning(s): %q", n, rec.msgs)
	}

	// A server that goes away is still worth a warning.
	rec = &records{}
	nc, err = Connect(srv.URL(), t.Name(), slog.New(rec))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	srv.Shutdown()
	testwait.Until(t, 5*time.Second, "the loss reported", func() bool { return rec.warnings() == 1 })
}
