package serve

import (
	"context"
	"encoding/json"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/internal/testwait"
)

// deadURL is an http URL of 127.0.0.1 on which nothing listens.
func deadURL(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	u := "http://" + ln.Addr().String()
	ln.Close()
	return u
}

type uiEngineState struct {
	WorkerID uint64 `json:"worker_id"`
	State    string `json:"state"`
	Why      string `json:"why"`
}

func uiEngines(t *testing.T, s *Server) []uiEngineState {
	t.Helper()
	resp, err := http.Get(s.URL() + "/ui/api/state")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var st struct {
		Engines []uiEngineState `json:"engines"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
		t.Fatal(err)
	}
	return st.Engines
}

func hasReason(h healthBody, sub string) bool {
	for _, r := range h.Reasons {
		if strings.Contains(r, sub) {
			return true
		}
	}
	return false
}

// A configured engine that never answers, and one that dies, are named in
// the log (once), /health (degraded, with why), the dashboard and a metric.
func TestUnreachableEngineIsNamedEverywhere(t *testing.T) {
	a := engineFleet(t)
	dead := deadURL(t)
	var logs testwait.Buffer
	s, err := Start(context.Background(), Config{
		Router: router.DefaultConfig(), Addr: "127.0.0.1:0", HealthInterval: 20 * time.Millisecond,
		Workers: []WorkerSpec{spec(1, a), {ID: 2, Name: "gone", URL: dead, Model: "kvrouter-mock"}},
		Logger:  slog.New(slog.NewTextHandler(&logs, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	why := "engine url=" + dead + " unreachable: connection refused"
	testwait.Until(t, 10*time.Second, "/health degraded naming the unreachable engine", func() bool {
		h := getHealth(t, s)
		return h.Status == "degraded" && hasReason(h, why)
	})
	if got := metric(t, s.URL(), "kvrouter_configured_workers_unroutable"); got != 1 {
		t.Errorf("kvrouter_configured_workers_unroutable = %v, want 1", got)
	}
	var e2 *uiEngineState
	for _, e := range uiEngines(t, s) {
		if e.WorkerID == 2 {
			e2 = &e
		}
	}
	if e2 == nil || e2.State != "down" || !strings.Contains(e2.Why, why) {
		t.Errorf("dashboard shows the unreachable engine as %+v, want down with why %q", e2, why)
	}
	// Let the probe fail many more times: the log names it once.
	probes := 0
	testwait.Until(t, 10*time.Second, "more failed probes", func() bool {
		probes++
		return probes > 5 && getHealth(t, s).Status == "degraded"
	})
	if n := strings.Count(logs.String(), why); n != 1 {
		t.Errorf("the log names the unreachable engine %d times, want once:\n%s", n, logs.String())
	}

	a.Close() // the running engine dies
	testwait.Until(t, 10*time.Second, "/health naming the engine that died", func() bool {
		h := getHealth(t, s)
		return hasReason(h, "engine url="+spec(1, a).URL) && hasReason(h, why)
	})
	if got := metric(t, s.URL(), "kvrouter_configured_workers_unroutable"); got != 2 {
		t.Errorf("kvrouter_configured_workers_unroutable = %v, want 2", got)
	}
}

// A frontend listening on every address prints a URL a browser can open.
func TestURLOfAWildcardListenerIsBrowsable(t *testing.T) {
	for addr, want := range map[string]string{
		"[::]:8000": "http://127.0.0.1:8000", "0.0.0.0:8000": "http://127.0.0.1:8000",
		"127.0.0.1:8000": "http://127.0.0.1:8000", "10.0.0.5:8000": "http://10.0.0.5:8000", "[::1]:8000": "http://[::1]:8000",
	} {
		if got := browsable(addr, false); got != want {
			t.Errorf("%s: %s, want %s", addr, got, want)
		}
	}
	if got := browsable("[::]:443", true); got != "https://127.0.0.1:443" {
		t.Errorf("TLS: %s", got)
	}
}
