// Package natsplane is kvrouter's scale-out plane on NATS (SPEC §3.3):
// discovery of engines with leases, the KV-event plane (NATS core with
// per-worker recovery, or a durable JetStream stream with snapshots), load
// metrics and replica sync between routers. An embedded server makes the
// same plane run on one machine with nothing installed. Auth carries the
// credentials and TLS settings of every connection; whoever connects can
// register an engine, so the embedded server requires a token when it
// listens beyond loopback.
//
// Subjects and stream names follow Dynamo's layout so that an operator who
// knows one knows the other; payloads are JSON except dumps and snapshots,
// which are a compact binary (see dump.go) because they can hold millions of
// blocks.
package natsplane

import (
	"fmt"
	"regexp"
	"strings"
)

// DefaultNamespace and DefaultComponent name a fleet when nothing else is said.
const (
	DefaultNamespace = "dynamo"
	DefaultComponent = "backend"
)

// Names derives every subject, stream and bucket of one fleet. Fleets with
// different namespaces share a NATS cluster without seeing each other.
type Names struct {
	Namespace string
	Component string
}

var validName = regexp.MustCompile(`^[A-Za-z0-9_-]+$`)

// Validate refuses names NATS would mangle: subjects split on dots and
// bucket names allow only letters, digits, '-' and '_'.
func (n Names) Validate() error {
	if !validName.MatchString(n.Namespace) {
		return fmt.Errorf("natsplane: namespace %q: use letters, digits, '-' and '_'", n.Namespace)
	}
	if !validName.MatchString(n.Component) {
		return fmt.Errorf("natsplane: component %q: use letters, digits, '-' and '_'", n.Component)
	}
	return nil
}

func (n Names) orDefault() Names {
	if n.Namespace == "" {
		n.Namespace = DefaultNamespace
	}
	if n.Component == "" {
		n.Component = DefaultComponent
	}
	return n
}

func (n Names) prefix() string {
	return "namespace." + n.Namespace + ".component." + n.Component
}

// KVEvents is the subject engines' KV events travel on.
func (n Names) KVEvents() string { return n.prefix() + ".kv-events" }

// Recovery is the request/reply subject of one worker's event log.
func (n Names) Recovery(worker uint64) string {
	return fmt.Sprintf("%s.kv-recovery.%d", n.prefix(), worker)
}

// ActiveSequences is the replica-sync subject.
func (n Names) ActiveSequences() string { return n.prefix() + ".active_sequences_events" }

// SessionAffinity is the session-sync subject.
func (n Names) SessionAffinity() string { return n.prefix() + ".session_affinity_events" }

// KVMetrics is the subject of engines' load reports.
func (n Names) KVMetrics() string { return "namespace." + n.Namespace + ".kv_metrics" }

// Stream is the JetStream stream of the durable event plane: the events
// subject slugified, as Dynamo names it.
func (n Names) Stream() string { return strings.ReplaceAll(n.KVEvents(), ".", "-") }

// InstancesBucket is the KV bucket of the discovery leases.
func (n Names) InstancesBucket() string { return n.Namespace + "-instances" }

// InstanceKey is one worker's key in InstancesBucket.
func (n Names) InstanceKey(worker uint64) string {
	return fmt.Sprintf("%s.%d", n.Component, worker)
}

// SnapshotBucket is the object store holding the durable index snapshot.
func (n Names) SnapshotBucket() string { return n.Namespace + "-" + n.Component + "-router-state" }

// LockBucket holds the snapshot writer's lock.
func (n Names) LockBucket() string { return n.Namespace + "-" + n.Component + "-router-locks" }

// SnapshotObject is the snapshot's object name.
const SnapshotObject = "radix-state"
