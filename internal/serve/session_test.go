package serve

import (
	"bytes"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/internal/testwait"
)

// pathLog is a reverse proxy in front of an engine that records, in
// order, the paths and bodies of the requests the router sent it (probes
// aside); answer, when set, replaces the
// engine's answer for the paths it returns true for.
type pathLog struct {
	mu     sync.Mutex
	paths  []string
	bodies map[string][]string
	answer func(w http.ResponseWriter, r *http.Request) bool
}

func (p *pathLog) front(t *testing.T, engine string) string {
	t.Helper()
	u, err := url.Parse(engine)
	if err != nil {
		t.Fatal(err)
	}
	proxy := httputil.NewSingleHostReverseProxy(u)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost {
			b, _ := io.ReadAll(r.Body)
			r.Body = io.NopCloser(bytes.NewReader(b))
			p.mu.Lock()
			p.paths = append(p.paths, r.URL.Path)
			if p.bodies == nil {
				p.bodies = map[string][]string{}
			}
			p.bodies[r.URL.Path] = append(p.bodies[r.URL.Path], string(b))
			p.mu.Unlock()
		}
		if p.answer != nil && p.answer(w, r) {
			return
		}
		proxy.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

func (p *pathLog) bodiesOf(path string) []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.bodies[path])
}

func (p *pathLog) seen() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.paths)
}

// sessionTurn sends one completion with session_control and returns the
// worker that served it; it fails unless it is answered 200.
func sessionTurn(t *testing.T, s *Server, id, action string, p []int) uint64 {
	t.Helper()
	sc := map[string]any{"session_id": id}
	if action != "" {
		sc["action"] = action
	}
	if action == "open" {
		sc["timeout"] = 60
	}
	status, body := postTo(t, s, "/v1/completions", map[string]any{"model": "kvrouter-mock", "prompt": p, "max_tokens": 2, "nvext": map[string]any{"session_control": sc, "extra_fields": []string{"worker_id"}}})
	var out struct {
		NVExt struct {
			WorkerID uint64 `json:"worker_id"`
		} `json:"nvext"`
	}
	if status != 200 || json.Unmarshal(body, &out) != nil {
		t.Fatalf("%s turn: %d %s", action, status, body)
	}
	return out.NVExt.WorkerID
}

// postTo posts v as JSON to the frontend's path and returns the answer.
func postTo(t *testing.T, s *Server, path string, v any) (int, []byte) {
	t.Helper()
	b, _ := json.Marshal(v)
	resp, err := http.Post("http://"+s.Addr()+path, "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, body
}

func TestSessionOpenAndCloseReachTheEngine(t *testing.T) {
	f := engineFleet(t)
	var log pathLog
	w := spec(1, f)
	w.URL = log.front(t, w.URL)
	s := startServer(t, w)

	sessionTurn(t, s, "conv-1", "open", prompt(0, 1, 64))
	sessionTurn(t, s, "conv-1", "", prompt(0, 1, 96))
	sessionTurn(t, s, "conv-1", "close", prompt(0, 1, 128))
	want := []string{"/open_session", "/v1/completions", "/v1/completions", "/v1/completions", "/close_session"}
	if got := log.seen(); !slices.Equal(got, want) {
		t.Fatalf("the engine saw %v, want %v: the session opens before its first request and closes after its last", got, want)
	}
	var open struct {
		ID       string   `json:"session_id"`
		Capacity *int     `json:"capacity_of_str_len"`
		Timeout  *float64 `json:"timeout"`
	}
	if err := json.Unmarshal([]byte(log.bodiesOf("/open_session")[0]), &open); err != nil || open.ID != "conv-1" || open.Capacity == nil || open.Timeout == nil || *open.Timeout != 60 {
		t.Fatalf("open_session body %s: want SGLang's, with the session's id and timeout", log.bodiesOf("/open_session")[0])
	}
	if got := log.bodiesOf("/close_session")[0]; got != `{"session_id":"conv-1"}` {
		t.Fatalf("close_session body %s", got)
	}
	// The engine itself opened and closed it: reopening succeeds.
	resp, err := http.Post(f.Engines()[0].HTTPURL+"/open_session", "application/json", strings.NewReader(`{"capacity_of_str_len":1,"session_id":"conv-1"}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("the engine still holds the closed session: reopening answered %d", resp.StatusCode)
	}
}

func TestAnEngineWithoutSessionsIsToldOnceAndTheRouterBinds(t *testing.T) {
	a, b := engineFleet(t), engineFleet(t)
	var logA, logB pathLog
	no := func(w http.ResponseWriter, r *http.Request) bool {
		if strings.HasSuffix(r.URL.Path, "_session") {
			http.NotFound(w, r)
			return true
		}
		return false
	}
	logA.answer, logB.answer = no, no
	wa, wb := spec(1, a), spec(2, b)
	wa.URL, wb.URL = logA.front(t, wa.URL), logB.front(t, wb.URL)
	var logs testwait.Buffer
	s := startServerWith(t, Config{Router: router.DefaultConfig(), Workers: []WorkerSpec{wa, wb}, HealthInterval: 50 * time.Millisecond,
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})

	for _, id := range []string{"s1", "s2", "s3", "s4"} {
		first := sessionTurn(t, s, id, "open", prompt(0, int(id[1]), 64))
		// Prompts that do not lead back by cache: only the binding does.
		if w := sessionTurn(t, s, id, "", prompt(0, 99, 640)); w != first {
			t.Fatalf("session %s opened on %d went to %d: the router did not bind it", id, first, w)
		}
		if w := sessionTurn(t, s, id, "close", prompt(0, 98, 640)); w != first {
			t.Fatalf("session %s opened on %d closed on %d", id, first, w)
		}
	}
	calls := 0
	for _, l := range []*pathLog{&logA, &logB} {
		for _, p := range l.seen() {
			if strings.HasSuffix(p, "_session") {
				calls++
			}
		}
	}
	if calls > 2 {
		t.Fatalf("%d session calls reached engines without a session API; want at most one per engine", calls)
	}
	if n := strings.Count(logs.String(), "engine has no session API"); n < 1 || n > 2 {
		t.Fatalf("%d warnings about engines without a session API, want one per engine asked:\n%s", n, logs.String())
	}
}

func TestMinInitialWorkersHoldsRoutingUntilEnoughEngines(t *testing.T) {
	a := engineFleet(t)
	s, err := Start(t.Context(), Config{Router: router.DefaultConfig(), Workers: []WorkerSpec{spec(1, a)}, HealthInterval: 50 * time.Millisecond,
		Addr: "127.0.0.1:0", MinInitialWorkers: 2})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	// The one engine joins routing, and still the router waits for two.
	testwait.Until(t, 10*time.Second, "the engine to join routing", func() bool { return len(s.router.Workers()) == 1 })
	// A health probe that times out on a loaded machine takes the one
	// engine out of routing for an interval; no request may be served
	// meanwhile either way.
	testwait.Until(t, 10*time.Second, "a request refused for the wait", func() bool {
		status, body := postTo(t, s, "/v1/completions", map[string]any{"model": "kvrouter-mock", "prompt": prompt(0, 1, 32), "max_tokens": 2})
		if status != http.StatusServiceUnavailable {
			t.Fatalf("a request before --router-min-initial-workers engines: %d %s, want 503", status, body)
		}
		return strings.Contains(string(body), "waiting_for_workers")
	})
	// /ready names the wait, and never says ready.
	testwait.Until(t, 10*time.Second, "/ready naming the wait", func() bool {
		resp, err := http.Get("http://" + s.Addr() + "/ready")
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusServiceUnavailable {
			t.Fatalf("/ready: %d %s, want 503 while one engine of two is in routing", resp.StatusCode, b)
		}
		return strings.Contains(string(b), "min-initial-workers")
	})
}
