package frontend

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/mocker/fleet"
)

const mockModel = "kvrouter-mock"

// idle counts the frontend's handlers in flight, so a test can wait until
// every handler (and the Free in its defer) has returned — no sleeping.
type idle struct {
	mu   sync.Mutex
	cond *sync.Cond
	n    int
	h    http.Handler
}

func newIdle(h http.Handler) *idle {
	i := &idle{h: h}
	i.cond = sync.NewCond(&i.mu)
	return i
}

func (i *idle) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	i.mu.Lock()
	i.n++
	i.mu.Unlock()
	defer func() {
		i.mu.Lock()
		i.n--
		i.cond.Broadcast()
		i.mu.Unlock()
	}()
	i.h.ServeHTTP(w, r)
}

func (i *idle) wait(t *testing.T) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		i.mu.Lock()
		for i.n > 0 {
			i.cond.Wait()
		}
		i.mu.Unlock()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("frontend handlers still running after 20 s")
	}
}

type env struct {
	t      *testing.T
	fleet  *fleet.Fleet
	router *router.Router
	fe     *Frontend
	reg    *prometheus.Registry
	srv    *httptest.Server
	idle   *idle

	mu      sync.Mutex
	workers []Worker
}

type envOpts struct {
	engines, dp int
	maxBody     int64
	router      func(*router.Config)
	migrations  int             // Config.MigrationLimit
	refused     func(id uint64) // Config.EngineRefused
	// access control and limits, as in Config
	apiKey, adminToken string
	maxBookings        int
	models             func() []string
	frontend           func(*Config)
}

// newEnv starts a mocker fleet on 127.0.0.1 (ports 0), a router with its
// engines as workers 10, 11, ... and the frontend in front of them.
func newEnv(t *testing.T, o envOpts) *env {
	t.Helper()
	if o.dp == 0 {
		o.dp = 1
	}
	rcfg := router.DefaultConfig()
	rcfg.PredictedTTL = time.Minute // predict-on-route: routed prompts count as cached
	if o.router != nil {
		o.router(&rcfg)
	}
	r, err := router.New(rcfg)
	if err != nil {
		t.Fatal(err)
	}
	e := &env{t: t, router: r, reg: prometheus.NewRegistry()}
	if o.engines > 0 {
		fcfg := fleet.DefaultConfig()
		fcfg.NumWorkers, fcfg.DataParallelSize, fcfg.SpeedupRatio = o.engines, o.dp, 100
		fcfg.HTTPPort, fcfg.KVEventsPort, fcfg.KVEventsReplayPort = 0, 0, 0
		fcfg.Engine.NumGPUBlocks = 4096
		fl, err := fleet.Start(context.Background(), fcfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(fl.Close)
		e.fleet = fl
		for i, eng := range fl.Engines() {
			e.add(Worker{ID: uint64(10 + i), Name: eng.Name, BaseURL: eng.HTTPURL, Model: mockModel, DPSize: o.dp})
		}
	}
	fcfg := Config{
		Router: r, Workers: e.list, MaxBodyBytes: o.maxBody, Registry: e.reg,
		APIKey: o.apiKey, AdminToken: o.adminToken, MaxBookings: o.maxBookings, Models: o.models,
		MigrationLimit: o.migrations, EngineRefused: o.refused,
	}
	if o.frontend != nil {
		o.frontend(&fcfg)
	}
	fe, err := New(fcfg)
	if err != nil {
		t.Fatal(err)
	}
	e.fe = fe
	e.idle = newIdle(fe.Handler())
	e.srv = httptest.NewServer(e.idle)
	t.Cleanup(e.srv.Close)
	return e
}

func (e *env) add(w Worker) {
	e.mu.Lock()
	e.workers = append(e.workers, w)
	e.mu.Unlock()
	e.router.AddWorker(router.WorkerInfo{ID: w.ID, Model: w.Model, DPSize: w.DPSize, TotalKVBlocks: 4096})
}

func (e *env) list() []Worker {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]Worker(nil), e.workers...)
}

// fake registers an engine made of handler as worker id serving model.
func (e *env) fake(id uint64, model string, dp int, handler http.HandlerFunc) Worker {
	e.t.Helper()
	srv := httptest.NewServer(handler)
	e.t.Cleanup(srv.Close)
	w := Worker{ID: id, Name: "fake-" + model, BaseURL: srv.URL, Model: model, DPSize: dp}
	e.add(w)
	return w
}

// settle waits for every handler, then checks that no load is left.
func (e *env) settle() {
	e.t.Helper()
	e.idle.wait(e.t)
	for _, l := range e.router.Loads() {
		if l.ActiveRequests != 0 || l.ActivePrefillTokens != 0 || l.ActiveDecodeBlocks != 0 {
			e.t.Fatalf("load left on %v: %+v", l.Worker, l.WorkerLoad)
		}
	}
}

func (e *env) post(path string, body any) (*http.Response, []byte) {
	e.t.Helper()
	return e.do(http.MethodPost, path, "", body)
}

// do sends a request with the bearer token (none if ""); a string or
// []byte body goes as it is, anything else (but nil) as JSON.
func (e *env) do(method, path, token string, body any) (*http.Response, []byte) {
	e.t.Helper()
	var rd io.Reader
	switch b := body.(type) {
	case nil:
	case string:
		rd = strings.NewReader(b)
	case []byte:
		rd = bytes.NewReader(b)
	default:
		j, err := json.Marshal(b)
		if err != nil {
			e.t.Fatal(err)
		}
		rd = bytes.NewReader(j)
	}
	req, err := http.NewRequest(method, e.srv.URL+path, rd)
	if err != nil {
		e.t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		e.t.Fatal(err)
	}
	defer resp.Body.Close()
	out, err := io.ReadAll(resp.Body)
	if err != nil {
		e.t.Fatal(err)
	}
	return resp, out
}

func (e *env) get(path string) (*http.Response, []byte) {
	e.t.Helper()
	resp, err := http.Get(e.srv.URL + path)
	if err != nil {
		e.t.Fatal(err)
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	return resp, out
}

// counter reads kvrouter_frontend_requests_total for the labels.
func (e *env) counter(model, endpoint, status string) float64 {
	return testutil.ToFloat64(e.fe.m.requests.WithLabelValues(model, endpoint, status))
}

// openAIError checks an OpenAI error body and returns its code.
func openAIError(t *testing.T, resp *http.Response, body []byte, status int) string {
	t.Helper()
	if resp.StatusCode != status {
		t.Fatalf("status %d, want %d: %s", resp.StatusCode, status, body)
	}
	var e struct {
		Error map[string]any `json:"error"`
	}
	if err := json.Unmarshal(body, &e); err != nil {
		t.Fatalf("not JSON: %s", body)
	}
	for _, k := range []string{"message", "type", "param", "code"} {
		if _, ok := e.Error[k]; !ok {
			t.Fatalf("error without %q: %s", k, body)
		}
	}
	code, ok := e.Error["code"].(string)
	if !ok && e.Error["code"] != nil {
		t.Fatalf("code is neither a string nor null: %s", body)
	}
	return code
}

// sseData returns the data payloads of a stream, in order.
func sseData(t *testing.T, r io.Reader) []string {
	t.Helper()
	var out []string
	sc := bufio.NewScanner(r)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
			out = append(out, v)
		}
	}
	return out
}

// tokens makes n distinct token ids from salt.
func tokens(n, salt int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(1000 + (i*37+salt*7919)%90000)
	}
	return out
}

// closedURL is an address nothing listens on.
func closedURL(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return "http://" + addr
}

// sseHandler is a fake engine that streams the given raw bytes, flushing
// after each piece, then acts as end says: "abort" kills the connection.
func sseHandler(pieces []string, end string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		w.(http.Flusher).Flush()
		for _, p := range pieces {
			_, _ = io.WriteString(w, p)
			w.(http.Flusher).Flush()
		}
		if end == "abort" {
			panic(http.ErrAbortHandler)
		}
	}
}
