package main

import (
	"fmt"

	"github.com/spf13/pflag"

	"github.com/kvrouter/kvrouter/mocker/fleet"
)

// fleetFlag is --fleet, an unequal fleet's engines (fleet.ParseSpecs).
type fleetFlag struct{ specs *[]fleet.EngineSpec }

func (f fleetFlag) Set(s string) error {
	sp, err := fleet.ParseSpecs(s)
	if err != nil {
		return err
	}
	*f.specs = sp
	return nil
}

func (f fleetFlag) String() string {
	if f.specs == nil {
		return ""
	}
	return fleet.SpecsString(*f.specs)
}

func (fleetFlag) Type() string { return "fleet" }

const fleetUsage = "unequal engines, as comma-separated groups COUNTxSPEED[:KV][:cpu]: 4x1,4x0.5 is four engines at full speed and four at half (step times doubled), 4x1,4x1:0.5 four with half the KV blocks, 4x1,2x0.125:cpu two CPU engines at an eighth of the speed (for --router-mode device-aware-weighted); sets the engine count"

func registerFleetFlag(fs *pflag.FlagSet, specs *[]fleet.EngineSpec) {
	fs.Var(fleetFlag{specs}, "fleet", fleetUsage)
}

// fleetCount makes *n the number of engines --fleet gave, refusing a
// count flag set to another number.
func fleetCount(fs *pflag.FlagSet, countFlag string, specs []fleet.EngineSpec, n *int) error {
	if len(specs) == 0 {
		return nil
	}
	if fs.Changed(countFlag) && *n != len(specs) {
		return fmt.Errorf("--%s %d and --fleet's %d engines disagree: give one of them", countFlag, *n, len(specs))
	}
	*n = len(specs)
	return nil
}
