package main

import (
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"

	"github.com/spf13/pflag"
)

// transportFlags are Dynamo's choices of how requests, events and
// metrics travel, read as what kvrouter does with each. Dynamo launch
// scripts set them (often through DYN_REQUEST_PLANE and DYN_SYSTEM_PORT);
// a value kvrouter cannot honour stops the start with what it offers
// instead, never silently.
type transportFlags struct {
	requestPlane   string
	eventPlane     string
	staticEndpoint string
	systemPort     int
	approxPolicy   string
	trackingHash   string
	trackingKey    [2]string // --router-tracking-key-file, --router-tracking-key-id
	sessionIndex   bool
}

func (f *transportFlags) register(fs *pflag.FlagSet) {
	fs.StringVar(&f.requestPlane, "request-plane", "", "Dynamo's request transport: http or tcp (kvrouter sends requests to the engines' HTTP API either way); nats is refused")
	fs.StringVar(&f.eventPlane, "event-plane", "", "how KV events arrive: nats (the NATS plane, joined or embedded even with only --worker engines), zmq (only the engines' own ZMQ sockets, no NATS); unset: both")
	fs.StringVar(&f.staticEndpoint, "static-endpoint", "", "Dynamo's static endpoint; kvrouter's static engines are --worker url=...,events=... (refused with that advice)")
	fs.StringVar(&f.approxPolicy, "router-approximate-cache-policy", "ttl", "how the approximate index (--no-router-kv-events) forgets blocks: ttl (--router-ttl-secs, bounded by --router-max-tree-size); Dynamo's experimental lru is refused")
	fs.StringVar(&f.trackingHash, "router-tracking-hash", "public-xxh3-v1", "how request identities are hashed: public-xxh3-v1 (Dynamo's default); Dynamo's experimental keyed-xxh3-v1 is refused")
	fs.StringVar(&f.trackingKey[0], "router-tracking-key-file", "", "keyed-xxh3-v1's key file; refused (kvrouter has no keyed hashing)")
	fs.StringVar(&f.trackingKey[1], "router-tracking-key-id", "", "keyed-xxh3-v1's key epoch; refused (kvrouter has no keyed hashing)")
	fs.BoolVar(&f.sessionIndex, "enable-session-prefix-index", false, "Dynamo's per-session prefix index; refused (sessions stay on their engine by session affinity)")
	fs.IntVar(&f.systemPort, "system-port", 0, "also serve /metrics, /health, /live and /ready on this port of --http-host, apart from the request port (Dynamo's DYN_SYSTEM_PORT; 0: off)")
}

// check validates the flags and says on w how a Dynamo value is read.
func (f *transportFlags) check(w io.Writer) error {
	switch strings.ToLower(strings.TrimSpace(f.requestPlane)) {
	case "", "http":
	case "tcp":
		fmt.Fprintln(w, "kvrouter: request plane tcp (Dynamo's default) is read as http: kvrouter sends requests to the engines' OpenAI HTTP API, over TCP")
	case "nats":
		return fmt.Errorf("--request-plane (DYN_REQUEST_PLANE) nats: kvrouter sends requests to the engines' OpenAI HTTP API only; use http or tcp (KV events may still use NATS: --event-plane nats)")
	default:
		return fmt.Errorf("--request-plane (DYN_REQUEST_PLANE) %q: want http or tcp (nats is not supported)", f.requestPlane)
	}
	switch f.eventPlane = strings.ToLower(strings.TrimSpace(f.eventPlane)); f.eventPlane {
	case "", "nats", "zmq":
	default:
		return fmt.Errorf("--event-plane (DYN_EVENT_PLANE) %q: want nats or zmq", f.eventPlane)
	}
	switch strings.ToLower(strings.TrimSpace(f.approxPolicy)) {
	case "", "ttl":
	case "lru":
		return fmt.Errorf("--router-approximate-cache-policy lru: kvrouter's approximate index forgets blocks by age only: --router-ttl-secs, bounded by --router-max-tree-size and --router-prune-target-ratio; give ttl")
	default:
		return fmt.Errorf("--router-approximate-cache-policy %q: want ttl", f.approxPolicy)
	}
	if h := strings.TrimSpace(f.trackingHash); h != "" && h != "public-xxh3-v1" {
		return fmt.Errorf("--router-tracking-hash %q: kvrouter hashes request identities with public XXH3 only; give public-xxh3-v1", f.trackingHash)
	}
	if f.trackingKey != [2]string{} {
		return fmt.Errorf("--router-tracking-key-file and --router-tracking-key-id key Dynamo's keyed-xxh3-v1, which kvrouter does not have: its identities are public XXH3 (--router-tracking-hash public-xxh3-v1)")
	}
	if f.sessionIndex {
		return fmt.Errorf("--enable-session-prefix-index: kvrouter keeps no per-session prefix index; a session's turns stay on their engine by session affinity (nvext.session_control, X-Dynamo-Session-ID, --router-session-affinity-mode), and their prefix is found in the KV index")
	}
	if f.staticEndpoint != "" {
		return fmt.Errorf("--static-endpoint %q: a Dynamo endpoint path names no address; give kvrouter the engine itself, --worker url=http://HOST:PORT,events=tcp://HOST:5557 (static engines, KV routing included)", f.staticEndpoint)
	}
	if f.systemPort < 0 || f.systemPort > 65535 {
		return fmt.Errorf("--system-port (DYN_SYSTEM_PORT) must be a port (1-65535, or 0 for none), got %d", f.systemPort)
	}
	return nil
}

// systemAddr is the system port's listen address, "" without one.
func (f *transportFlags) systemAddr(host string) string {
	if f.systemPort == 0 {
		return ""
	}
	return net.JoinHostPort(host, strconv.Itoa(f.systemPort))
}

// plane decides whether serve joins NATS given --event-plane: nats always
// does; zmq never does and needs engines whose sockets it reads; unset
// keeps wantsPlane's choice.
func (f *transportFlags) plane(wanted bool, natsURL string, workers, dynamic bool) (bool, error) {
	switch f.eventPlane {
	case "nats":
		return true, nil
	case "zmq":
		if natsURL != "" {
			return false, fmt.Errorf("--event-plane zmq reads KV events from the engines' ZMQ sockets only, but --nats-url (or NATS_SERVER) asks for the NATS plane; drop one")
		}
		if !workers && !dynamic {
			return false, fmt.Errorf("--event-plane zmq needs engines whose ZMQ sockets to read: --worker url=...,events=tcp://HOST:5557, --config or --discovery kubernetes")
		}
		return false, nil
	}
	return wanted, nil
}

// registerLocalIndexer is Dynamo's --enable-local-indexer (DYN_LOCAL_INDEXER)
// on a worker: the worker keeps its own KV state so that routers recover
// from it after a gap or when they start. kvrouter's agent and mocker always
// do (numbered events, replay, and the mocker's /kv_events/dump), so true
// is what they do and false, which would leave routers nothing to recover
// from, is refused.
func registerLocalIndexer(fs *pflag.FlagSet, on *bool) {
	fs.BoolVar(on, "enable-local-indexer", true, "Dynamo's worker-local KV indexer: always on here (routers recover from the worker's numbered, replayable events); false is refused")
}

func checkLocalIndexer(on bool) error {
	if !on {
		return fmt.Errorf("--enable-local-indexer=false (DYN_LOCAL_INDEXER): kvrouter's workers always keep their KV events for routers to recover from; without it a router's index would drift after any lost message. For events that outlive the worker, use serve's --router-durable-kv-events")
	}
	return nil
}
