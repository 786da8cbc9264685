package main

import (
	"fmt"
	"time"

	"github.com/spf13/pflag"

	"github.com/kvrouter/kvrouter/adapters/enginesource"
	"github.com/kvrouter/kvrouter/adapters/frontend"
	"github.com/kvrouter/kvrouter/core/router"
)

// hardeningFlags tune how the router heals after losses: its own restart
// (recovery window), a silently dropped event tail (silence probe), and
// how many admin bookings it holds. Dynamo has no flags for these.
type hardeningFlags struct {
	recoveryWindow time.Duration
	silenceProbe   time.Duration
	maxBookings    int
	strictNvext    bool
	dynamoMetrics  bool
}

func (f *hardeningFlags) register(fs *pflag.FlagSet) {
	fs.DurationVar(&f.recoveryWindow, "kv-recovery-window", router.DefaultRecoveryWindow, "after an event below an unknown parent, how long the rank re-anchors events from routed prompts")
	fs.DurationVar(&f.silenceProbe, "kv-events-silence-probe", enginesource.DefaultSilenceProbe, "ask an engine's replay endpoint for a lost tail after its event stream was silent this long; 0 = off")
	fs.IntVar(&f.maxBookings, "router-max-bookings", frontend.DefaultMaxBookings, "requests booked through /router/best_worker and not yet freed; more are answered 429")
	fs.BoolVar(&f.dynamoMetrics, "metrics-dynamo-names", false, "also export the metrics Dynamo has under Dynamo's names (dynamo_frontend_*, dynamo_component_router_*; docs/dynamo-compat.md), for dashboards and alerts built for Dynamo")
	fs.BoolVar(&f.strictNvext, "strict-nvext", false, "answer a request whose nvext has a key neither kvrouter nor Dynamo knows with 400 (default: serve it with an X-Kvrouter-Warning header naming the key)")
}

func (f *hardeningFlags) validate() error {
	if f.recoveryWindow <= 0 {
		return fmt.Errorf("--kv-recovery-window must be positive, got %s", f.recoveryWindow)
	}
	if f.silenceProbe < 0 {
		return fmt.Errorf("--kv-events-silence-probe must be at least 0 (0 = off), got %s", f.silenceProbe)
	}
	if f.maxBookings < 1 {
		return fmt.Errorf("--router-max-bookings must be at least 1, got %d", f.maxBookings)
	}
	return nil
}

// silenceProbeConfig maps the flag's 0 ("off") onto enginesource's
// negative, since enginesource reads 0 as its default.
func (f *hardeningFlags) silenceProbeConfig() time.Duration {
	if f.silenceProbe == 0 {
		return -1
	}
	return f.silenceProbe
}
