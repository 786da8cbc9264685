package main

import (
	"fmt"
	"time"

	"github.com/spf13/pflag"

	"github.com/kvrouter/kvrouter/adapters/enginesource"
	"github.com/kvrouter/kvrouter/adapters/frontend"
	"github.com/kvrouter/kvrouter/core/outlier"
	"github.com/kvrouter/kvrouter/core/router"
)

// hardeningFlags tune how the router heals after losses: its own restart
// (recovery window), a silently dropped event tail (silence probe), how
// many admin bookings it holds, and how it treats engines that answer
// /health but fail requests (outlier detection, after Envoy's; see
// docs/hardening.md). Dynamo has no flags for these.
type hardeningFlags struct {
	recoveryWindow time.Duration
	silenceProbe   time.Duration
	maxBookings    int

	headerTimeout   time.Duration
	responseTimeout time.Duration
	ejection        outlier.Config
	strictNvext     bool
	dynamoMetrics   bool
}

func (f *hardeningFlags) register(fs *pflag.FlagSet) {
	fs.DurationVar(&f.recoveryWindow, "kv-recovery-window", router.DefaultRecoveryWindow, "after an event below an unknown parent, how long the rank re-anchors events from routed prompts")
	registerSilenceProbe(fs, &f.silenceProbe)
	fs.IntVar(&f.maxBookings, "router-max-bookings", frontend.DefaultMaxBookings, "requests booked through /router/best_worker and not yet freed; more are answered 429")
	fs.DurationVar(&f.headerTimeout, "engine-header-timeout", frontend.DefaultHeaderTimeout, "an engine that has not sent a stream's response headers (or a prefill's answer) within this long has failed the request, which goes to another engine; 0 = no bound")
	fs.DurationVar(&f.responseTimeout, "engine-response-timeout", frontend.DefaultResponseTimeout, "the same for a non-streamed request, whose headers engines send with its last token; 0 = no bound")
	fs.IntVar(&f.ejection.Consecutive, "engine-ejection-consecutive-failures", outlier.DefaultConsecutive, "failures in a row (error status, reset, timeout, malformed stream) that take an engine out of routing; 0 = never")
	fs.DurationVar(&f.ejection.BaseEjection, "engine-ejection-base-time", outlier.DefaultBaseEjection, "an ejected engine stays out this long times its number of ejections")
	fs.DurationVar(&f.ejection.MaxEjection, "engine-ejection-max-time", outlier.DefaultMaxEjection, "the longest an ejection lasts")
	fs.IntVar(&f.ejection.MaxEjectionPercent, "engine-ejection-max-percent", outlier.DefaultMaxEjectionPercent, "the most engines of a pool (a model's decode-capable engines; for prefill engines, all of the model's) ejected at once, in percent: below 100 the last engine is never ejected")
	fs.BoolVar(&f.dynamoMetrics, "metrics-dynamo-names", false, "also export the metrics Dynamo has under Dynamo's names (dynamo_frontend_*, dynamo_component_router_*; docs/dynamo-compat.md), for dashboards and alerts built for Dynamo")
	fs.BoolVar(&f.strictNvext, "strict-nvext", false, "answer a request whose nvext has a key neither kvrouter nor Dynamo knows with 400 (default: serve it with an X-Kvrouter-Warning header naming the key)")
}

func (f *hardeningFlags) validate() error {
	if f.recoveryWindow <= 0 {
		return fmt.Errorf("--kv-recovery-window must be positive, got %s", f.recoveryWindow)
	}
	if err := checkSilenceProbe(f.silenceProbe); err != nil {
		return err
	}
	if f.maxBookings < 1 {
		return fmt.Errorf("--router-max-bookings must be at least 1, got %d", f.maxBookings)
	}
	switch {
	case f.headerTimeout < 0:
		return fmt.Errorf("--engine-header-timeout must be at least 0 (0 = no bound), got %s", f.headerTimeout)
	case f.responseTimeout < 0:
		return fmt.Errorf("--engine-response-timeout must be at least 0 (0 = no bound), got %s", f.responseTimeout)
	case f.ejection.Consecutive < 0:
		return fmt.Errorf("--engine-ejection-consecutive-failures must be at least 0 (0 = never), got %d", f.ejection.Consecutive)
	case f.ejection.BaseEjection <= 0:
		return fmt.Errorf("--engine-ejection-base-time must be positive, got %s", f.ejection.BaseEjection)
	case f.ejection.MaxEjection < f.ejection.BaseEjection:
		return fmt.Errorf("--engine-ejection-max-time (%s) must be at least --engine-ejection-base-time (%s)", f.ejection.MaxEjection, f.ejection.BaseEjection)
	case f.ejection.MaxEjectionPercent < 1 || f.ejection.MaxEjectionPercent > 100:
		return fmt.Errorf("--engine-ejection-max-percent must be within 1..100, got %d", f.ejection.MaxEjectionPercent)
	}
	return nil
}

// engineTimeouts maps the flags' 0 ("no bound") onto the frontend's
// negative, since the frontend reads 0 as its default.
func (f *hardeningFlags) engineTimeouts() (header, response time.Duration) {
	header, response = f.headerTimeout, f.responseTimeout
	for _, d := range []*time.Duration{&header, &response} {
		if *d == 0 {
			*d = -1
		}
	}
	return header, response
}

// outlierConfig is the ejection config, the flag's 0 ("never") as
// package outlier's negative.
func (f *hardeningFlags) outlierConfig() outlier.Config {
	c := f.ejection
	if c.Consecutive == 0 {
		c.Consecutive = -1
	}
	return c
}

func (f *hardeningFlags) silenceProbeConfig() time.Duration {
	return silenceProbeConfig(f.silenceProbe)
}

// registerSilenceProbe adds --kv-events-silence-probe, the same for every
// command that follows engines' KV events (serve, up, indexer).
func registerSilenceProbe(fs *pflag.FlagSet, d *time.Duration) {
	fs.DurationVar(d, "kv-events-silence-probe", enginesource.DefaultSilenceProbe, "ask an engine's replay endpoint for a lost tail after its event stream was silent this long; 0 = off")
}

func checkSilenceProbe(d time.Duration) error {
	if d < 0 {
		return fmt.Errorf("--kv-events-silence-probe must be at least 0 (0 = off), got %s", d)
	}
	return nil
}

// silenceProbeConfig maps the flag's 0 ("off") onto enginesource's
// negative, since enginesource reads 0 as its default.
func silenceProbeConfig(d time.Duration) time.Duration {
	if d == 0 {
		return -1
	}
	return d
}
