package frontend

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvrouter/kvrouter/core/outlier"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/internal/testwait"
)

// hangHandler is an engine that accepts a request and never answers it,
// until the request or the test ends.
func hangHandler(t *testing.T) http.HandlerFunc {
	stop := make(chan struct{})
	t.Cleanup(func() { close(stop) })
	return func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		select {
		case <-r.Context().Done():
		case <-stop:
		}
	}
}

var goodStream = sseHandler([]string{"data: {\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\n", "data: [DONE]\n\n"}, "")

// outlierEnv is a frontend with bad as worker 1 and two good engines,
// with the given header bound and ejection after three failures.
func outlierEnv(t *testing.T, bad http.HandlerFunc, header, base time.Duration) (*env, Worker) {
	e := newEnv(t, envOpts{frontend: func(c *Config) {
		c.HeaderTimeout = header
		c.Outlier = outlier.Config{Consecutive: 3, BaseEjection: base, MaxEjection: 10 * base}
	}})
	w := e.fake(1, "fake", 1, bad)
	e.fake(2, "fake", 1, goodStream)
	e.fake(3, "fake", 1, goodStream)
	return e, w
}

// clients sends n streamed requests from 8 clients at once, each giving up
// after 5 s as the probe's clients did, and fails the test on any that
// did not end with a clean stream.
func (e *env) clients(n int) {
	e.t.Helper()
	var wg sync.WaitGroup
	var next atomic.Int64
	for range 8 {
		wg.Go(func() {
			for {
				i := int(next.Add(1))
				if i > n {
					return
				}
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				b, _ := json.Marshal(map[string]any{"model": "fake", "prompt": tokens(40, i), "stream": true})
				req, _ := http.NewRequestWithContext(ctx, http.MethodPost, e.srv.URL+"/v1/completions", strings.NewReader(string(b)))
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					cancel()
					e.t.Errorf("request %d: %v", i, err)
					continue
				}
				body, err := io.ReadAll(resp.Body)
				resp.Body.Close()
				cancel()
				if err != nil || resp.StatusCode != 200 || !strings.HasSuffix(string(body), "data: [DONE]\n\n") || strings.Contains(string(body), "error") {
					e.t.Errorf("request %d: %d %v %q", i, resp.StatusCode, err, body)
				}
			}
		})
	}
	wg.Wait()
}

func (e *env) ejections(id uint64) float64 {
	return testutil.ToFloat64(e.fe.om.ejections.WithLabelValues(fmt.Sprint(id)))
}

// healthEjection is worker id's ejection as /health shows it, or nil.
func (e *env) healthEjection(id uint64) *ejectionHealth {
	e.t.Helper()
	_, body := e.get("/health")
	var h struct {
		Workers []healthWorker `json:"workers"`
	}
	if err := json.Unmarshal(body, &h); err != nil {
		e.t.Fatalf("/health: %v: %s", err, body)
	}
	for _, w := range h.Workers {
		if w.ID == id {
			return w.Ejected
		}
	}
	return nil
}

// Engines that answer /health but fail requests: every request still
// succeeds, on another engine, within the header bound, and the engine is
// ejected, with a metric and a /health entry.
func TestFailingEnginesAreRetriedElsewhereAndEjected(t *testing.T) {
	for _, tc := range []struct {
		name   string
		bad    func(*testing.T) http.HandlerFunc
		reason string
	}{
		{"accepts and never answers", hangHandler, failTimeout},
		{"sends malformed streams", func(*testing.T) http.HandlerFunc {
			return sseHandler([]string{"data: {not json\n\n"}, "")
		}, failMalformed},
		{"sends a line that is not SSE", func(*testing.T) http.HandlerFunc {
			return sseHandler([]string{"<html>502 Bad Gateway</html>\n\n"}, "")
		}, failMalformed},
		{"answers 500", func(*testing.T) http.HandlerFunc {
			return func(w http.ResponseWriter, r *http.Request) {
				w.WriteHeader(http.StatusInternalServerError)
				_, _ = io.WriteString(w, `{"error":{"message":"engine dead","code":500}}`)
			}
		}, failStatus},
		{"resets the connection", func(*testing.T) http.HandlerFunc { return resetHandler }, failReset},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// A short header bound (long enough for a loaded machine's
			// good engines) for the engine that never answers; the others
			// answer at once, and under load their answer can take longer
			// than a second, when it would count as a timeout, not as
			// what the engine did.
			header := 10 * time.Second
			if tc.reason == failTimeout {
				header = time.Second
			}
			e, bad := outlierEnv(t, tc.bad(t), header, time.Minute)
			start := time.Now()
			e.clients(20)
			// A client waits for the hung engine a header bound at most
			// per request, and the engine is soon ejected.
			if took := time.Since(start); took > 8*time.Second {
				t.Errorf("20 requests took %v", took)
			}
			for i := 0; e.ejections(bad.ID) == 0 && i < 10; i++ {
				e.clients(20) // an engine the router happened to avoid
			}
			e.settle()
			if got := e.ejections(bad.ID); got != 1 {
				t.Fatalf("kvrouter_worker_ejections_total{worker_id=1} = %v, want 1", got)
			}
			if got := testutil.ToFloat64(e.fe.om.ejected); got != 1 {
				t.Fatalf("kvrouter_workers_ejected = %v", got)
			}
			h := e.healthEjection(bad.ID)
			if h == nil || h.Reason != tc.reason || h.Ejections != 1 || h.Until.Sub(h.Since) != time.Minute || h.RemainingS <= 0 {
				t.Fatalf("/health ejection %+v, want reason %q for 1 min", h, tc.reason)
			}
			// While ejected it gets nothing, nor does the router API name it.
			before := e.migrations("new_request")
			e.clients(20)
			if got := e.migrations("new_request"); got != before {
				t.Fatalf("%v requests went to the ejected engine", got-before)
			}
			for i := range 20 {
				resp, body := e.post("/router/best_worker", map[string]any{"model": "fake", "tokens": tokens(40, i)})
				var d bestWorkerResponse
				if err := json.Unmarshal(body, &d); err != nil || resp.StatusCode != 200 || d.WorkerID == bad.ID {
					t.Fatalf("best_worker: %d %s", resp.StatusCode, body)
				}
			}
			e.settle()
		})
	}
}

// An engine's error status is retried elsewhere; when every engine fails
// the request, the client gets the engine's own answer.
func TestErrorStatusOfEveryEngineIsRelayed(t *testing.T) {
	e := newEnv(t, envOpts{})
	for id := range uint64(3) {
		e.fake(id+1, "fake", 1, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("X-Engine", "yes")
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = io.WriteString(w, `{"error":{"message":"overloaded","code":503}}`)
		})
	}
	resp, body := e.post("/v1/completions", map[string]any{"model": "fake", "prompt": tokens(40, 1), "stream": true})
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("X-Engine") != "yes" || string(body) != `{"error":{"code":"503","message":"overloaded"}}`+"\n" {
		t.Fatalf("%d, headers %v: %q", resp.StatusCode, resp.Header, body)
	}
	e.settle()
	if got := e.migrations("new_request"); got != 1 {
		t.Fatalf("%v retries, want 1", got)
	}
}

// A non-streamed request is bounded by the response timeout, not the
// header timeout: engines send its headers with the last token.
func TestNonStreamedAnswersHaveTheirOwnBound(t *testing.T) {
	slow := func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		time.Sleep(400 * time.Millisecond) // a generation longer than the header bound
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"choices":[{"index":0,"text":"a"}]}`)
	}
	e := newEnv(t, envOpts{frontend: func(c *Config) { c.HeaderTimeout = 100 * time.Millisecond }})
	e.fake(1, "fake", 1, slow)
	if resp, body := e.post("/v1/completions", map[string]any{"model": "fake", "prompt": tokens(40, 1)}); resp.StatusCode != 200 {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	e.settle()

	bounded := newEnv(t, envOpts{frontend: func(c *Config) { c.ResponseTimeout = 100 * time.Millisecond }})
	bounded.fake(1, "fake", 1, hangHandler(t))
	resp, body := bounded.post("/v1/completions", map[string]any{"model": "fake", "prompt": tokens(40, 1)})
	if code := openAIError(t, resp, body, http.StatusBadGateway); code != "engine_unreachable" || !strings.Contains(string(body), "no response headers") {
		t.Fatalf("code %q: %s", code, body)
	}
	bounded.settle()
}

// An ejected engine returns after its backoff; one still failing is
// ejected again at its first failure, for twice as long.
func TestEjectedEngineReturnsAfterItsBackoff(t *testing.T) {
	var broken atomic.Bool
	broken.Store(true)
	var served atomic.Int64
	flaky := func(w http.ResponseWriter, r *http.Request) {
		if broken.Load() {
			w.WriteHeader(http.StatusInternalServerError)
			return
		}
		served.Add(1)
		goodStream(w, r)
	}
	const base = 300 * time.Millisecond
	e, bad := outlierEnv(t, flaky, time.Second, base)
	testwait.Until(t, 10*time.Second, "the engine ejected", func() bool {
		e.clients(8)
		return e.ejections(bad.ID) == 1
	})
	first := e.healthEjection(bad.ID)
	if first == nil || first.Until.Sub(first.Since) != base {
		t.Fatalf("first ejection %+v, want %v", first, base)
	}
	// Still broken when it returns: ejected again by one failure, longer.
	testwait.Until(t, 10*time.Second, "the engine ejected again", func() bool {
		e.clients(8)
		return e.ejections(bad.ID) == 2
	})
	second := e.healthEjection(bad.ID)
	if second == nil || second.Until.Sub(second.Since) != 2*base || second.Ejections != 2 {
		t.Fatalf("second ejection %+v, want %v", second, 2*base)
	}
	// Healed: back in routing once its backoff ends.
	broken.Store(false)
	testwait.Until(t, 10*time.Second, "the engine serving again", func() bool {
		e.clients(8)
		return served.Load() > 0
	})
	if h := e.healthEjection(bad.ID); h != nil {
		t.Fatalf("still ejected: %+v", h)
	}
	e.settle()
}

// The last engine of a model is never ejected, however it fails.
func TestTheOnlyEngineIsNotEjected(t *testing.T) {
	e := newEnv(t, envOpts{frontend: func(c *Config) { c.Outlier = outlier.Config{Consecutive: 1} }})
	bad := e.fake(1, "fake", 1, resetHandler)
	for i := range 5 {
		resp, body := e.post("/v1/completions", map[string]any{"model": "fake", "prompt": tokens(40, i)})
		openAIError(t, resp, body, http.StatusBadGateway)
	}
	e.settle()
	if got := e.ejections(bad.ID); got != 0 {
		t.Fatalf("the only engine was ejected %v times", got)
	}
}

// A hung prefill engine costs a disaggregated request no more than the
// header bound, and once ejected nothing: its requests are prefilled by
// their decode engine, well within the prefill timeout.
func TestHungPrefillEngineIsBoundedAndEjected(t *testing.T) {
	e := newEnv(t, envOpts{frontend: func(c *Config) {
		c.HeaderTimeout = time.Second
		c.Disagg = Disagg{PrefillTimeout: time.Minute}
		c.Outlier = outlier.Config{Consecutive: 3, BaseEjection: time.Minute}
	}})
	seen := &seenBodies{}
	hung := e.fakeRole(1, router.RolePrefill, hangHandler(t))
	e.fakeRole(2, router.RoleDecode, fakeVLLMDecode(seen))
	var wg sync.WaitGroup
	var slowest atomic.Int64
	for c := range 4 {
		wg.Go(func() {
			for i := range 5 {
				start := time.Now()
				resp, body := e.post("/v1/completions", map[string]any{"model": "m", "prompt": tokens(64, c*10+i), "stream": true})
				took := time.Since(start)
				if resp.StatusCode != 200 || !strings.HasSuffix(string(body), "data: [DONE]\n\n") {
					t.Errorf("request %d/%d: %d %s", c, i, resp.StatusCode, body)
				}
				for old := slowest.Load(); int64(took) > old && !slowest.CompareAndSwap(old, int64(took)); old = slowest.Load() {
				}
			}
		})
	}
	wg.Wait()
	e.settle()
	if took := time.Duration(slowest.Load()); took > 5*time.Second {
		t.Fatalf("the slowest request took %v; the header bound is 1 s, the prefill timeout 1 min", took)
	}
	if got := e.ejections(hung.ID); got != 1 {
		t.Fatalf("the hung prefill engine was ejected %v times", got)
	}
	// Four clients in flight when the third timeout ejects the engine: each
	// may have sent one more before that third timeout landed (a client
	// that starts late on a loaded machine), never a third.
	if got := e.decisions("local", localPrefillTimeout); got < 3 || got > 8 {
		t.Fatalf("%v prefills timed out; the engine should have been ejected after 3 (4 clients at once, at most 2 each)", got)
	}
}
