package main

import (
	"fmt"
	"io"
	"strconv"
	"strings"

	"github.com/spf13/pflag"
)

// Dynamo has renamed its router flags over its releases (--kv-events,
// --router-kv-events, --no-router-kv-events) and spells some of them as
// the positive of a boolean kvrouter spells as its negation. Its
// operators' launch scripts carry every generation, so kvrouter reads
// them all, each mapped onto its own flag, and says so once on use. The
// table in docs/dynamo-compat.md lists these, the names kvrouter shares
// with Dynamo and those it has no use for.

// flagAlias is a spelling of kvrouter's flag target. A negated alias is
// the boolean of the opposite sense: --kv-events=X is
// --no-router-kv-events=!X.
type flagAlias struct {
	name, target string
	negated      bool
}

var dynamoFlagAliases = []flagAlias{
	{name: "kv-overlap-score-weight", target: "router-kv-overlap-score-weight"},
	{name: "router-ttl", target: "router-ttl-secs"},
	{name: "busy-threshold", target: "active-decode-blocks-threshold"},
	{name: "no-kv-events", target: "no-router-kv-events"},
	{name: "kv-events", target: "no-router-kv-events", negated: true},
	{name: "router-kv-events", target: "no-router-kv-events", negated: true},
	{name: "no-track-active-blocks", target: "no-router-track-active-blocks"},
	{name: "track-active-blocks", target: "no-router-track-active-blocks", negated: true},
	{name: "router-track-active-blocks", target: "no-router-track-active-blocks", negated: true},
	{name: "no-assume-kv-reuse", target: "no-router-assume-kv-reuse"},
	{name: "assume-kv-reuse", target: "no-router-assume-kv-reuse", negated: true},
	{name: "router-assume-kv-reuse", target: "no-router-assume-kv-reuse", negated: true},
	{name: "router-track-prefill-tokens", target: "no-router-track-prefill-tokens", negated: true},
	{name: "track-output-blocks", target: "router-track-output-blocks"},
	{name: "no-track-output-blocks", target: "router-track-output-blocks", negated: true},
	{name: "no-router-track-output-blocks", target: "router-track-output-blocks", negated: true},
	{name: "no-router-replica-sync", target: "router-replica-sync", negated: true},
	{name: "no-router-durable-kv-events", target: "router-durable-kv-events", negated: true},
	{name: "no-load-aware", target: "load-aware", negated: true},
	{name: "tls-cert-path", target: "tls-cert-file"},
	{name: "tls-key-path", target: "tls-key-file"},
	{name: "port", target: "http-port"},
	// Dynamo's isl_bounding policy bypasses the prefill worker when the
	// decode worker lacks fewer than this many tokens, as kvrouter's flag
	// does (Dynamo also requires the uncached share below a ratio).
	{name: "router-conditional-disagg-eff-isl-threshold", target: "disagg-min-uncached-tokens"},
	// Falling back to the decode worker when no prefill worker can take a
	// request is the opposite of enforcing disaggregation.
	{name: "decode-fallback", target: "enforce-disagg", negated: true},
}

// envAlias is an environment variable Dynamo reads for kvrouter's flag
// (whose own variable is DYN_<FLAG>).
type envAlias struct {
	env, flag string
	negated   bool
}

var dynamoEnvAliases = []envAlias{
	{env: "DYN_OVERLAP_SCORE_WEIGHT", flag: "router-kv-overlap-score-weight"},
	{env: "DYN_KV_OVERLAP_SCORE_WEIGHT", flag: "router-kv-overlap-score-weight"},
	{env: "DYN_ROUTER_TTL", flag: "router-ttl-secs"},
	{env: "DYN_ROUTER_USE_KV_EVENTS", flag: "no-router-kv-events", negated: true},
	{env: "DYN_KV_EVENTS", flag: "no-router-kv-events", negated: true},
	{env: "DYN_ROUTER_TRACK_ACTIVE_BLOCKS", flag: "no-router-track-active-blocks", negated: true},
	{env: "DYN_ROUTER_ASSUME_KV_REUSE", flag: "no-router-assume-kv-reuse", negated: true},
	{env: "DYN_ROUTER_TRACK_PREFILL_TOKENS", flag: "no-router-track-prefill-tokens", negated: true},
	{env: "DYN_ROUTER_LOAD_AWARE", flag: "load-aware"},
	{env: "DYN_TLS_CERT_PATH", flag: "tls-cert-file"},
	{env: "DYN_TLS_KEY_PATH", flag: "tls-key-file"},
	{env: "DYN_LOCAL_INDEXER", flag: "enable-local-indexer"},
}

// offByNone are the flags whose 0 switches a check off, which Dynamo
// spells None.
var offByNone = []string{"active-decode-blocks-threshold", "active-prefill-tokens-threshold", "active-prefill-tokens-threshold-frac"}

// registerDynamoAliases adds Dynamo's spellings of the flags fs has,
// after they are registered. They stay out of --help; pflag's deprecation
// notice names kvrouter's flag on every use.
func registerDynamoAliases(fs *pflag.FlagSet) {
	for _, name := range offByNone {
		if fl := fs.Lookup(name); fl != nil {
			fl.Value = noneMeansOff{fl.Value}
		}
	}
	if target := fs.Lookup("disagg-min-uncached-tokens"); target != nil {
		registerConditionalDisagg(fs, target)
	}
	for _, a := range dynamoFlagAliases {
		target := fs.Lookup(a.target)
		if target == nil {
			continue
		}
		alias := fs.VarPF(&aliasValue{target: target, negated: a.negated}, a.name, "", "Dynamo's spelling of --"+a.target)
		alias.NoOptDefVal = target.NoOptDefVal
		use := "use --" + a.target
		if a.negated {
			use += " with the opposite value"
		}
		_ = fs.MarkDeprecated(a.name, use+" (Dynamo's spelling, read as that)")
	}
}

// registerConditionalDisagg takes Dynamo's switch of conditional
// disaggregation, which kvrouter does by default: on leaves
// --disagg-min-uncached-tokens as it is, off sets it to 0 (always
// disaggregate, Dynamo's default).
func registerConditionalDisagg(fs *pflag.FlagSet, minUncached *pflag.Flag) {
	on := fs.VarPF(&conditionalDisagg{target: minUncached}, "router-conditional-disagg", "", "Dynamo's switch of conditional disaggregation")
	on.NoOptDefVal = "true"
	_ = fs.MarkDeprecated("router-conditional-disagg", "kvrouter disaggregates conditionally by default (--disagg-min-uncached-tokens; false sets it to 0); read as that")
}

type conditionalDisagg struct {
	target *pflag.Flag
	on     bool
}

func (v *conditionalDisagg) Set(s string) error {
	b, err := parseDynamoBool(s)
	if err != nil {
		return err
	}
	v.on = b
	if !b {
		v.target.Changed = true
		return v.target.Value.Set("0")
	}
	return nil
}

func (v *conditionalDisagg) String() string { return strconv.FormatBool(v != nil && v.on) }
func (v *conditionalDisagg) Type() string   { return "bool" }

// aliasValue writes through to the target flag and marks it set, so that
// DYN_<TARGET> does not override what the command line said.
type aliasValue struct {
	target  *pflag.Flag
	negated bool
}

func (v *aliasValue) Set(s string) error {
	if v.negated {
		b, err := parseDynamoBool(s)
		if err != nil {
			return err
		}
		s = strconv.FormatBool(!b)
	}
	if err := v.target.Value.Set(s); err != nil {
		return err
	}
	v.target.Changed = true
	return nil
}

func (v *aliasValue) String() string {
	if v.target == nil {
		return ""
	}
	s := v.target.Value.String()
	if b, err := strconv.ParseBool(s); err == nil && v.negated {
		return strconv.FormatBool(!b)
	}
	return s
}

func (v *aliasValue) Type() string { return v.target.Value.Type() }

// noneMeansOff takes Dynamo's None (or null) for 0, off.
type noneMeansOff struct{ pflag.Value }

func (v noneMeansOff) Set(s string) error {
	if t := strings.TrimSpace(s); strings.EqualFold(t, "none") || strings.EqualFold(t, "null") {
		s = "0"
	}
	return v.Value.Set(s)
}

// parseDynamoBool reads a boolean as Dynamo's environment does (true, 1,
// yes, on) and also their opposites; anything else is an error rather
// than Dynamo's silent false.
func parseDynamoBool(s string) (bool, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "1", "t", "true", "yes", "y", "on":
		return true, nil
	case "0", "f", "false", "no", "n", "off":
		return false, nil
	}
	return false, fmt.Errorf("%q is not a boolean (true/false, 1/0, yes/no, on/off)", s)
}

// applyDynamoEnv sets the flags the command line and DYN_<FLAG> left unset
// from the variables Dynamo reads under other names, and says so on w.
func applyDynamoEnv(fs *pflag.FlagSet, lookup func(string) (string, bool), w io.Writer) error {
	for _, a := range dynamoEnvAliases {
		fl := fs.Lookup(a.flag)
		if fl == nil || fl.Changed {
			continue
		}
		v, ok := lookup(a.env)
		if !ok {
			continue
		}
		if a.negated || fl.Value.Type() == "bool" {
			b, err := parseDynamoBool(v)
			if err != nil {
				return fmt.Errorf("%s: %w", a.env, err)
			}
			v = strconv.FormatBool(b != a.negated)
		}
		if err := fs.Set(a.flag, v); err != nil {
			return fmt.Errorf("%s=%q: %w", a.env, v, err)
		}
		if a.env != envName(a.flag) {
			how := ""
			if a.negated {
				how = " with the opposite value"
			}
			fmt.Fprintf(w, "kvrouter: %s is Dynamo's name of %s (--%s)%s; read as that\n", a.env, envName(a.flag), a.flag, how)
		}
	}
	return nil
}

// envName is the variable kvrouter reads for a flag: DYN_<FLAG>.
func envName(flag string) string {
	return "DYN_" + strings.ToUpper(strings.ReplaceAll(flag, "-", "_"))
}
