package main

import (
	"bufio"
	"context"
	"net/http"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/testwait"
	"github.com/kvrouter/kvrouter/mocker/fleet"
)

// mockEngine starts one simulated engine at the modelled speed on free
// ports of 127.0.0.1.
func mockEngine(t *testing.T) (fleet.Config, fleet.Engine) {
	t.Helper()
	cfg := fleet.DefaultConfig()
	cfg.HTTPPort, cfg.KVEventsPort, cfg.KVEventsReplayPort = 0, 0, 0
	f, err := fleet.Start(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.Close)
	return cfg, f.Engines()[0]
}

// SIGTERM drains serve: a stream that ends within --shutdown-timeout ends
// normally, one that does not gets an error event and [DONE], the command
// returns without error, and the clean stop logs no lost NATS connection.
func TestServeDrainsOnSIGTERM(t *testing.T) {
	t.Setenv("NATS_SERVER", "")
	cfg, e := mockEngine(t)
	stderr := drainOnSIGTERM(t, regexp.MustCompile(`serving on (http://\S+)`), cfg.Server.Model,
		"serve", "--http-host", "127.0.0.1", "--http-port", "0", "--nats-port", "0", "--shutdown-timeout", "1",
		"--worker", "url="+e.HTTPURL+",events="+e.Ranks[0].Events+",replay="+e.Ranks[0].Replay+",model="+cfg.Server.Model)
	if strings.Contains(stderr, "NATS connection lost") {
		t.Fatalf("a clean stop logged a lost NATS connection:\n%s", stderr)
	}
}

// up drains the same way, its engines deregistered first, and logs no
// warning but the streams it had to cut.
func TestUpDrainsOnSIGTERM(t *testing.T) {
	t.Setenv("NATS_SERVER", "")
	stderr := drainOnSIGTERM(t, regexp.MustCompile(`requests to (http://\S+) `), "kvrouter-mock",
		"up", "--http-port", "0", "--workers", "1", "--shutdown-timeout", "1")
	for _, line := range strings.Split(strings.TrimSpace(stderr), "\n") {
		if strings.Contains(line, "level=WARN") && !strings.Contains(line, "requests still in flight") {
			t.Errorf("a clean stop warned: %s", line)
		}
	}
}

// drainOnSIGTERM runs the command until it serves on the URL servingOn
// finds, opens a short and a long stream, sends SIGTERM, checks that the
// command returns nil and how each stream ended, and returns the log.
func drainOnSIGTERM(t *testing.T, servingOn *regexp.Regexp, model string, args ...string) string {
	t.Helper()
	var out, errOut testwait.Buffer
	done := make(chan error, 1)
	go func() {
		root := newRootCmd()
		root.SetOut(&out)
		root.SetErr(&errOut)
		root.SetArgs(args)
		done <- root.Execute()
	}()
	testwait.Until(t, 20*time.Second, "the frontend is up", func() bool { return servingOn.MatchString(out.String()) })
	url := servingOn.FindStringSubmatch(out.String())[1]
	testwait.Until(t, 20*time.Second, "the frontend is ready", func() bool {
		resp, err := http.Get(url + "/ready")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})

	type result struct {
		data []string
		err  error
	}
	stream := func(maxTokens string, started chan<- struct{}, res chan<- result) {
		body := `{"model":"` + model + `","prompt":[1,2,3,4,5,6,7,8],"stream":true,"ignore_eos":true,"max_tokens":` + maxTokens + `}`
		resp, err := http.Post(url+"/v1/completions", "application/json", strings.NewReader(body))
		if err != nil {
			close(started)
			res <- result{err: err}
			return
		}
		defer resp.Body.Close()
		var r result
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			if v, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
				if len(r.data) == 0 {
					close(started)
				}
				r.data = append(r.data, v)
			}
		}
		if len(r.data) == 0 {
			close(started)
		}
		r.err = sc.Err()
		res <- r
	}
	shortStarted, longStarted := make(chan struct{}), make(chan struct{})
	shortRes, longRes := make(chan result, 1), make(chan result, 1)
	go stream("20", shortStarted, shortRes)
	go stream("100000", longStarted, longRes)
	<-shortStarted
	<-longStarted

	if err := syscall.Kill(syscall.Getpid(), syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("%s returned %v after SIGTERM", args[0], err)
		}
	case <-time.After(15 * time.Second):
		t.Fatalf("%s did not stop after SIGTERM", args[0])
	}
	short, long := <-shortRes, <-longRes
	if n := len(short.data); short.err != nil || n < 2 || short.data[n-1] != "[DONE]" || strings.Contains(short.data[n-2], `"error"`) {
		t.Fatalf("short stream: %v %q", short.err, short.data)
	}
	if n := len(long.data); long.err != nil || n < 2 || long.data[n-1] != "[DONE]" || !strings.Contains(long.data[n-2], `"shutting_down"`) {
		t.Fatalf("long stream: %v %q", long.err, long.data[max(0, len(long.data)-2):])
	}
	return errOut.String()
}
