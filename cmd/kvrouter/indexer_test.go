package main

import (
	"context"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

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
