package chaos

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"
)

// buildRouter builds kvrouter once for the package: the chaos run needs
// the router as a child process it can kill.
var buildRouter = sync.OnceValues(func() (string, error) {
	dir, err := os.MkdirTemp("", "kvrouter-chaos-test-")
	if err != nil {
		return "", err
	}
	builtIn = dir
	bin := filepath.Join(dir, "kvrouter")
	out, err := exec.Command("go", "build", "-o", bin, "github.com/kvrouter/kvrouter/cmd/kvrouter").CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("building kvrouter: %v\n%s", err, out)
	}
	return bin, nil
})

// builtIn is the directory of the built router, "" until built.
var builtIn string

func TestMain(m *testing.M) {
	code := m.Run()
	if builtIn != "" {
		os.RemoveAll(builtIn)
	}
	os.Exit(code)
}

func TestPlanCoversEveryKindInsideTheRun(t *testing.T) {
	kinds := DefaultFaults(PlaneNATS)
	for _, d := range []time.Duration{10 * time.Second, 10 * time.Minute} {
		plan := Plan(d, 45*time.Second, kinds, 4, 7)
		if len(plan) < len(kinds) {
			t.Fatalf("%v: %d faults for %d kinds", d, len(plan), len(kinds))
		}
		seen := map[FaultKind]bool{}
		for i, p := range plan {
			seen[p.Kind] = true
			if p.At < d/10 || p.At > d*8/10 {
				t.Errorf("%v: fault %d at %v, outside [%v, %v]", d, i, p.At, d/10, d*8/10)
			}
			if i > 0 && p.At <= plan[i-1].At {
				t.Errorf("%v: fault %d at %v not after %v", d, i, p.At, plan[i-1].At)
			}
			if p.Engine < 0 || p.Engine >= 4 {
				t.Errorf("engine %d", p.Engine)
			}
		}
		if len(seen) != len(kinds) {
			t.Errorf("%v: kinds %v, want all of %v", d, seen, kinds)
		}
	}
	if d := 10 * time.Minute; len(Plan(d, 45*time.Second, kinds, 4, 7)) != int(d*7/10/(45*time.Second)) {
		t.Error("ten minutes at 45 s apart: wrong number of faults")
	}
	if !slices.Equal(Plan(time.Minute, 5*time.Second, kinds, 4, 3), Plan(time.Minute, 5*time.Second, kinds, 4, 3)) {
		t.Error("the plan is not deterministic")
	}
}

func TestAccountMatchesWindowsAndClasses(t *testing.T) {
	faults := []Fault{
		{Kind: RouterKill, Injected: 10, WindowEnd: 15},
		{Kind: EngineKill, Injected: 20, WindowEnd: 30},
		{Kind: EventCut, Injected: 40, WindowEnd: 50},
	}
	errs := []Outcome{
		{End: 12, Class: ClassTransport},   // router-kill
		{End: 15, Class: ClassStreamCut},   // router-kill, at the window's edge
		{End: 16, Class: ClassTransport},   // after the window
		{End: 25, Class: ClassStreamError}, // engine-kill
		{End: 25, Class: ClassTransport},   // an engine kill does not refuse connections
		{End: 45, Class: ClassStatus5xx},   // an event cut explains nothing
		{End: 12, Class: ClassStatus4xx},   // never explained
	}
	// Reference: the same rule, spelled out per error.
	wantFault := []string{"router-kill", "router-kill", "", "engine-kill", "", "", ""}
	unexplained := Account(errs, faults)
	var want []Outcome
	for i := range errs {
		if errs[i].Fault != wantFault[i] {
			t.Errorf("error %d (%s at %v): fault %q, want %q", i, errs[i].Class, errs[i].End, errs[i].Fault, wantFault[i])
		}
		if wantFault[i] == "" {
			want = append(want, errs[i])
		}
	}
	if !slices.Equal(unexplained, want) {
		t.Errorf("unexplained %+v, want %+v", unexplained, want)
	}
	if faults[0].Errors != 2 || faults[1].Errors != 1 || faults[2].Errors != 0 {
		t.Errorf("errors per fault %d %d %d, want 2 1 0", faults[0].Errors, faults[1].Errors, faults[2].Errors)
	}
}

func TestSummariseRSS(t *testing.T) {
	series := func(f func(sec float64) float64, restartAt float64) []RSSSample {
		var out []RSSSample
		for s := 0.0; s <= 600; s++ {
			inc := 1
			if s >= restartAt {
				inc = 2
			}
			out = append(out, RSSSample{T: s, MB: f(s), Incarnation: inc})
		}
		return out
	}
	// Steady with GC noise: flat.
	flat := summariseRSS(series(func(s float64) float64 { return 100 + 5*float64(int(s)%7) }, 1e9), 600)
	if !flat.Flat || flat.PeakMB != 130 || flat.IdleMB != 100 {
		t.Errorf("steady: %+v", flat)
	}
	// Growing 10 MB a minute: 50 MB over the 5-minute window, far beyond 10%.
	grow := summariseRSS(series(func(s float64) float64 { return 100 + s/6 }, 1e9), 600)
	if grow.Flat || grow.SlopeMBPerMin < 9.9 || grow.SlopeMBPerMin > 10.1 {
		t.Errorf("growing: %+v", grow)
	}
	// A restart in the second half: only the last process counts once
	// warm, and it is flat even though the first one grew and the last one
	// starts small.
	restarted := summariseRSS(series(func(s float64) float64 {
		switch {
		case s < 400:
			return 100 + s
		case s < 400+rssWarmup:
			return 30 + (s - 400)
		}
		return 150
	}, 400), 600)
	if !restarted.Flat || restarted.WindowSeconds != 600-400-rssWarmup {
		t.Errorf("restarted: %+v", restarted)
	}
}

// TestChaosShort runs every fault of the ZMQ plane once, briefly,
// and requires what the full run requires: every client error explained,
// loads back to zero, the index equal to the engines' caches; on both
// planes, NATS with its restart included.
func TestChaosShort(t *testing.T) {
	if testing.Short() {
		t.Skip("starts router processes")
	}
	bin, err := buildRouter()
	if err != nil {
		t.Fatal(err)
	}
	for _, plane := range []string{PlaneZMQ, PlaneNATS} {
		t.Run(plane, func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.Plane, cfg.Engines, cfg.Clients = plane, 2, 20
			// One fault of each kind, the engine kill first: a restarted
			// engine's first events can be lost while the router's
			// subscriber reconnects, and only later events reveal the gap
			// (see adapters/enginesource), so traffic must go on after it.
			cfg.Duration, cfg.FaultEvery = 20*time.Second, 3500*time.Millisecond
			cfg.Pause, cfg.Grace, cfg.Quiet, cfg.Settle = 500*time.Millisecond, 2*time.Second, time.Second, 30*time.Second
			cfg.Fleet.SpeedupRatio = 4
			cfg.Fleet.Engine.NumGPUBlocks = 2048 // small enough to evict
			cfg.Workload.Requests, cfg.Workload.SystemTokens, cfg.Workload.OutputTokens = 400, 512, 16
			cfg.RouterBinary, cfg.RouterArgs = bin, []string{"--migration-limit=3"}
			cfg.WorkDir = t.TempDir()
			res, err := Run(context.Background(), cfg)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("\n%s", Summary(res))
			for _, row := range res.FaultTable {
				if row.Count != 1 || row.NotRecovered > 0 {
					t.Errorf("%s: %d injected, %d not recovered", row.Kind, row.Count, row.NotRecovered)
				}
			}
			if len(res.Unexplained) > 0 {
				t.Errorf("%d unexplained errors, first: %+v", len(res.Unexplained), res.Unexplained[0])
			}
			if !res.End.LoadsZero {
				t.Errorf("loads not back to zero: %+v", res.End.Loads)
			}
			if !res.End.IndexEqual {
				t.Errorf("index differs: %+v", res.End.Index)
			}
			if res.Requests.OK == 0 {
				t.Error("no request succeeded")
			}
			if len(res.Failures) > 0 {
				t.Errorf("failures: %v", res.Failures)
			}
			if err := WriteReport(t.TempDir(), res); err != nil {
				t.Error(err)
			}
		})
	}
}
