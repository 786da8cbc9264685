package ratelog

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"
	"time"
)

type clock struct{ t time.Time }

func (c *clock) now() time.Time { return c.t }

func TestRepeatedWarningsAreLimited(t *testing.T) {
	var buf bytes.Buffer
	c := &clock{t: time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)}
	plain := slog.NewTextHandler(&buf, &slog.HandlerOptions{ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
		if a.Key == slog.TimeKey {
			return slog.Attr{}
		}
		return a
	}})
	log := slog.New(New(plain, slog.LevelWarn, 10*time.Second, c.now))
	for i := range 100 {
		c.t = c.t.Add(time.Second / 10) // 100 failures in 10 s
		log.Warn("engine unreachable", "worker", "a", "attempt", i)
		log.Info("request served", "worker", "a") // below the limited level
	}
	log.Warn("engine unreachable", "worker", "b") // another engine is news
	c.t = c.t.Add(time.Second)
	log.Warn("engine unreachable", "worker", "a", "attempt", 100)
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	var warns []string
	for _, l := range lines {
		if strings.Contains(l, "WARN") {
			warns = append(warns, l)
		}
	}
	want := []string{
		`level=WARN msg="engine unreachable" worker=a attempt=0`,
		`level=WARN msg="engine unreachable" worker=b`,
		`level=WARN msg="engine unreachable" worker=a attempt=100 suppressed=99`,
	}
	if strings.Join(warns, "\n") != strings.Join(want, "\n") {
		t.Fatalf("warnings:\n%s\nwant:\n%s", strings.Join(warns, "\n"), strings.Join(want, "\n"))
	}
	if infos := len(lines) - len(warns); infos != 100 {
		t.Fatalf("%d info lines, want all 100", infos)
	}
}
