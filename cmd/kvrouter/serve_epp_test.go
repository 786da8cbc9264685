package main

import (
	"context"
	"net"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kvrouter/kvrouter/internal/testwait"
)

func TestServeEPPPortFlags(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--epp-health-port", "9003"}, "--epp-health-port needs --epp-port"},
		{[]string{"--epp-port", "70000"}, "--epp-port must be a port"},
		{[]string{"--epp-port", "9002", "--epp-health-port", "-1"}, "--epp-health-port must be a port"},
	} {
		root := newRootCmd()
		root.SetOut(new(strings.Builder))
		root.SetErr(new(strings.Builder))
		root.SetArgs(append([]string{"serve", "--worker", "url=http://127.0.0.1:1"}, c.args...))
		if err := root.Execute(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: %v; want an error saying %q", c.args, err, c.want)
		}
	}
}

// serve --epp-port serves the picker, which turns ready once the engine
// is in routing, until the command ends.
func TestServeServesTheEndpointPicker(t *testing.T) {
	t.Setenv("NATS_SERVER", "")
	cfg, e := mockEngine(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var out testwait.Buffer
	done := make(chan error, 1)
	go func() {
		root := newRootCmd()
		root.SetOut(&out)
		root.SetErr(new(testwait.Buffer))
		root.SetArgs([]string{"serve", "--http-host", "127.0.0.1", "--http-port", "0", "--epp-port", strconv.Itoa(port),
			"--worker", "url=" + e.HTTPURL + ",events=" + e.Ranks[0].Events + ",model=" + cfg.Server.Model})
		done <- root.ExecuteContext(ctx)
	}()
	on := regexp.MustCompile(`endpoint picker \(.*\) on (\S+)`)
	testwait.Until(t, 20*time.Second, "the picker is announced", func() bool { return on.MatchString(out.String()) })
	conn, err := grpc.NewClient(on.FindStringSubmatch(out.String())[1], grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	hc := healthpb.NewHealthClient(conn)
	testwait.Until(t, 20*time.Second, "the picker is ready", func() bool {
		resp, err := hc.Check(ctx, &healthpb.HealthCheckRequest{Service: "readiness"})
		return err == nil && resp.GetStatus() == healthpb.HealthCheckResponse_SERVING
	})
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("serve did not return")
	}
}
