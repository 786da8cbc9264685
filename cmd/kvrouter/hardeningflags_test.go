package main

import (
	"context"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"

	"github.com/kvrouter/kvrouter/internal/testwait"
)

func TestHardeningFlagsRejectNonsense(t *testing.T) {
	t.Setenv("NATS_SERVER", "")
	for _, args := range [][]string{
		{"--kv-recovery-window", "0s"},
		{"--kv-recovery-window", "-1s"},
		{"--kv-events-silence-probe", "-1s"},
		{"--router-max-bookings", "0"},
		{"--engine-header-timeout", "-1s"},
		{"--engine-response-timeout", "-1s"},
		{"--engine-ejection-consecutive-failures", "-1"},
		{"--engine-ejection-base-time", "0s"},
		{"--engine-ejection-max-time", "1s"},
		{"--engine-ejection-max-percent", "0"},
		{"--engine-ejection-max-percent", "101"},
	} {
		for _, command := range []string{"serve", "up"} {
			root := newRootCmd()
			root.SetOut(&strings.Builder{})
			root.SetErr(&strings.Builder{})
			root.SetArgs(append([]string{command}, args...))
			err := root.Execute()
			if err == nil || !strings.Contains(err.Error(), args[0]) {
				t.Errorf("%s %v: %v", command, args, err)
			}
		}
	}
}

func TestHardeningFlagsParse(t *testing.T) {
	t.Setenv("DYN_KV_RECOVERY_WINDOW", "5s")
	var f hardeningFlags
	fs := pflag.NewFlagSet("test", pflag.ContinueOnError)
	f.register(fs)
	if err := fs.Parse([]string{"--kv-events-silence-probe", "0"}); err != nil {
		t.Fatal(err)
	}
	if err := applyEnv(fs); err != nil {
		t.Fatal(err)
	}
	if err := f.validate(); err != nil {
		t.Fatal(err)
	}
	if f.recoveryWindow != 5*time.Second {
		t.Fatalf("recovery window from the environment: %s", f.recoveryWindow)
	}
	// enginesource reads 0 as its default; off must reach it as negative.
	if p := f.silenceProbeConfig(); p >= 0 {
		t.Fatalf("--kv-events-silence-probe 0 must switch the probe off, got %s", p)
	}
}

// The flags' 0 ("off") reaches the frontend and the detector as their
// negative, since both read 0 as their default.
func TestEngineFailureFlagsOff(t *testing.T) {
	var f hardeningFlags
	fs := pflag.NewFlagSet("test", pflag.ContinueOnError)
	f.register(fs)
	if err := fs.Parse([]string{"--engine-header-timeout", "0", "--engine-response-timeout", "0", "--engine-ejection-consecutive-failures", "0"}); err != nil {
		t.Fatal(err)
	}
	if err := f.validate(); err != nil {
		t.Fatal(err)
	}
	if h, r := f.engineTimeouts(); h >= 0 || r >= 0 {
		t.Fatalf("timeouts %s, %s: want both off", h, r)
	}
	if c := f.outlierConfig(); c.Consecutive >= 0 {
		t.Fatalf("ejection %+v: want it off", c)
	}
	var d hardeningFlags
	d.register(pflag.NewFlagSet("defaults", pflag.ContinueOnError))
	if h, r := d.engineTimeouts(); h != 30*time.Second || r != 10*time.Minute {
		t.Fatalf("default timeouts %s, %s", h, r)
	}
}

// DYN_ROUTER_MAX_BOOKINGS reaches the running frontend: with a cap of 1
// the second booking is refused.
func TestServeMaxBookings(t *testing.T) {
	t.Setenv("NATS_SERVER", "")
	t.Setenv("DYN_ROUTER_MAX_BOOKINGS", "1")
	cfg, e := mockEngine(t)
	var out, errOut testwait.Buffer
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		root := newRootCmd()
		root.SetOut(&out)
		root.SetErr(&errOut)
		root.SetArgs([]string{"serve", "--http-host", "127.0.0.1", "--http-port", "0", "--nats-port", "0",
			"--worker", "url=" + e.HTTPURL + ",events=" + e.Ranks[0].Events + ",replay=" + e.Ranks[0].Replay + ",model=" + cfg.Server.Model})
		done <- root.ExecuteContext(ctx)
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	servingOn := regexp.MustCompile(`serving on (http://\S+)`)
	testwait.Until(t, 20*time.Second, "the frontend is up", func() bool { return servingOn.MatchString(out.String()) })
	url := servingOn.FindStringSubmatch(out.String())[1]
	testwait.Until(t, 20*time.Second, "the engine is in routing", func() bool {
		resp, err := http.Get(url + "/ready")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	book := func(id string) int {
		body := `{"model":"` + cfg.Server.Model + `","tokens":[1,2,3,4,5,6,7,8],"request_id":"` + id + `"}`
		resp, err := http.Post(url+"/router/best_worker", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if code := book("a"); code != http.StatusOK {
		t.Fatalf("first booking: %d", code)
	}
	if code := book("b"); code != http.StatusTooManyRequests {
		t.Fatalf("a booking beyond --router-max-bookings 1: %d", code)
	}
}
