package serve

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kvrouter/kvrouter/adapters/enginesource"
	"github.com/kvrouter/kvrouter/adapters/epp"
	"github.com/kvrouter/kvrouter/adapters/epp/epptest"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/internal/testwait"
)

// startEPP starts serve with the endpoint picker on a free port, waits for
// its engines, and dials the picker as a gateway does (plaintext HTTP/2).
func startEPP(t *testing.T, cfg Config) (*Server, *grpc.ClientConn) {
	t.Helper()
	if cfg.HealthInterval == 0 {
		cfg.HealthInterval = 50 * time.Millisecond
	}
	cfg.EPPAddr = "127.0.0.1:0"
	s := startServerWith(t, cfg)
	return s, dialEPP(t, s.EPPAddr())
}

func dialEPP(t *testing.T, addr string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

func completion(p []int, maxTokens int, stream bool) []byte {
	b, _ := json.Marshal(map[string]any{"model": "kvrouter-mock", "prompt": p, "max_tokens": maxTokens, "stream": stream})
	return b
}

// viaGateway sends a completion through a gateway that asks the picker,
// and returns the endpoint that served it and the answer.
func viaGateway(t *testing.T, gw *httptest.Server, body []byte) (string, []byte) {
	t.Helper()
	resp, err := http.Post(gw.URL+"/v1/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("through the gateway: %d %s", resp.StatusCode, out)
	}
	return resp.Header.Get(epp.ServedKey), out
}

// endpointOf is the picker's name for spec's engine.
func endpointOf(w WorkerSpec) string { return epp.Endpoint(w.URL) }

func loadOn(s *Server, id uint64) int {
	n := 0
	for _, l := range s.Router().Loads() {
		if l.Worker.ID == id {
			n += l.ActiveRequests
		}
	}
	return n
}

func totalLoad(s *Server) (n float64) {
	for _, l := range s.Router().Loads() {
		n += float64(l.ActiveRequests+l.ActivePrefillTokens) + l.ActiveDecodeBlocks
	}
	return n
}

// A prompt sent again through the gateway goes to the engine whose KV
// events say it caches the prompt, and the engine's answer comes back
// through the picker whole; every request's load is gone once its
// response ended.
func TestEPPSendsARepeatedPromptToTheEngineCachingIt(t *testing.T) {
	a, b := engineFleet(t), engineFleet(t)
	wa, wb := spec(1, a), spec(2, b)
	s, conn := startEPP(t, Config{Router: router.DefaultConfig(), Workers: []WorkerSpec{wa, wb}})
	gw := httptest.NewServer(&epptest.Gateway{Conn: conn})
	defer gw.Close()

	first, out := viaGateway(t, gw, completion(prompt(0, 1, 640), 3, false))
	if first != endpointOf(wa) && first != endpointOf(wb) {
		t.Fatalf("picked %q, not an engine (%s, %s)", first, endpointOf(wa), endpointOf(wb))
	}
	if !bytes.Contains(out, []byte(`"choices"`)) {
		t.Fatalf("the engine's answer did not come through the picker: %s", out)
	}
	firstID := uint64(1)
	if first == endpointOf(wb) {
		firstID = 2
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := s.Sources(firstID)[0].WaitFor(ctx, func(st enginesource.Stats) bool { return st.BlocksStored >= 40 }); err != nil {
		t.Fatalf("the engine's KV events never reached the router: %v", err)
	}
	for i := range 4 {
		got, out := viaGateway(t, gw, completion(append(prompt(0, 1, 640), prompt(0, 50+i, 64)...), 3, true))
		if got != first {
			t.Fatalf("follow-up %d went to %s; %s caches its prefix", i, got, first)
		}
		if !bytes.HasSuffix(bytes.TrimSpace(out), []byte("data: [DONE]")) {
			t.Fatalf("the stream did not come through the picker whole: %s", out)
		}
	}
	testwait.Until(t, 5*time.Second, "every request's load freed", func() bool { return totalLoad(s) == 0 })
}

// The request's load stays on its engine while the response comes, and
// goes at the response body's end of stream, not before.
func TestEPPHoldsTheLoadUntilTheResponseEnds(t *testing.T) {
	a := engineFleet(t)
	w := spec(1, a)
	s, conn := startEPP(t, Config{Router: router.DefaultConfig(), Workers: []WorkerSpec{w}})
	st, err := epptest.Open(context.Background(), conn)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Cancel()
	body := completion(prompt(0, 2, 300), 3, true)
	p, err := st.Request("POST", "/v1/completions", http.Header{"Content-Type": {"application/json"}}, body, 100, nil)
	if err != nil {
		t.Fatal(err)
	}
	if p.Immediate != nil {
		t.Fatalf("immediate response %v", p.Immediate)
	}
	if p.Endpoint != endpointOf(w) || p.Metadata != p.Endpoint {
		t.Fatalf("header %q, metadata %q; want both %q", p.Endpoint, p.Metadata, endpointOf(w))
	}
	if !bytes.Equal(p.Body, body) {
		t.Fatalf("the body sent back differs from the client's:\n%s\n%s", p.Body, body)
	}
	if loadOn(s, 1) != 1 {
		t.Fatalf("%d requests booked on the engine after the pick; want 1", loadOn(s, 1))
	}
	if err := st.ResponseHeaders(200, http.Header{"Content-Type": {"text/event-stream"}}, false); err != nil {
		t.Fatal(err)
	}
	chunk := []byte("data: {\"choices\":[{\"text\":\"a\"}]}\n\n")
	if echoed, err := st.ResponseBody(chunk, false); err != nil || !bytes.Equal(echoed, chunk) {
		t.Fatalf("chunk sent back %q, %v; want %q", echoed, err, chunk)
	}
	if loadOn(s, 1) != 1 {
		t.Fatal("the load left before the response's end")
	}
	if _, err := st.ResponseBody([]byte("data: [DONE]\n\n"), true); err != nil {
		t.Fatal(err)
	}
	if n := totalLoad(s); n != 0 {
		t.Fatalf("load %v left after the response's end of stream", n)
	}
	if err := st.Close(); err != nil {
		t.Fatal(err)
	}
}

// A gateway that cancels the stream (its client went away) frees the load
// as the end of the response would.
func TestEPPFreesTheLoadWhenTheStreamIsCancelled(t *testing.T) {
	a := engineFleet(t)
	s, conn := startEPP(t, Config{Router: router.DefaultConfig(), Workers: []WorkerSpec{spec(1, a)}})
	for _, stage := range []string{"after the pick", "after the response headers"} {
		st, err := epptest.Open(context.Background(), conn)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.Request("POST", "/v1/completions", nil, completion(prompt(0, 3, 200), 3, true), 0, nil); err != nil {
			t.Fatal(err)
		}
		if stage == "after the response headers" {
			if err := st.ResponseHeaders(200, nil, false); err != nil {
				t.Fatal(err)
			}
		}
		if loadOn(s, 1) != 1 {
			t.Fatalf("%s: %d requests booked; want 1", stage, loadOn(s, 1))
		}
		st.Cancel()
		testwait.Until(t, 5*time.Second, "the load freed after a cancel "+stage, func() bool { return totalLoad(s) == 0 })
	}
}

// The gateway's subset limits the pick, even away from the engine caching
// the prompt; a subset naming no engine in routing, or empty, is a 503.
func TestEPPHonoursTheEndpointSubset(t *testing.T) {
	a, b := engineFleet(t), engineFleet(t)
	wa, wb := spec(1, a), spec(2, b)
	_, conn := startEPP(t, Config{Router: router.DefaultConfig(), Workers: []WorkerSpec{wa, wb}})
	pick := func(subset []string) *epptest.Pick {
		t.Helper()
		st, err := epptest.Open(context.Background(), conn)
		if err != nil {
			t.Fatal(err)
		}
		defer st.Cancel()
		p, err := st.Request("POST", "/v1/completions", nil, completion(prompt(0, 4, 320), 2, false), 0, subset)
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	for _, only := range []WorkerSpec{wa, wb} {
		for range 3 {
			if p := pick([]string{endpointOf(only)}); p.Endpoint != endpointOf(only) {
				t.Fatalf("subset [%s] picked %q (immediate %v)", endpointOf(only), p.Endpoint, p.Immediate)
			}
		}
	}
	// An address without a port names the engines on that address.
	host := strings.Split(endpointOf(wa), ":")[0]
	if p := pick([]string{host}); p.Immediate != nil {
		t.Fatalf("subset [%s]: immediate %v", host, p.Immediate)
	}
	for _, subset := range [][]string{{"10.255.255.1:8000"}, {}} {
		p := pick(subset)
		if p.Immediate == nil || p.Immediate.GetStatus().GetCode() != http.StatusServiceUnavailable {
			t.Fatalf("subset %q: %+v; want an immediate 503", subset, p)
		}
	}
}

// No engine in routing: an immediate 503 with an OpenAI error body.
func TestEPPAnswers503WithoutAnEngine(t *testing.T) {
	dead := httptest.NewServer(http.NotFoundHandler())
	dead.Close()
	s, err := Start(context.Background(), Config{Router: router.DefaultConfig(), Addr: "127.0.0.1:0", EPPAddr: "127.0.0.1:0", HealthInterval: 50 * time.Millisecond,
		Workers: []WorkerSpec{{ID: 1, URL: dead.URL, Model: "kvrouter-mock"}}})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	st, err := epptest.Open(context.Background(), dialEPP(t, s.EPPAddr()))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Cancel()
	p, err := st.Request("POST", "/v1/chat/completions", nil, []byte(`{"model":"kvrouter-mock","messages":[{"role":"user","content":"hi"}]}`), 0, nil)
	if err != nil {
		t.Fatal(err)
	}
	im := p.Immediate
	if im == nil || im.GetStatus().GetCode() != http.StatusServiceUnavailable || !bytes.Contains(im.GetBody(), []byte(`"code":"no_workers"`)) {
		t.Fatalf("%+v; want an immediate 503 no_workers", p)
	}
}

// Every engine busy: the request is shed with an immediate 429; once the
// load is gone the same request is picked.
func TestEPPSheds429WhenEveryEngineIsBusy(t *testing.T) {
	a := engineFleet(t)
	rcfg := router.DefaultConfig()
	rcfg.QueueThreshold = nil
	zero := 0
	rcfg.Busy.ActivePrefillTokens = &zero
	s, conn := startEPP(t, Config{Router: rcfg, Workers: []WorkerSpec{spec(1, a)}})
	hold, err := epptest.Open(context.Background(), conn)
	if err != nil {
		t.Fatal(err)
	}
	defer hold.Cancel()
	if p, err := hold.Request("POST", "/v1/completions", nil, completion(prompt(0, 5, 64), 2, false), 0, nil); err != nil || p.Immediate != nil {
		t.Fatalf("%+v %v", p, err)
	}
	try := func() *epptest.Pick {
		st, err := epptest.Open(context.Background(), conn)
		if err != nil {
			t.Fatal(err)
		}
		defer st.Cancel()
		p, err := st.Request("POST", "/v1/completions", nil, completion(prompt(0, 6, 64), 2, false), 0, nil)
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	if p := try(); p.Immediate == nil || p.Immediate.GetStatus().GetCode() != http.StatusTooManyRequests || !bytes.Contains(p.Immediate.GetBody(), []byte("all_workers_busy")) {
		t.Fatalf("%+v; want an immediate 429 all_workers_busy", p)
	}
	hold.Cancel()
	testwait.Until(t, 5*time.Second, "the held request's load freed", func() bool { return totalLoad(s) == 0 })
	if p := try(); p.Immediate != nil {
		t.Fatalf("after the load went: immediate %v", p.Immediate)
	}
}

// The gateway reports the request served by another engine than the one
// picked: the load moves there, and leaves with the response's end.
func TestEPPMovesTheLoadToTheEngineThatServed(t *testing.T) {
	a, b := engineFleet(t), engineFleet(t)
	wa, wb := spec(1, a), spec(2, b)
	s, conn := startEPP(t, Config{Router: router.DefaultConfig(), Workers: []WorkerSpec{wa, wb}})
	st, err := epptest.Open(context.Background(), conn)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Cancel()
	p, err := st.Request("POST", "/v1/completions", nil, completion(prompt(0, 7, 128), 2, true), 0, []string{endpointOf(wa)})
	if err != nil || p.Endpoint != endpointOf(wa) {
		t.Fatalf("%+v %v", p, err)
	}
	st.Served = endpointOf(wb)
	if err := st.ResponseHeaders(200, nil, false); err != nil {
		t.Fatal(err)
	}
	if loadOn(s, 1) != 0 || loadOn(s, 2) != 1 {
		t.Fatalf("requests on the picked engine %d, on the serving one %d; want 0 and 1", loadOn(s, 1), loadOn(s, 2))
	}
	if _, err := st.ResponseBody([]byte("data: [DONE]\n\n"), true); err != nil {
		t.Fatal(err)
	}
	if n := totalLoad(s); n != 0 {
		t.Fatalf("load %v left after the response's end", n)
	}
}

// A request that is no completion or chat (here GET /v1/models, headers
// only) goes to an engine, unbooked.
func TestEPPPicksAnEngineForOtherRequests(t *testing.T) {
	a := engineFleet(t)
	w := spec(1, a)
	s, conn := startEPP(t, Config{Router: router.DefaultConfig(), Workers: []WorkerSpec{w}})
	st, err := epptest.Open(context.Background(), conn)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Cancel()
	p, err := st.Request("GET", "/v1/models", nil, nil, 0, nil)
	if err != nil || p.Endpoint != endpointOf(w) {
		t.Fatalf("%+v %v", p, err)
	}
	if n := totalLoad(s); n != 0 {
		t.Fatalf("an unrouted request booked load %v", n)
	}
}

// Liveness serves from the start; readiness and the ext_proc service
// follow the router's readiness and turn NOT_SERVING at a drain, liveness
// staying SERVING.
func TestEPPHealthServices(t *testing.T) {
	a := engineFleet(t)
	s, conn := startEPP(t, Config{Router: router.DefaultConfig(), Workers: []WorkerSpec{spec(1, a)}})
	hc := healthpb.NewHealthClient(conn)
	status := func(svc string) healthpb.HealthCheckResponse_ServingStatus {
		t.Helper()
		resp, err := hc.Check(context.Background(), &healthpb.HealthCheckRequest{Service: svc})
		if err != nil {
			t.Fatalf("%s: %v", svc, err)
		}
		return resp.GetStatus()
	}
	for _, svc := range []string{epp.LivenessService, epp.ReadinessService, epp.ExtProcService} {
		testwait.Until(t, 5*time.Second, svc+" SERVING", func() bool { return status(svc) == healthpb.HealthCheckResponse_SERVING })
	}
	s.fe.Drain()
	s.epp.picker.Drain()
	for _, svc := range []string{epp.ReadinessService, epp.ExtProcService} {
		if got := status(svc); got != healthpb.HealthCheckResponse_NOT_SERVING {
			t.Fatalf("%s is %s while draining", svc, got)
		}
	}
	if got := status(epp.LivenessService); got != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("liveness is %s while draining", got)
	}
}

// Before any engine is in routing the picker is alive but not ready; its
// health is served on the separate health port too.
func TestEPPNotReadyWithoutEngines(t *testing.T) {
	dead := httptest.NewServer(http.NotFoundHandler())
	dead.Close()
	s, err := Start(context.Background(), Config{Router: router.DefaultConfig(), Addr: "127.0.0.1:0", EPPAddr: "127.0.0.1:0", EPPHealthAddr: "127.0.0.1:0",
		HealthInterval: 50 * time.Millisecond, Workers: []WorkerSpec{{ID: 1, URL: dead.URL, Model: "kvrouter-mock"}}})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for _, addr := range []string{s.EPPAddr(), s.EPPHealthAddr()} {
		hc := healthpb.NewHealthClient(dialEPP(t, addr))
		for svc, want := range map[string]healthpb.HealthCheckResponse_ServingStatus{
			epp.LivenessService: healthpb.HealthCheckResponse_SERVING, epp.ReadinessService: healthpb.HealthCheckResponse_NOT_SERVING,
			epp.ExtProcService: healthpb.HealthCheckResponse_NOT_SERVING,
		} {
			resp, err := hc.Check(context.Background(), &healthpb.HealthCheckRequest{Service: svc})
			if err != nil || resp.GetStatus() != want {
				t.Fatalf("%s on %s: %v %v; want %s", svc, addr, resp.GetStatus(), err, want)
			}
		}
	}
}
