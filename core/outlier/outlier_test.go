package outlier

import (
	"slices"
	"testing"
	"time"
)

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// step is one thing that happens to an engine in a scenario, at an offset
// from t0, and what must hold after it.
type step struct {
	at      time.Duration
	worker  uint64
	fail    bool // else a success; ignored when check
	check   bool // only look
	ejected []uint64
	// until, when set, is the end of the ejection this step must make.
	until time.Duration
}

func TestDetector(t *testing.T) {
	cfg := Config{Consecutive: 3, BaseEjection: 10 * time.Second, MaxEjection: 25 * time.Second, MaxEjectionPercent: 50}
	pool := []uint64{1, 2, 3, 4}
	fail := func(at time.Duration, w uint64, ejected ...uint64) step {
		return step{at: at, worker: w, fail: true, ejected: ejected}
	}
	ok := func(at time.Duration, w uint64, ejected ...uint64) step {
		return step{at: at, worker: w, ejected: ejected}
	}
	look := func(at time.Duration, ejected ...uint64) step {
		return step{at: at, check: true, ejected: ejected}
	}
	ejects := func(at time.Duration, w uint64, until time.Duration) step {
		return step{at: at, worker: w, fail: true, ejected: []uint64{w}, until: until}
	}
	for _, tc := range []struct {
		name  string
		steps []step
	}{
		{"consecutive failures eject", []step{
			fail(0, 1), fail(1, 1), ejects(2, 1, 10*time.Second+2),
		}},
		{"a success resets the count", []step{
			fail(0, 1), fail(1, 1), ok(2, 1), fail(3, 1), fail(4, 1), look(5),
		}},
		{"other engines' failures do not count", []step{
			fail(0, 1), fail(1, 2), fail(2, 1), fail(3, 3), look(4),
		}},
		{"back after the backoff, ejected again at its first failure", []step{
			fail(0, 1), fail(0, 1), ejects(0, 1, 10*time.Second),
			look(9*time.Second, 1), look(10 * time.Second),
			ejects(11*time.Second, 1, 31*time.Second),
		}},
		{"the backoff grows with each ejection and is capped", []step{
			fail(0, 1), fail(0, 1), ejects(0, 1, 10*time.Second),
			ejects(10*time.Second, 1, 30*time.Second), // 2 × 10 s
			ejects(30*time.Second, 1, 55*time.Second), // 3 × 10 s, capped at 25 s
			ejects(55*time.Second, 1, 80*time.Second), // capped
			look(79*time.Second, 1), look(80 * time.Second),
		}},
		{"a success ends the probation", []step{
			fail(0, 1), fail(0, 1), ejects(0, 1, 10*time.Second),
			ok(10*time.Second, 1), fail(11*time.Second, 1), fail(12*time.Second, 1), look(13 * time.Second),
			ejects(14*time.Second, 1, 34*time.Second), // the second ejection: 20 s
		}},
		{"the multiplier falls while the engine keeps well", []step{
			fail(0, 1), fail(0, 1), ejects(0, 1, 10*time.Second),
			ok(10*time.Second, 1), ok(31*time.Second, 1), // two calm periods: back to 0
			fail(40*time.Second, 1), fail(40*time.Second, 1), ejects(40*time.Second, 1, 50*time.Second),
		}},
		{"failures of a request sent before the ejection do not extend it", []step{
			fail(0, 1), fail(0, 1), ejects(0, 1, 10*time.Second), fail(1, 1, 1), look(10 * time.Second),
		}},
		{"no more than half the pool out at once", []step{
			fail(0, 1), fail(0, 1), fail(0, 1, 1),
			fail(0, 2, 1), fail(0, 2, 1), fail(0, 2, 1, 2),
			fail(0, 3, 1, 2), fail(0, 3, 1, 2), fail(0, 3, 1, 2), fail(0, 3, 1, 2),
			look(10 * time.Second), ejects(10*time.Second, 3, 20*time.Second),
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := New(cfg)
			for i, s := range tc.steps {
				now := t0.Add(s.at)
				switch {
				case s.check:
				case s.fail:
					e, ejected := d.Failure(s.worker, "timeout", pool, now)
					if s.until != 0 {
						if !ejected || !e.Until.Equal(t0.Add(s.until)) || e.Worker != s.worker || e.Reason != "timeout" {
							t.Fatalf("step %d: ejection %+v, %v; want worker %d until t0+%s", i, e, ejected, s.worker, s.until)
						}
					}
				default:
					d.Success(s.worker, now)
				}
				got := d.Ejected(now, nil)
				slices.Sort(got)
				if !slices.Equal(got, s.ejected) {
					t.Fatalf("step %d (t0+%s): ejected %v, want %v", i, s.at, got, s.ejected)
				}
			}
		})
	}
}

func TestTheLastEngineIsNeverEjected(t *testing.T) {
	d := New(Config{Consecutive: 1})
	for i := range 10 {
		if _, ejected := d.Failure(7, "reset", []uint64{7}, t0.Add(time.Duration(i)*time.Second)); ejected {
			t.Fatal("the only engine of its pool was ejected")
		}
	}
	// Two engines at 50 %: one may go.
	if _, ejected := d.Failure(7, "reset", []uint64{7, 8}, t0.Add(time.Minute)); !ejected {
		t.Fatal("one engine of two was not ejected")
	}
}

func TestEjectionsListsWhyAndUntilWhen(t *testing.T) {
	d := New(Config{Consecutive: 1, BaseEjection: time.Second})
	pool := []uint64{1, 2, 3, 4}
	d.Failure(3, "malformed stream", pool, t0)
	d.Failure(1, "timeout", pool, t0.Add(time.Second/2))
	got := d.Ejections(t0.Add(time.Second / 2))
	want := []Ejection{
		{Worker: 1, Reason: "timeout", Since: t0.Add(time.Second / 2), Until: t0.Add(3 * time.Second / 2), Count: 1},
		{Worker: 3, Reason: "malformed stream", Since: t0, Until: t0.Add(time.Second), Count: 1},
	}
	if !slices.Equal(got, want) {
		t.Fatalf("ejections %+v, want %+v", got, want)
	}
}

func TestNegativeConsecutiveNeverEjects(t *testing.T) {
	d := New(Config{Consecutive: -1})
	for i := range 100 {
		if _, ejected := d.Failure(1, "timeout", []uint64{1, 2}, t0.Add(time.Duration(i))); ejected {
			t.Fatal("ejected with ejection off")
		}
	}
}

func TestConfig(t *testing.T) {
	c := Config{}.WithDefaults()
	if c != (Config{DefaultConsecutive, DefaultBaseEjection, DefaultMaxEjection, DefaultMaxEjectionPercent}) {
		t.Fatalf("defaults %+v", c)
	}
	if c := (Config{BaseEjection: time.Minute, MaxEjection: time.Second}).WithDefaults(); c.MaxEjection != time.Minute {
		t.Fatalf("max ejection below the base: %+v", c)
	}
	for _, bad := range []Config{{BaseEjection: -1}, {MaxEjection: -1}, {MaxEjectionPercent: 101}, {MaxEjectionPercent: -1}} {
		if bad.Validate() == nil {
			t.Errorf("%+v accepted", bad)
		}
	}
}
