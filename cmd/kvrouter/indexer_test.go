package main

import (
	"context"
	"io"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"

	"github.com/kvrouter/kvrouter/adapters/enginesource"
	"github.com/kvrouter/kvrouter/internal/testwait"
)

// --workers reads instance_id[:dp_rank]=endpoint and needs --block-size.
func TestIndexerWorkersFlag(t *testing.T) {
	regs, err := parseIndexerWorkers("1=tcp://a:5557, 2:1=tcp://b:5558", "m", "g", 16)
	if err != nil || len(regs) != 2 || regs[1].InstanceID != 2 || regs[1].DPRank != 1 || regs[1].Endpoint != "tcp://b:5558" || regs[0].Key.Model != "m" || regs[0].Key.Group != "g" || regs[0].BlockSize != 16 {
		t.Fatalf("%+v %v", regs, err)
	}
	for spec, says := range map[string]string{
		"1=tcp://a:1":   "--block-size",
		"x=tcp://a:1":   "instance id",
		"1:y=tcp://a:1": "dp rank",
		"1":             "is not instance_id",
	} {
		bs := 16
		if says == "--block-size" {
			bs = 0
		}
		if _, err := parseIndexerWorkers(spec, "m", "g", bs); err == nil || !strings.Contains(err.Error(), says) {
			t.Errorf("%q: %v, want it to name %s", spec, err, says)
		}
	}
}

// kvrouter indexer serves the API on the port it prints.
func TestIndexerCommandServes(t *testing.T) {
	var out, errOut testwait.Buffer
	done := make(chan error, 1)
	root := newRootCmd()
	root.SetOut(&out)
	root.SetErr(&errOut)
	root.SetArgs([]string{"indexer", "--host", "127.0.0.1", "--port", "0"})
	ctx, cancel := context.WithCancel(context.Background())
	go func() { done <- root.ExecuteContext(ctx) }()
	re := regexp.MustCompile(`serving on (http://\S+)`)
	testwait.Until(t, 20*time.Second, "the indexer is up", func() bool { return re.MatchString(out.String()) })
	url := re.FindStringSubmatch(out.String())[1]
	resp, err := http.Get(url + "/health")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("health: %d", resp.StatusCode)
	}
	select {
	case err := <-done:
		t.Fatalf("the command returned: %v %s", err, errOut.String())
	default:
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("stopping: %v", err)
	}
}

// --kv-events-silence-probe is serve's flag, with its default, its
// DYN_ variable and its 0 = off.
func TestIndexerSilenceProbeFlag(t *testing.T) {
	for _, tc := range []struct {
		args []string
		env  map[string]string
		want time.Duration
	}{
		{nil, nil, enginesource.DefaultSilenceProbe},
		{[]string{"--kv-events-silence-probe", "500ms"}, nil, 500 * time.Millisecond},
		{nil, map[string]string{"DYN_KV_EVENTS_SILENCE_PROBE": "7s"}, 7 * time.Second},
		{[]string{"--kv-events-silence-probe", "1s"}, map[string]string{"DYN_KV_EVENTS_SILENCE_PROBE": "7s"}, time.Second},
	} {
		var f indexerFlags
		fs := pflag.NewFlagSet("indexer", pflag.ContinueOnError)
		f.register(fs)
		if err := fs.Parse(tc.args); err != nil {
			t.Fatal(err)
		}
		lookup := func(k string) (string, bool) { v, ok := tc.env[k]; return v, ok }
		if err := applyEnvFrom(fs, lookup, io.Discard); err != nil {
			t.Fatal(err)
		}
		cfg, err := f.config()
		if err != nil || cfg.SilenceProbe != tc.want {
			t.Errorf("%v %v: silence probe %s (%v), want %s", tc.args, tc.env, cfg.SilenceProbe, err, tc.want)
		}
	}
	var f indexerFlags
	fs := pflag.NewFlagSet("indexer", pflag.ContinueOnError)
	f.register(fs)
	if err := fs.Parse([]string{"--kv-events-silence-probe", "0"}); err != nil {
		t.Fatal(err)
	}
	// enginesource reads 0 as its default; off must reach it as negative.
	if cfg, err := f.config(); err != nil || cfg.SilenceProbe >= 0 {
		t.Fatalf("--kv-events-silence-probe 0: %s (%v), want off", cfg.SilenceProbe, err)
	}
	root := newRootCmd()
	root.SetOut(&strings.Builder{})
	root.SetErr(&strings.Builder{})
	root.SetArgs([]string{"indexer", "--host", "127.0.0.1", "--port", "0", "--kv-events-silence-probe", "-1s"})
	if err := root.Execute(); err == nil || !strings.Contains(err.Error(), "--kv-events-silence-probe") {
		t.Fatalf("a negative probe: %v", err)
	}
}
