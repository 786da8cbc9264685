package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spf13/pflag"

	"github.com/kvrouter/kvrouter/adapters/natsplane"
	"github.com/kvrouter/kvrouter/internal/testwait"
)

// startCmd runs a long-lived command; stop (at the latest when the test
// ends) cancels it and returns its result.
func startCmd(t *testing.T, args ...string) (out *testwait.Buffer, stop func() error) {
	t.Helper()
	out = &testwait.Buffer{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		root := newRootCmd()
		root.SetOut(out)
		root.SetErr(out)
		root.SetArgs(args)
		done <- root.ExecuteContext(ctx)
	}()
	var once sync.Once
	var err error
	stop = func() error {
		once.Do(func() {
			cancel()
			err = <-done
		})
		return err
	}
	t.Cleanup(func() { _ = stop() })
	return out, stop
}

// A router whose embedded NATS listens beyond loopback requires the token
// it generated: an agent without it cannot put an engine in routing (and so
// never receives a prompt); with it, it can. The clean stop afterwards does
// not warn about a lost NATS connection.
func TestServeEmbeddedNATSBeyondLoopbackKeepsRogueAgentsOut(t *testing.T) {
	for _, env := range []string{"NATS_SERVER", "NATS_URL", "NATS_AUTH_TOKEN", "NATS_USER", "NATS_AUTH_USERNAME", "DYN_NATS_TOKEN"} {
		t.Setenv(env, "")
		os.Unsetenv(env)
	}
	cfg, e := mockEngine(t)

	store := t.TempDir()
	serveOut, stopServe := startCmd(t, "serve", "--http-host", "127.0.0.1", "--http-port", "0",
		"--nats-host", "0.0.0.0", "--nats-port", "0", "--nats-store-dir", store, "--namespace", "secured", "--lease-ttl", "2s")
	serving := regexp.MustCompile(`serving on (http://\S+) .* on NATS nats://0\.0\.0\.0:(\d+),`)
	testwait.Until(t, 10*time.Second, "serve to start", func() bool { return serving.MatchString(serveOut.String()) })
	m := serving.FindStringSubmatch(serveOut.String())
	frontend, natsURL := m[1], "nats://127.0.0.1:"+m[2]

	tokenFile := filepath.Join(store, "nats-token")
	info, err := os.Stat(tokenFile)
	if err != nil {
		t.Fatalf("no token file: %v\n%s", err, serveOut.String())
	}
	if info.Mode().Perm() != 0o600 {
		t.Fatalf("token file mode %v, want 0600", info.Mode().Perm())
	}
	token, err := os.ReadFile(tokenFile)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(serveOut.String(), strings.TrimSpace(string(token))) {
		t.Fatal("serve printed the token")
	}

	agentArgs := []string{"agent", "--nats-url", natsURL, "--namespace", "secured", "--lease-ttl", "2s",
		"--engine-url", e.HTTPURL, "--events", e.Ranks[0].Events, "--replay", e.Ranks[0].Replay, "--model", cfg.Server.Model}
	for _, rogue := range [][]string{nil, {"--nats-token", "guess"}} {
		if _, err := runCmd(t, append(agentArgs, rogue...)...); err == nil || !strings.Contains(err.Error(), "Authorization Violation") {
			t.Fatalf("agent %v: want an authorization error, got %v", rogue, err)
		}
	}
	complete := func() int {
		body, _ := json.Marshal(map[string]any{"model": cfg.Server.Model, "prompt": "who holds my prompt?", "max_tokens": 2})
		resp, err := http.Post(frontend+"/v1/completions", "application/json", bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if code := complete(); code == http.StatusOK {
		t.Fatal("routed a request although no agent got in")
	}

	t.Setenv("NATS_AUTH_TOKEN", strings.TrimSpace(string(token)))
	agentOut, stopAgent := startCmd(t, agentArgs...)
	testwait.Until(t, 10*time.Second, "the credentialed engine in routing", func() bool { return complete() == http.StatusOK })
	if err := stopAgent(); err != nil {
		t.Fatalf("agent: %v\n%s", err, agentOut.String())
	}
	if err := stopServe(); err != nil {
		t.Fatalf("serve: %v\n%s", err, serveOut.String())
	}
	for _, out := range []string{agentOut.String(), serveOut.String()} {
		if strings.Contains(out, "connection lost") {
			t.Errorf("a clean stop warned about a lost NATS connection:\n%s", out)
		}
	}
}

// NATS settings come from the flag, then DYN_<FLAG>, then Dynamo's
// variables, then the nats CLI's.
func TestNATSSettingsFromTheEnvironment(t *testing.T) {
	for env, v := range map[string]string{
		"NATS_SERVER": "nats://dynamo:4222", "NATS_URL": "nats://cli:4222",
		"NATS_AUTH_USERNAME": "dynamo-user", "NATS_USER": "cli-user", "NATS_PASSWORD": "cli-pw",
		"NATS_CREDS": "/cli.creds", "NATS_NKEY": "/cli.nk", "NATS_TLS_CA_CERT_PATH": "/dynamo-ca.pem", "NATS_CA": "/cli-ca.pem",
		"NATS_CERT": "/cli-cert.pem", "NATS_TLS_CLIENT_KEY_PATH": "/dynamo-key.pem", "NATS_AUTH_TOKEN": "",
		"DYN_NATS_TOKEN": "dyn-token",
	} {
		t.Setenv(env, v)
	}
	var pf planeFlags
	fs := pflag.NewFlagSet("agent", pflag.ContinueOnError)
	pf.register(fs, false, 0)
	if err := fs.Parse([]string{"--nats-password", "flag-pw"}); err != nil {
		t.Fatal(err)
	}
	if err := applyEnv(fs); err != nil {
		t.Fatal(err)
	}
	want := natsplane.Auth{
		Token: "dyn-token", User: "dynamo-user", Password: "flag-pw", CredsFile: "/cli.creds", NkeySeedFile: "/cli.nk",
		TLSCA: "/dynamo-ca.pem", TLSCert: "/cli-cert.pem", TLSKey: "/dynamo-key.pem",
	}
	if pf.natsURL != "nats://dynamo:4222" || pf.auth != want {
		t.Fatalf("got %q %+v\nwant %q %+v", pf.natsURL, pf.auth, "nats://dynamo:4222", want)
	}
}

func TestServeRefusesClientOnlySecurityForTheEmbeddedServer(t *testing.T) {
	t.Setenv("NATS_SERVER", "")
	_, err := runCmd(t, "serve", "--http-port", "0", "--nats-port", "0", "--nats-creds", "/nonexistent.creds")
	if err == nil || !strings.Contains(err.Error(), "--nats-url") {
		t.Fatalf("want an error naming --nats-url, got %v", err)
	}
}

// up's own agents use the token of an embedded server that listens beyond
// loopback: every engine joins routing.
func TestUpWithEmbeddedNATSBeyondLoopback(t *testing.T) {
	for _, env := range []string{"NATS_SERVER", "NATS_URL", "NATS_AUTH_TOKEN"} {
		t.Setenv(env, "")
		os.Unsetenv(env)
	}
	out, stop := startCmd(t, "up", "--workers", "2", "--http-port", "0", "--nats-host", "0.0.0.0", "--nats-store-dir", t.TempDir())
	testwait.Until(t, 20*time.Second, "up to report its engines in routing", func() bool {
		return strings.Contains(out.String(), "Send OpenAI requests")
	})
	if err := stop(); err != nil {
		t.Fatalf("up: %v\n%s", err, out.String())
	}
	if !strings.Contains(out.String(), "requires a token") {
		t.Fatalf("up did not say where its NATS token is:\n%s", out.String())
	}
}
