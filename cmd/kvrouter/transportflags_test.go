package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

// Dynamo's transport choices, given as flags or as the variables Dynamo
// reads, are taken or refused at start with what kvrouter offers.
func TestTransportFlags(t *testing.T) {
	for _, tc := range []struct {
		name    string
		args    []string
		env     map[string]string
		wantErr string // "" = accepted
		notice  string // printed when accepted
		system  string // the system address on host 0.0.0.0
	}{
		{name: "nothing", args: nil},
		{name: "request plane http", args: []string{"--request-plane", "http"}},
		{name: "request plane tcp", env: map[string]string{"DYN_REQUEST_PLANE": "tcp"}, notice: "read as http"},
		{name: "request plane nats", env: map[string]string{"DYN_REQUEST_PLANE": "nats"}, wantErr: "use http or tcp"},
		{name: "request plane other", args: []string{"--request-plane", "quic"}, wantErr: "want http or tcp"},
		{name: "event plane nats", env: map[string]string{"DYN_EVENT_PLANE": "NATS"}},
		{name: "event plane zmq", args: []string{"--event-plane", "zmq"}},
		{name: "event plane other", args: []string{"--event-plane", "kafka"}, wantErr: "want nats or zmq"},
		{name: "static endpoint", args: []string{"--static-endpoint", "dyn://dynamo.backend.generate"}, wantErr: "--worker url="},
		{name: "approximate cache ttl", env: map[string]string{"DYN_ROUTER_APPROXIMATE_CACHE_POLICY": "ttl"}},
		{name: "approximate cache lru", args: []string{"--router-approximate-cache-policy", "lru"}, wantErr: "--router-ttl-secs"},
		{name: "approximate cache other", args: []string{"--router-approximate-cache-policy", "arc"}, wantErr: "want ttl"},
		{name: "tracking hash public", env: map[string]string{"DYN_ROUTER_TRACKING_HASH": "public-xxh3-v1"}},
		{name: "tracking hash keyed", args: []string{"--router-tracking-hash", "keyed-xxh3-v1"}, wantErr: "public-xxh3-v1"},
		{name: "tracking key", env: map[string]string{"DYN_ROUTER_TRACKING_KEY_FILE": "/k", "DYN_ROUTER_TRACKING_KEY_ID": "2026-01"}, wantErr: "keyed-xxh3-v1"},
		{name: "session prefix index", args: []string{"--enable-session-prefix-index"}, wantErr: "session affinity"},
		{name: "session prefix index off", env: map[string]string{"DYN_ENABLE_SESSION_PREFIX_INDEX": "false"}},
		{name: "system port", env: map[string]string{"DYN_SYSTEM_PORT": "8081"}, system: "0.0.0.0:8081"},
		{name: "system port flag", args: []string{"--system-port", "9090"}, system: "0.0.0.0:9090"},
		{name: "system port out of range", args: []string{"--system-port", "70000"}, wantErr: "must be a port"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var tr transportFlags
			parseServeFlags(t, tr.register, tc.args, tc.env)
			var out bytes.Buffer
			err := tr.check(&out)
			if !errorAsWanted(t, err, tc.wantErr) {
				return
			}
			if !strings.Contains(out.String(), tc.notice) {
				t.Errorf("notice %q, want it to contain %q", out.String(), tc.notice)
			}
			if got := tr.systemAddr("0.0.0.0"); got != tc.system {
				t.Errorf("system address %q, want %q", got, tc.system)
			}
		})
	}
}

// --event-plane decides whether serve joins NATS.
func TestEventPlaneDecidesThePlane(t *testing.T) {
	for _, tc := range []struct {
		plane            string
		wanted           bool
		natsURL          string
		workers, dynamic bool
		want             bool
		wantErr          string
	}{
		{plane: "", wanted: false, workers: true, want: false},
		{plane: "", wanted: true, want: true},
		{plane: "nats", wanted: false, workers: true, want: true},
		{plane: "zmq", wanted: true, workers: true, want: false},
		{plane: "zmq", wanted: true, dynamic: true, want: false},
		{plane: "zmq", wanted: true, wantErr: "needs engines"},
		{plane: "zmq", wanted: true, workers: true, natsURL: "nats://x:4222", wantErr: "drop one"},
	} {
		tr := transportFlags{eventPlane: tc.plane}
		got, err := tr.plane(tc.wanted, tc.natsURL, tc.workers, tc.dynamic)
		if tc.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
				t.Errorf("%+v: want an error containing %q, got %v", tc, tc.wantErr, err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("%+v: plane %v (%v), want %v", tc, got, err, tc.want)
		}
	}
}

// The agent and the mocker take --enable-local-indexer (DYN_LOCAL_INDEXER)
// as on, which they are, and refuse it off.
func TestLocalIndexerFlag(t *testing.T) {
	for _, tc := range []struct {
		args    []string
		env     map[string]string
		wantErr bool
	}{
		{},
		{args: []string{"--enable-local-indexer"}},
		{args: []string{"--enable-local-indexer=true"}},
		{args: []string{"--enable-local-indexer=false"}, wantErr: true},
		{env: map[string]string{"DYN_LOCAL_INDEXER": "false"}, wantErr: true},
		{env: map[string]string{"DYN_LOCAL_INDEXER": "true"}},
	} {
		for name, newCmd := range map[string]func() *cobra.Command{"agent": newAgentCmd, "mocker": newMockerCmd} {
			cmd, _, err := parsedCmd(t, newCmd, tc.args...)
			if err != nil {
				t.Fatalf("%s %v: %v", name, tc.args, err)
			}
			if err := applyEnvFrom(cmd.Flags(), lookupIn(tc.env), &bytes.Buffer{}); err != nil {
				t.Fatal(err)
			}
			on, err := cmd.Flags().GetBool("enable-local-indexer")
			if err != nil {
				t.Fatal(err)
			}
			if err := checkLocalIndexer(on); (err != nil) != tc.wantErr {
				t.Errorf("%s %v %v: error %v, want one: %v", name, tc.args, tc.env, err, tc.wantErr)
			}
		}
	}
}

// serve, the agent and the mocker refuse at start what they cannot honour,
// before listening or connecting anywhere.
func TestCommandsRefuseTransportsAtStart(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"serve", "--request-plane", "nats"}, "use http or tcp"},
		{[]string{"serve", "--static-endpoint", "dyn://dynamo.backend.generate"}, "--worker url="},
		{[]string{"serve", "--event-plane", "zmq", "--http-port", "0"}, "needs engines"},
		{[]string{"serve", "--system-port", "-1"}, "must be a port"},
		{[]string{"agent", "--enable-local-indexer=false", "--engine-url", "http://127.0.0.1:1", "--nats-url", "nats://127.0.0.1:1"}, "--enable-local-indexer=false"},
		{[]string{"mocker", "--enable-local-indexer=false"}, "--enable-local-indexer=false"},
	} {
		_, err := runCmd(t, tc.args...)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: want an error containing %q, got %v", tc.args, tc.want, err)
		}
	}
}

// Dynamo's conditional disaggregation policies and their busy thresholds,
// as flags and as DYN_ variables, resolve into the frontend's settings.
func TestConditionalDisaggPolicyFlags(t *testing.T) {
	half, sixteen := 0.5, 16.0
	for _, tc := range []struct {
		name        string
		args        []string
		env         map[string]string
		queue       *float64
		wantErr     string
		policy      string
		prefillBusy float64
		decodeBusy  *float64
	}{
		{name: "default", policy: "isl_bounding"},
		{name: "prefill_load with its threshold", args: []string{"--router-conditional-disagg-policy", "prefill_load", "--router-conditional-disagg-prefill-busy-threshold", "0.5"}, policy: "prefill_load", prefillBusy: 0.5},
		{name: "isl_or_load from the environment", env: map[string]string{"DYN_ROUTER_CONDITIONAL_DISAGG_POLICY": "isl_or_load", "DYN_ROUTER_CONDITIONAL_DISAGG_PREFILL_BUSY_THRESHOLD": "0.5"}, policy: "isl_or_load", prefillBusy: 0.5},
		{name: "prefill threshold falls back on the queue's", args: []string{"--router-conditional-disagg-policy", "prefill_load"}, queue: &sixteen, policy: "prefill_load", prefillBusy: 16},
		{name: "no threshold at all", args: []string{"--router-conditional-disagg-policy", "prefill_load"}, wantErr: "needs a busy threshold"},
		{name: "decode gate", env: map[string]string{"DYN_ROUTER_CONDITIONAL_DISAGG_DECODE_BUSY_THRESHOLD": "0.5"}, policy: "isl_bounding", decodeBusy: &half},
		{name: "decode gate none", args: []string{"--router-conditional-disagg-decode-busy-threshold", "None"}, policy: "isl_bounding"},
		{name: "negative threshold", args: []string{"--router-conditional-disagg-decode-busy-threshold", "-1"}, wantErr: "fraction ≥ 0"},
		{name: "pool policies that are the mode", args: []string{"--router-prefill-policy", "default", "--router-decode-policy", "kv"}, policy: "isl_bounding"},
		{name: "pool policy from the environment", env: map[string]string{"DYN_ROUTER_DECODE_POLICY": "default"}, policy: "isl_bounding"},
		{name: "a pool policy kvrouter lacks", args: []string{"--router-prefill-policy", "round-robin"}, wantErr: "--router-mode (kv now)"},
		{name: "a pool policy kvrouter lacks, from the environment", env: map[string]string{"DYN_ROUTER_DECODE_POLICY": "soft-pin-repin"}, wantErr: "--router-decode-policy"},
		{name: "policy config", args: []string{"--router-policy-config", "p.yaml"}, wantErr: "no YAML policy classes"},
		{name: "unknown policy", args: []string{"--router-conditional-disagg-policy", "cost"}, wantErr: "want isl_bounding, prefill_load or isl_or_load"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var df disaggFlags
			parseServeFlags(t, df.register, tc.args, tc.env)
			d, err := df.config(false, tc.queue, "kv")
			if !errorAsWanted(t, err, tc.wantErr) {
				return
			}
			if d.Policy != tc.policy || d.PrefillBusyThreshold != tc.prefillBusy || (d.DecodeBusyThreshold == nil) != (tc.decodeBusy == nil) || (d.DecodeBusyThreshold != nil && *d.DecodeBusyThreshold != *tc.decodeBusy) {
				t.Errorf("got policy %q prefill %v decode %v, want %q %v %v", d.Policy, d.PrefillBusyThreshold, d.DecodeBusyThreshold, tc.policy, tc.prefillBusy, tc.decodeBusy)
			}
		})
	}
	for _, newCmd := range []func() *cobra.Command{newServeCmd, newUpCmd} {
		for _, n := range []string{"router-conditional-disagg-policy", "router-conditional-disagg-prefill-busy-threshold", "router-conditional-disagg-decode-busy-threshold", "router-prefill-policy", "router-decode-policy", "router-policy-config"} {
			if newCmd().Flags().Lookup(n) == nil {
				t.Errorf("%s has no --%s", newCmd().Name(), n)
			}
		}
	}
}

// --active-prefill-tokens-threshold-frac (DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD_FRAC)
// sets the busy check on a multiple of the worker's batch budget.
func TestPrefillThresholdFrac(t *testing.T) {
	for _, tc := range []struct {
		args    []string
		env     map[string]string
		want    float64 // 0 = off
		wantErr bool
	}{
		{},
		{args: []string{"--active-prefill-tokens-threshold-frac", "1.5"}, want: 1.5},
		{env: map[string]string{"DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD_FRAC": "64"}, want: 64},
		{args: []string{"--active-prefill-tokens-threshold-frac", "None"}},
		{args: []string{"--active-prefill-tokens-threshold-frac", "1e9"}, wantErr: true},
	} {
		rf := newRouterFlags()
		fs := parseServeFlags(t, func(fs *pflag.FlagSet) { rf.register(fs); registerDynamoAliases(fs) }, tc.args, tc.env)
		cfg, err := rf.config(fs, func(string) {})
		if tc.wantErr {
			if err == nil {
				t.Errorf("%v: accepted", tc.args)
			}
			continue
		}
		if err != nil {
			t.Fatalf("%v %v: %v", tc.args, tc.env, err)
		}
		got := 0.0
		if cfg.Busy.ActivePrefillTokensFrac != nil {
			got = *cfg.Busy.ActivePrefillTokensFrac
		}
		if got != tc.want {
			t.Errorf("%v %v: frac %v, want %v", tc.args, tc.env, got, tc.want)
		}
	}
}

// parseServeFlags registers flags on a fresh flag set and reads args,
// then env as the process environment.
func parseServeFlags(t *testing.T, register func(*pflag.FlagSet), args []string, env map[string]string) *pflag.FlagSet {
	t.Helper()
	fs := pflag.NewFlagSet("serve", pflag.ContinueOnError)
	register(fs)
	if err := fs.Parse(args); err != nil {
		t.Fatal(err)
	}
	if err := applyEnvFrom(fs, lookupIn(env), &bytes.Buffer{}); err != nil {
		t.Fatal(err)
	}
	return fs
}

// errorAsWanted fails t unless err contains want (or is nil when want is
// empty) and reports whether the case goes on to check a result.
func errorAsWanted(t *testing.T, err error, want string) bool {
	t.Helper()
	if want != "" {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Fatalf("want an error containing %q, got %v", want, err)
		}
		return false
	}
	if err != nil {
		t.Fatal(err)
	}
	return true
}
