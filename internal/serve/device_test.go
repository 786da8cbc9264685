package serve

import (
	"testing"

	"github.com/kvrouter/kvrouter/mocker/fleet"
)

// An engine's device reaches the router from a workers file or --worker,
// and a --fleet group's :cpu from the simulated fleet; a device that is
// not a name stops the start.
func TestWorkerDevice(t *testing.T) {
	for _, tc := range []struct {
		device  string
		cpu, ok bool
	}{{"", false, true}, {"cpu", true, true}, {"CPU", true, true}, {"cuda", false, true}, {"cpu;rm", false, false}} {
		w := WorkerSpec{ID: 1, URL: "http://127.0.0.1:1", Device: tc.device}
		if err := w.validate(); (err == nil) != tc.ok {
			t.Errorf("device %q: validate %v", tc.device, err)
			continue
		}
		if tc.ok && w.info().CPU != tc.cpu {
			t.Errorf("device %q: CPU %v, want %v", tc.device, w.info().CPU, tc.cpu)
		}
	}
	specs, err := fleet.ParseSpecs("1x1,2x0.125:cpu")
	if err != nil {
		t.Fatal(err)
	}
	cfg := fleet.Config{Specs: specs}
	for i, want := range []string{"", "cpu", "cpu", ""} {
		if got := device(cfg, i); got != want {
			t.Errorf("engine %d: device %q, want %q", i, got, want)
		}
	}
}
