package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"regexp"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/kvrouter/kvrouter/internal/testwait"
)

// flagValues is every flag's value but the aliases', which only mirror
// their targets.
func flagValues(fs *pflag.FlagSet) map[string]string {
	values := map[string]string{}
	fs.VisitAll(func(fl *pflag.Flag) {
		if fl.Deprecated == "" {
			values[fl.Name] = fl.Value.String()
		}
	})
	return values
}

func parsedCmd(t *testing.T, newCmd func() *cobra.Command, args ...string) (*cobra.Command, string, error) {
	t.Helper()
	cmd := newCmd()
	var stderr bytes.Buffer
	cmd.SetOut(&stderr)
	cmd.SetErr(&stderr)
	err := cmd.ParseFlags(args)
	return cmd, stderr.String(), err
}

// nonDefault is a value of the flag's type that differs from the default
// of an unset kvrouter flag.
func nonDefault(t *testing.T, fl *pflag.Flag) string {
	switch fl.Value.Type() {
	case "bool":
		return "true"
	case "float64":
		return "0.5"
	case "int", "uint64":
		return "7"
	case "string":
		return "/etc/kvrouter/x.pem"
	}
	t.Fatalf("--%s: no test value for type %s", fl.Name, fl.Value.Type())
	return ""
}

// Each of Dynamo's spellings sets exactly what kvrouter's flag sets, on
// serve and up, and warns once, naming kvrouter's flag.
func TestDynamoFlagAliases(t *testing.T) {
	for _, c := range []struct {
		name   string
		newCmd func() *cobra.Command
	}{{"serve", newServeCmd}, {"up", newUpCmd}} {
		for _, a := range dynamoFlagAliases {
			t.Run(c.name+"/"+a.name, func(t *testing.T) {
				target := c.newCmd().Flags().Lookup(a.target)
				if target == nil {
					t.Fatalf("%s has no --%s", c.name, a.target)
				}
				want := nonDefault(t, target)
				given := want
				if a.negated {
					b, _ := strconv.ParseBool(want)
					given = strconv.FormatBool(!b)
				}
				ref, refErr, err := parsedCmd(t, c.newCmd, "--"+a.target+"="+want)
				if err != nil || refErr != "" {
					t.Fatalf("--%s=%s: %v %s", a.target, want, err, refErr)
				}
				got, stderr, err := parsedCmd(t, c.newCmd, "--"+a.name+"="+given)
				if err != nil {
					t.Fatalf("--%s=%s: %v", a.name, given, err)
				}
				if g, w := flagValues(got.Flags()), flagValues(ref.Flags()); fmt.Sprint(g) != fmt.Sprint(w) {
					t.Errorf("--%s=%s sets\n%v\nwhere --%s=%s sets\n%v", a.name, given, g, a.target, want, w)
				}
				if !got.Flags().Changed(a.target) {
					t.Errorf("--%s leaves --%s unchanged: DYN_<FLAG> would override it", a.name, a.target)
				}
				if n := strings.Count(stderr, "\n"); n != 1 || !strings.Contains(stderr, "--"+a.name) || !strings.Contains(stderr, "--"+a.target) {
					t.Errorf("want one warning naming --%s and --%s, got %d lines: %q", a.name, a.target, n, stderr)
				}
				if help := got.Flags().FlagUsages(); strings.Contains(help, "--"+a.name+" ") {
					t.Errorf("--%s is listed in --help", a.name)
				}
			})
		}
	}
}

// Boolean aliases take no value, as in Dynamo: --kv-events is
// --no-router-kv-events=false, --no-kv-events is --no-router-kv-events.
func TestDynamoBooleanAliasesWithoutValue(t *testing.T) {
	for args, want := range map[string]string{
		"--no-router-kv-events --kv-events": "false",
		"--router-kv-events":                "false",
		"--no-kv-events":                    "true",
		"--kv-events --no-kv-events":        "true",
	} {
		cmd, _, err := parsedCmd(t, newServeCmd, strings.Fields(args)...)
		if err != nil {
			t.Fatalf("%s: %v", args, err)
		}
		if got := cmd.Flags().Lookup("no-router-kv-events").Value.String(); got != want {
			t.Errorf("%s: --no-router-kv-events=%s, want %s", args, got, want)
		}
	}
}

// Dynamo switches a busy threshold off with None, kvrouter with 0.
func TestThresholdNoneIsOff(t *testing.T) {
	cmd, _, err := parsedCmd(t, newServeCmd, "--active-decode-blocks-threshold", "0.5", "--active-decode-blocks-threshold", "None")
	if err != nil {
		t.Fatal(err)
	}
	if err := applyEnvFrom(cmd.Flags(), lookupIn(map[string]string{"DYN_ACTIVE_PREFILL_TOKENS_THRESHOLD": "none"}), &bytes.Buffer{}); err != nil {
		t.Fatal(err)
	}
	if v := flagValues(cmd.Flags()); v["active-decode-blocks-threshold"] != "0" || v["active-prefill-tokens-threshold"] != "0" {
		t.Errorf("None: %v", v)
	}
	if _, _, err := parsedCmd(t, newServeCmd, "--active-decode-blocks-threshold", "Nothing"); err == nil {
		t.Error("--active-decode-blocks-threshold Nothing accepted")
	}
}

func TestUnknownSpellingsFail(t *testing.T) {
	for _, args := range [][]string{
		{"--router_mode", "kv"}, {"--kv-overlap-weight", "1"}, {"--router-kv-event"},
		{"--no-router-ttl-secs"}, {"--busy_threshold", "0.5"}, {"--kv-events=maybe"},
	} {
		if _, _, err := parsedCmd(t, newServeCmd, args...); err == nil {
			t.Errorf("%v accepted", args)
		}
	}
}

// Dynamo's other environment names set what DYN_<FLAG> sets, and warn
// once.
func TestDynamoEnvAliases(t *testing.T) {
	for _, a := range dynamoEnvAliases {
		t.Run(a.env, func(t *testing.T) {
			// A worker's flag (DYN_LOCAL_INDEXER) is the agent's.
			newCmd := newServeCmd
			if newServeCmd().Flags().Lookup(a.flag) == nil {
				newCmd = newAgentCmd
			}
			fs := newCmd().Flags()
			target := fs.Lookup(a.flag)
			if target == nil {
				t.Fatalf("neither serve nor agent has --%s", a.flag)
			}
			want := nonDefault(t, target)
			given := want
			if a.negated {
				given = "false" // Dynamo's spelling of the positive: DYN_ROUTER_USE_KV_EVENTS=false
			}
			ref := newCmd().Flags()
			if err := applyEnvFrom(ref, lookupIn(map[string]string{envName(a.flag): want}), &bytes.Buffer{}); err != nil {
				t.Fatal(err)
			}
			var warnings bytes.Buffer
			if err := applyEnvFrom(fs, lookupIn(map[string]string{a.env: given}), &warnings); err != nil {
				t.Fatal(err)
			}
			if g, w := flagValues(fs), flagValues(ref); fmt.Sprint(g) != fmt.Sprint(w) {
				t.Errorf("%s=%s sets\n%v\nwhere %s=%s sets\n%v", a.env, given, g, envName(a.flag), want, w)
			}
			if n := strings.Count(warnings.String(), "\n"); n != 1 || !strings.Contains(warnings.String(), a.env) || !strings.Contains(warnings.String(), "--"+a.flag) {
				t.Errorf("want one warning naming %s and --%s, got %q", a.env, a.flag, warnings.String())
			}
		})
	}
}

func lookupIn(env map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) { v, ok := env[k]; return v, ok }
}

// The command line beats the environment whatever the spelling, and
// kvrouter's DYN_<FLAG> beats Dynamo's other names.
func TestDynamoSpellingPrecedence(t *testing.T) {
	ttl := func(args []string, env map[string]string) string {
		t.Helper()
		cmd, _, err := parsedCmd(t, newServeCmd, args...)
		if err != nil {
			t.Fatal(err)
		}
		if err := applyEnvFrom(cmd.Flags(), lookupIn(env), &bytes.Buffer{}); err != nil {
			t.Fatal(err)
		}
		return cmd.Flags().Lookup("router-ttl-secs").Value.String()
	}
	if got := ttl([]string{"--router-ttl", "5"}, map[string]string{"DYN_ROUTER_TTL_SECS": "9"}); got != "5" {
		t.Errorf("--router-ttl 5 with DYN_ROUTER_TTL_SECS=9: %s", got)
	}
	if got := ttl(nil, map[string]string{"DYN_ROUTER_TTL_SECS": "9", "DYN_ROUTER_TTL": "5"}); got != "9" {
		t.Errorf("DYN_ROUTER_TTL_SECS=9 with DYN_ROUTER_TTL=5: %s", got)
	}
	// Booleans read as Dynamo reads them; what it would silently take
	// for false is an error.
	cmd, _, _ := parsedCmd(t, newServeCmd)
	if err := applyEnvFrom(cmd.Flags(), lookupIn(map[string]string{"DYN_ROUTER_REPLICA_SYNC": "yes", "DYN_ROUTER_USE_KV_EVENTS": "off"}), &bytes.Buffer{}); err != nil {
		t.Fatal(err)
	}
	if v := flagValues(cmd.Flags()); v["router-replica-sync"] != "true" || v["no-router-kv-events"] != "true" {
		t.Errorf("yes/off: %v", v)
	}
	cmd, _, _ = parsedCmd(t, newServeCmd)
	if err := applyEnvFrom(cmd.Flags(), lookupIn(map[string]string{"DYN_ROUTER_USE_KV_EVENTS": "maybe"}), &bytes.Buffer{}); err == nil {
		t.Error("DYN_ROUTER_USE_KV_EVENTS=maybe accepted")
	}
}

func TestVersionFlagAndCommand(t *testing.T) {
	flag, err := runCmd(t, "--version")
	if err != nil {
		t.Fatal(err)
	}
	cmd, err := runCmd(t, "version")
	if err != nil || cmd != flag || !strings.HasPrefix(cmd, "kvrouter ") || !strings.Contains(cmd, runtime.Version()) {
		t.Errorf("--version %q, version %q, %v", flag, cmd, err)
	}

	bi := &debug.BuildInfo{Main: debug.Module{Version: "v1.4.0"}, Settings: []debug.BuildSetting{
		{Key: "vcs.revision", Value: "0123456789abcdef0123"}, {Key: "vcs.modified", Value: "true"},
	}}
	want := "kvrouter v1.4.0 (0123456789ab-dirty) go1.99 " + runtime.GOOS + "/" + runtime.GOARCH
	if got := describeVersion("dev", bi, "go1.99"); got != want {
		t.Errorf("module version and dirty revision: %q, want %q", got, want)
	}
	bi.Main.Version, bi.Settings[1].Value = "(devel)", "false"
	if got := describeVersion("v2.0.0", bi, "go1.99"); !strings.HasPrefix(got, "kvrouter v2.0.0 (0123456789ab) go1.99") {
		t.Errorf("linked version and clean revision: %q", got)
	}
	bi.Main.Version = "v0.0.0-20261124135139-0123456789ab+dirty"
	if got := describeVersion("dev", bi, "go1.99"); !strings.HasPrefix(got, "kvrouter dev (0123456789ab) go1.99") {
		t.Errorf("pseudo-version of a checkout: %q", got)
	}
	if got := describeVersion("dev", nil, "go1.99"); !strings.HasPrefix(got, "kvrouter dev go1.99") {
		t.Errorf("no build info: %q", got)
	}
}

// up starts its engines and its router with one block size: Dynamo's
// --kv-cache-block-size sets it as --block-size does, and the two may not
// disagree.
func TestUpBlockSizeByEitherName(t *testing.T) {
	t.Setenv("NATS_SERVER", "")
	out, stop := startCmd(t, "up", "--http-port", "0", "--workers", "1", "--kv-cache-block-size", "32", "--block-size", "16")
	testwait.Until(t, 20*time.Second, "up has started or failed", func() bool {
		return strings.Contains(out.String(), "kvrouter up:") || strings.Contains(out.String(), "Error:")
	})
	if err := stop(); err == nil || !strings.Contains(err.Error(), "--kv-cache-block-size 32 and --block-size 16 differ") {
		t.Errorf("conflicting block sizes: %v\n%s", err, out.String())
	}

	out, stop = startCmd(t, "up", "--http-port", "0", "--workers", "1", "--kv-cache-block-size", "32")
	models := regexp.MustCompile(`requests to (http://\S+) `)
	testwait.Until(t, 20*time.Second, "up is serving", func() bool { return models.MatchString(out.String()) })
	url := models.FindStringSubmatch(out.String())[1]
	// 40 token ids: one full block of 32, where 16-token blocks would make two.
	body := `{"model": "kvrouter-mock", "tokens": [` + strings.TrimSuffix(strings.Repeat("7, ", 40), ", ") + `]}`
	resp, err := http.Post(url+"/router/best_worker", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var got struct {
		PromptBlocks int `json:"prompt_blocks"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&got); err != nil || got.PromptBlocks != 1 {
		t.Errorf("--kv-cache-block-size 32: a 40-token prompt has %d blocks (%v), want 1", got.PromptBlocks, err)
	}
	if err := stop(); err != nil {
		t.Errorf("up: %v\n%s", err, out.String())
	}
}

// Dynamo's conditional-disaggregation flags set kvrouter's where the
// meaning is the same.
func TestDynamoConditionalDisaggFlags(t *testing.T) {
	for _, newCmd := range []func() *cobra.Command{newServeCmd, newUpCmd} {
		for args, want := range map[string]string{
			"--router-conditional-disagg-eff-isl-threshold=2048":                            "2048",
			"--router-conditional-disagg":                                                   strconv.Itoa(defaultDisaggMinUncachedTokens),
			"--router-conditional-disagg=false":                                             "0",
			"--router-conditional-disagg-policy=isl_bounding":                               strconv.Itoa(defaultDisaggMinUncachedTokens),
			"--router-conditional-disagg --router-conditional-disagg-eff-isl-threshold=100": "100",
		} {
			cmd, _, err := parsedCmd(t, newCmd, strings.Fields(args)...)
			if err != nil {
				t.Fatalf("%s: %v", args, err)
			}
			if got := cmd.Flags().Lookup("disagg-min-uncached-tokens").Value.String(); got != want {
				t.Errorf("%s %s: --disagg-min-uncached-tokens %s, want %s", cmd.Name(), args, got, want)
			}
		}
	}
}

func TestDynamoDisaggAndStartFlags(t *testing.T) {
	for _, newCmd := range []func() *cobra.Command{newServeCmd, newUpCmd} {
		for _, tc := range []struct{ args, flag, want string }{
			{"--enforce-disagg", "enforce-disagg", "true"},
			{"--decode-fallback", "enforce-disagg", "false"},
			{"--decode-fallback=false", "enforce-disagg", "true"},
			{"--router-conditional-disagg-eff-isl-ratio-threshold=0.25", "router-conditional-disagg-eff-isl-ratio-threshold", "0.25"},
			{"--router-min-initial-workers=3", "router-min-initial-workers", "3"},
			{"--router-session-affinity-mode=soft", "router-session-affinity-mode", "soft"},
		} {
			cmd, _, err := parsedCmd(t, newCmd, strings.Fields(tc.args)...)
			if err != nil {
				t.Fatalf("%s: %v", tc.args, err)
			}
			if got := cmd.Flags().Lookup(tc.flag).Value.String(); got != tc.want {
				t.Errorf("%s %s: --%s %s, want %s", cmd.Name(), tc.args, tc.flag, got, tc.want)
			}
		}
	}
	d := disaggFlags{minUncached: 1, prefillTimeout: time.Second, maxRatio: 1.5, policy: "isl_bounding"}
	if _, err := d.config(false, nil, "kv"); err == nil || !strings.Contains(err.Error(), "ratio-threshold") {
		t.Errorf("a ratio above 1: %v", err)
	}
	l := limitFlags{minInitialWorkers: -1}
	if err := l.check(); err == nil || !strings.Contains(err.Error(), "min-initial-workers") {
		t.Errorf("a negative minimum of workers: %v", err)
	}
}
