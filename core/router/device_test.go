package router

import (
	"fmt"
	"testing"

	"github.com/kvrouter/kvrouter/core/sched"
)

// A CPU engine gets 1/ratio of an accelerator engine's requests in
// device-aware-weighted mode, counted from the router's own bookings.
func TestDeviceAwareWeightedSharesByDevice(t *testing.T) {
	for _, tc := range []struct {
		ratio, wantCPU int // of 90 requests that stay in flight
	}{{0, 10}, {2, 30}, {8, 10}} {
		r, _ := newRouter(t, 0, func(c *Config) {
			c.Mode = sched.ModeDeviceAwareWeighted
			c.NonCPUToCPURatio = tc.ratio
		})
		r.AddWorker(WorkerInfo{ID: 1, CPU: true})
		r.AddWorker(WorkerInfo{ID: 2})
		r.AddWorker(WorkerInfo{ID: 3, CPU: true})
		r.AddWorker(WorkerInfo{ID: 4})
		got := map[uint64]int{}
		for i := range 90 {
			d, err := route(r, fmt.Sprint(i), tokens(i, 4, i, 4))
			if err != nil {
				t.Fatal(err)
			}
			got[d.Worker.ID]++
		}
		if cpu := got[1] + got[3]; cpu < tc.wantCPU-2 || cpu > tc.wantCPU {
			t.Errorf("ratio %d: CPU engines took %d of 90 (%v), want about %d", tc.ratio, cpu, got, tc.wantCPU)
		}
		if d := got[1] - got[3]; d < -1 || d > 1 {
			t.Errorf("ratio %d: the CPU engines are not level: %v", tc.ratio, got)
		}
	}
	cfg := DefaultConfig()
	cfg.Mode, cfg.NonCPUToCPURatio = sched.ModeDeviceAwareWeighted, -1
	if _, err := New(cfg); err == nil {
		t.Error("a negative ratio was accepted")
	}
}

func TestParseDevice(t *testing.T) {
	for _, tc := range []struct {
		in      string
		cpu, ok bool
	}{
		{"", false, true}, {"cpu", true, true}, {" CPU ", true, true}, {"cuda", false, true},
		{"rocm", false, true}, {"gpu-0", false, true}, {"cpu,cuda", false, false}, {"c p u", false, false},
	} {
		cpu, err := ParseDevice(tc.in)
		if (err == nil) != tc.ok || cpu != tc.cpu {
			t.Errorf("ParseDevice(%q) = %v, %v; want cpu %v, ok %v", tc.in, cpu, err, tc.cpu, tc.ok)
		}
	}
}
