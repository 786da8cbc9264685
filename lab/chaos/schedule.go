package chaos

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"time"
)

// FaultKind names an injected fault.
type FaultKind string

const (
	EngineKill  FaultKind = "engine-kill"  // an engine dies (its streams break) and restarts empty after a pause
	EventCut    FaultKind = "event-cut"    // every KV-event and replay connection is cut and refused for a pause
	RouterKill  FaultKind = "router-kill"  // SIGKILL of the router, restarted after a pause
	RouterTerm  FaultKind = "router-term"  // SIGTERM of the router (it drains), restarted after a pause
	NATSRestart FaultKind = "nats-restart" // the NATS server stops and restarts on the same port and store
)

// DefaultFaults are the kinds injected on each plane, in the order the
// schedule cycles through them.
func DefaultFaults(plane string) []FaultKind {
	kinds := []FaultKind{EngineKill, EventCut, RouterKill, RouterTerm}
	if plane == PlaneNATS {
		kinds = append(kinds, NATSRestart)
	}
	return kinds
}

// ParseFaultKind accepts the names above.
func ParseFaultKind(s string) (FaultKind, error) {
	k := FaultKind(s)
	if !slices.Contains([]FaultKind{EngineKill, EventCut, RouterKill, RouterTerm, NATSRestart}, k) {
		return "", fmt.Errorf("unknown fault %q (engine-kill, event-cut, router-kill, router-term, nats-restart)", s)
	}
	return k, nil
}

// explains lists, per fault, the client errors it may cause while its
// window is open. An event cut explains none: routing carries on without
// events, so a request failing then is a defect.
var explains = map[FaultKind][]string{
	// Streams on the dying engine break; a migration may fail too when the
	// other engines are saturated, and the router answers 5xx for requests
	// it cannot place while the engine is out.
	EngineKill: {ClassStreamError, ClassStreamCut, ClassStatus5xx},
	EventCut:   nil,
	// The router is gone: connections are refused or reset, streams cut;
	// once back it answers 503 until the engines have joined.
	RouterKill: {ClassTransport, ClassStreamCut, ClassStatus5xx},
	// Draining refuses new connections; streams in flight that outlive the
	// drain timeout are cut.
	RouterTerm: {ClassTransport, ClassStreamCut, ClassStatus5xx},
	// Without NATS the engines may drop out of routing (their leases
	// lapse) and the router answers 503.
	NATSRestart: {ClassStatus5xx, ClassStreamError},
}

// Planned is a fault to inject at At after the start of traffic.
type Planned struct {
	At     time.Duration
	Kind   FaultKind
	Engine int // the engine of an engine-kill
}

// Plan spreads faults over the middle of a run of d: the first tenth
// warms up, the last fifth lets the system settle under traffic. Faults
// come about every `every` (at least one of each kind), each at a random
// point of the first half of its slot so that recovery fits in the slot,
// kinds cycling in order.
func Plan(d, every time.Duration, kinds []FaultKind, engines int, seed uint64) []Planned {
	if len(kinds) == 0 || d <= 0 {
		return nil
	}
	start, span := d/10, d*7/10
	n := max(len(kinds), int(span/max(every, time.Second)))
	slot := span / time.Duration(n)
	rng := rand.New(rand.NewPCG(seed, 0x5eed))
	out := make([]Planned, n)
	for i := range out {
		jitter := time.Duration(rng.Int64N(int64(slot/2) + 1))
		out[i] = Planned{At: start + time.Duration(i)*slot + jitter, Kind: kinds[i%len(kinds)], Engine: rng.IntN(max(engines, 1))}
	}
	return out
}

// Fault is one injected fault and how the system came back.
type Fault struct {
	Kind      FaultKind `json:"kind"`
	Engine    string    `json:"engine,omitempty"`
	Injected  float64   `json:"injected_s"`  // since the start of traffic
	Restored  float64   `json:"restored_s"`  // the component is back (restart done)
	Recovered float64   `json:"recovered_s"` // the system serves as before
	// WindowEnd closes the window of errors the fault explains: recovery
	// plus the grace period.
	WindowEnd float64 `json:"window_end_s"`
	Err       string  `json:"error,omitempty"` // recovery not seen
	Errors    int     `json:"client_errors"`   // client errors it explains
}

// RecoverySeconds is the time from injection to recovery.
func (f *Fault) RecoverySeconds() float64 { return f.Recovered - f.Injected }

// Account attributes each error to the first fault whose window contains
// its end and explains its class; it returns the errors nothing explains.
func Account(errs []Outcome, faults []Fault) []Outcome {
	var unexplained []Outcome
	for i := range errs {
		e := &errs[i]
		e.Fault = ""
		for j := range faults {
			f := &faults[j]
			if e.End >= f.Injected && e.End <= f.WindowEnd && slices.Contains(explains[f.Kind], e.Class) {
				e.Fault = string(f.Kind)
				f.Errors++
				break
			}
		}
		if e.Fault == "" {
			unexplained = append(unexplained, *e)
		}
	}
	return unexplained
}
