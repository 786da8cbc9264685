package main

import (
	"testing"

	"github.com/spf13/pflag"

	"github.com/kvrouter/kvrouter/mocker/fleet"
)

func TestFleetFlag(t *testing.T) {
	parse := func(args ...string) (int, []fleet.EngineSpec, error) {
		var specs []fleet.EngineSpec
		fs := pflag.NewFlagSet("t", pflag.ContinueOnError)
		n := fs.Int("workers", 4, "")
		registerFleetFlag(fs, &specs)
		if err := fs.Parse(args); err != nil {
			return 0, nil, err
		}
		err := fleetCount(fs, "workers", specs, n)
		return *n, specs, err
	}
	n, specs, err := parse("--fleet", "4x1,4x0.5")
	if err != nil || n != 8 || len(specs) != 8 || specs[7].Speed != 0.5 {
		t.Fatalf("%d %v %v", n, specs, err)
	}
	if n, _, err := parse("--fleet", "2x1:0.5", "--workers", "2"); err != nil || n != 2 {
		t.Fatalf("agreeing counts: %d %v", n, err)
	}
	for _, bad := range [][]string{{"--fleet", "4x1", "--workers", "3"}, {"--fleet", "4y1"}, {"--fleet", "4x0"}} {
		if _, _, err := parse(bad...); err == nil {
			t.Errorf("%v accepted", bad)
		}
	}
}
