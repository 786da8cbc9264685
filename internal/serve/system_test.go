package serve

import (
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/router"
)

// The system port answers health and the routing metrics apart from the
// request port, and nothing else.
func TestSystemPortServesMetricsAndHealthOnly(t *testing.T) {
	f := engineFleet(t)
	s := startServerWith(t, Config{Router: router.DefaultConfig(), Workers: []WorkerSpec{spec(1, f)}, HealthInterval: 50 * time.Millisecond, SystemAddr: "127.0.0.1:0"})
	sys := s.SystemAddr()
	if sys == "" || sys == s.Addr() {
		t.Fatalf("system address %q beside request address %q", sys, s.Addr())
	}
	complete(t, s, prompt(64, 1, 64))
	for _, tc := range []struct {
		path   string
		status int
		want   string
	}{
		{"/metrics", http.StatusOK, "kvrouter_"},
		{"/health", http.StatusOK, ""},
		{"/live", http.StatusOK, ""},
		{"/ready", http.StatusOK, ""},
		{"/v1/models", http.StatusNotFound, ""},
		{"/router/workers", http.StatusNotFound, ""},
	} {
		resp, err := http.Get("http://" + sys + tc.path)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != tc.status || !strings.Contains(string(body), tc.want) {
			t.Errorf("GET %s on the system port: %d %.200q, want %d containing %q", tc.path, resp.StatusCode, body, tc.status, tc.want)
		}
	}
}

func TestNoSystemPortByDefault(t *testing.T) {
	f := engineFleet(t)
	s := startServer(t, spec(1, f))
	if a := s.SystemAddr(); a != "" {
		t.Fatalf("system port %q without SystemAddr", a)
	}
}
