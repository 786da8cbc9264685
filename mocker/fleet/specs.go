package fleet

import (
	"fmt"
	"math"
	"strconv"
	"strings"

	"github.com/kvrouter/kvrouter/mocker/engine"
)

// EngineSpec is one engine of an unequal fleet, relative to the fleet's
// configured engine.
type EngineSpec struct {
	Speed float64 // step times are divided by it: 0.5 is half as fast
	KV    float64 // fraction of the configured GPU blocks
	// CPU announces the engine to the router as a CPU engine, for
	// --router-mode device-aware-weighted; its speed is still Speed.
	CPU bool
}

// Apply is cfg for an engine of this spec.
func (sp EngineSpec) Apply(cfg engine.Config) engine.Config {
	if cfg.Speed == 0 { // engine.Config's 0 is 1
		cfg.Speed = 1
	}
	cfg.Speed *= sp.Speed
	cfg.NumGPUBlocks = max(int(math.Round(float64(cfg.NumGPUBlocks)*sp.KV)), 1)
	return cfg
}

// ParseSpecs reads --fleet: comma-separated groups COUNTxSPEED[:KV][:cpu],
// each COUNT engines at SPEED times the configured engine's speed, with KV
// times its GPU blocks (default 1), announced as CPU engines with :cpu.
// "4x1,4x0.5" is four engines at full speed and four at half;
// "4x1,4x1:0.5" four with half the KV blocks; "4x1,2x0.125:cpu" four
// accelerators and two CPU engines at an eighth of their speed.
func ParseSpecs(s string) ([]EngineSpec, error) {
	var out []EngineSpec
	for _, g := range strings.Split(s, ",") {
		g = strings.TrimSpace(g)
		count, rest, ok := strings.Cut(g, "x")
		if !ok {
			return nil, fmt.Errorf("fleet %q: group %q: want COUNTxSPEED[:KV][:cpu], e.g. 4x1,4x0.5, 4x1:0.5 or 2x0.125:cpu", s, g)
		}
		n, err := strconv.Atoi(count)
		if err != nil || n < 1 {
			return nil, fmt.Errorf("fleet %q: group %q: the count must be a whole number ≥ 1", s, g)
		}
		sp := EngineSpec{KV: 1}
		if r, ok := strings.CutSuffix(rest, ":cpu"); ok {
			rest, sp.CPU = r, true
		}
		speed, kv, hasKV := strings.Cut(rest, ":")
		if sp.Speed, err = positive(speed); err != nil {
			return nil, fmt.Errorf("fleet %q: group %q: speed %w", s, g, err)
		}
		if hasKV {
			if sp.KV, err = positive(kv); err != nil {
				return nil, fmt.Errorf("fleet %q: group %q: KV fraction %w", s, g, err)
			}
		}
		if len(out)+n > maxFleetEngines {
			return nil, fmt.Errorf("fleet %q: more than %d engines", s, maxFleetEngines)
		}
		for range n {
			out = append(out, sp)
		}
	}
	return out, nil
}

// maxFleetEngines bounds what one flag can ask for, so a typo cannot
// allocate without end.
const maxFleetEngines = 100_000

func positive(s string) (float64, error) {
	v, err := strconv.ParseFloat(strings.TrimSpace(s), 64)
	if err != nil || !(v > 0) || math.IsInf(v, 1) {
		return 0, fmt.Errorf("%q: want a number > 0", s)
	}
	return v, nil
}

// SpecsString is ParseSpecs' syntax for specs, groups of equal engines in
// a row joined: what a report prints.
func SpecsString(specs []EngineSpec) string {
	var b strings.Builder
	for i := 0; i < len(specs); {
		j := i
		for j < len(specs) && specs[j] == specs[i] {
			j++
		}
		if b.Len() > 0 {
			b.WriteByte(',')
		}
		fmt.Fprintf(&b, "%dx%g", j-i, specs[i].Speed)
		if specs[i].KV != 1 {
			fmt.Fprintf(&b, ":%g", specs[i].KV)
		}
		if specs[i].CPU {
			b.WriteString(":cpu")
		}
		i = j
	}
	return b.String()
}

// EngineConfig is engine i's configuration: the fleet's engine, sized by
// Specs[i] when there is one.
func (c *Config) EngineConfig(i int) engine.Config {
	if i < len(c.Specs) {
		return c.Specs[i].Apply(c.Engine)
	}
	return c.Engine
}
