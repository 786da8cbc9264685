// Package epp is kvrouter as the endpoint picker (EPP) of the Gateway API
// Inference Extension: an Envoy ext_proc gRPC service that reads each
// OpenAI request's body, routes it with the router's own decision (the one
// the HTTP frontend makes) and tells the gateway which engine to send it
// to. The gateway forwards the request itself; the picker follows the
// response to its end so that the request's load counts on its engine as
// long as the engine works on it.
//
// # Protocol
//
// The endpoint picker protocol of the Inference Extension (proposal 004,
// v1.0), in ext_proc's FULL_DUPLEX_STREAMED body mode for request and
// response:
//
//   - request headers: kept until the body is whole (a request without a
//     body, e.g. GET /v1/models, is answered at once with any engine);
//   - request body chunks: gathered; at end of stream the request is
//     routed, then the headers are answered with the engine in the
//     x-gateway-destination-endpoint header and the same value under
//     dynamic metadata envoy.lb / x-gateway-destination-endpoint (and the
//     route cache cleared), then the body is sent back in chunks of at
//     most 62000 bytes: the bytes the HTTP frontend would send the engine
//     (the router's members removed, data_parallel_rank set);
//   - the subset: filter metadata envoy.lb.subset_hint /
//     x-gateway-destination-endpoint-subset, a list of ip:port, limits the
//     pick to those engines (an entry without a port names every engine on
//     that address); an empty list, or one naming no engine in routing, is
//     a 503;
//   - errors end the stream with an immediate response carrying an OpenAI
//     error body: 503 when no engine is ready, 429 when every engine is
//     busy (shedding), 400/404/413 for a request the frontend would refuse;
//   - response headers and body chunks are passed through unchanged; the
//     first body chunk marks the prefill complete, the response body's end
//     of stream (or response headers with end of stream, or trailers, or
//     the stream ending or being cancelled) frees the request's load;
//   - metadata envoy.lb / x-gateway-destination-endpoint-served on the
//     response says which engine served it: when it is another engine than
//     the one picked, the request's load moves there.
//
// The gRPC health service answers "liveness" (always SERVING),
// "readiness", "envoy.service.ext_proc.v3.ExternalProcessor" and ""
// (SERVING while the router can route every model it serves, NOT_SERVING
// while it cannot or drains).
package epp

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/kvrouter/kvrouter/adapters/frontend"
)

// The protocol's names.
const (
	DestinationHeader  = "x-gateway-destination-endpoint"
	ServedKey          = "x-gateway-destination-endpoint-served"
	SubsetKey          = "x-gateway-destination-endpoint-subset"
	LBNamespace        = "envoy.lb"
	SubsetNamespace    = "envoy.lb.subset_hint"
	ExtProcService     = "envoy.service.ext_proc.v3.ExternalProcessor"
	LivenessService    = "liveness"
	ReadinessService   = "readiness"
	maxStreamedBodyLen = 62000 // under the 64 KiB some proxies allow a streamed chunk
)

// Picker routes the requests: frontend.Frontend.
type Picker interface {
	Pick(ctx context.Context, pr frontend.PickRequest) (*frontend.Booking, *frontend.PickError)
	Ready() bool
	MaxBodyBytes() int64
}

// Config configures a Server.
type Config struct {
	Picker Picker
	// Workers are the engines in routing, to map endpoints (ip:port) to.
	Workers func() []frontend.Worker
	Logger  *slog.Logger
	// Registerer, optional, receives the picker's metrics.
	Registerer prometheus.Registerer
	// ReadyInterval is how often the health service re-reads readiness;
	// 0 means 250 ms.
	ReadyInterval time.Duration
}

// Server is the ext_proc service and its health service.
type Server struct {
	extprocv3.UnimplementedExternalProcessorServer
	cfg    Config
	log    *slog.Logger
	health *health.Server
	m      metrics
	// draining holds readiness off (Drain); readyMu orders it with the
	// readiness watch.
	readyMu  sync.Mutex
	draining bool
}

type metrics struct {
	requests *prometheus.CounterVec
	moved    prometheus.Counter
}

// New makes a Server; Register puts it on a gRPC server.
func New(cfg Config) *Server {
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.NewTextHandler(io.Discard, nil))
	}
	if cfg.ReadyInterval <= 0 {
		cfg.ReadyInterval = 250 * time.Millisecond
	}
	s := &Server{cfg: cfg, log: log, health: health.NewServer(), m: metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_epp_requests_total",
			Help: "Requests the endpoint picker answered, by outcome: routed (cache-aware, booked), any (not a completion or chat: any engine), or the HTTP status of its immediate response."}, []string{"outcome"}),
		moved: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvrouter_epp_served_elsewhere_total",
			Help: "Requests the gateway reported served by another engine than the one picked; their load moved there."}),
	}}
	if cfg.Registerer != nil {
		cfg.Registerer.MustRegister(s.m.requests, s.m.moved)
	}
	s.health.SetServingStatus(LivenessService, healthpb.HealthCheckResponse_SERVING)
	s.setReady(false)
	return s
}

// Register adds the ext_proc service and the health service to g.
func (s *Server) Register(g *grpc.Server) {
	extprocv3.RegisterExternalProcessorServer(g, s)
	s.RegisterHealth(g)
}

// RegisterHealth adds the health service alone (a separate health port).
func (s *Server) RegisterHealth(g *grpc.Server) {
	healthpb.RegisterHealthServer(g, s.health)
}

// WatchReadiness keeps the health service's readiness in step with the
// picker's until ctx ends.
func (s *Server) WatchReadiness(ctx context.Context) {
	t := time.NewTicker(s.cfg.ReadyInterval)
	defer t.Stop()
	for {
		s.setReady(s.cfg.Picker.Ready())
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Drain turns every service NOT_SERVING but liveness, for good: the
// first step of a graceful stop. Liveness stays SERVING: a probe failing
// then would kill the process before its requests end.
func (s *Server) Drain() {
	s.readyMu.Lock()
	s.draining = true
	s.readyMu.Unlock()
	s.setReady(false)
}

func (s *Server) setReady(ready bool) {
	s.readyMu.Lock()
	defer s.readyMu.Unlock()
	st := healthpb.HealthCheckResponse_NOT_SERVING
	if ready && !s.draining {
		st = healthpb.HealthCheckResponse_SERVING
	}
	for _, svc := range []string{"", ReadinessService, ExtProcService} {
		s.health.SetServingStatus(svc, st)
	}
}

// stream is one HTTP request's ext_proc stream.
type stream struct {
	s        *Server
	srv      extprocv3.ExternalProcessor_ProcessServer
	headers  http.Header
	path     string
	only     []uint64 // the subset's engines; nil: no subset
	subset   bool
	body     []byte
	booking  *frontend.Booking
	endpoint string
	// respDuplex is false when the gateway said it sends response bodies
	// in another mode than FULL_DUPLEX_STREAMED: their chunks are then
	// acknowledged, not sent back.
	respDuplex bool
	picked     bool
}

// Process serves one HTTP request's ext_proc stream.
func (s *Server) Process(srv extprocv3.ExternalProcessor_ProcessServer) error {
	st := &stream{s: s, srv: srv, respDuplex: true}
	defer func() {
		if st.booking != nil {
			st.booking.Release()
		}
	}()
	for {
		req, err := srv.Recv()
		if err != nil {
			if errors.Is(err, io.EOF) || status.Code(err) == codes.Canceled || srv.Context().Err() != nil {
				return nil
			}
			return err
		}
		done, err := st.handle(req)
		if err != nil || done {
			return err
		}
	}
}

// handle answers one message; done ends the stream.
func (st *stream) handle(req *extprocv3.ProcessingRequest) (done bool, err error) {
	if pc := req.GetProtocolConfig(); pc != nil {
		if m := pc.GetRequestBodyMode(); m != filterv3.ProcessingMode_FULL_DUPLEX_STREAMED {
			return true, status.Errorf(codes.FailedPrecondition, "kvrouter's endpoint picker needs request_body_mode FULL_DUPLEX_STREAMED, the gateway sends %s", m)
		}
		st.respDuplex = pc.GetResponseBodyMode() == filterv3.ProcessingMode_FULL_DUPLEX_STREAMED
	}
	st.readSubset(req.GetMetadataContext())
	switch v := req.Request.(type) {
	case *extprocv3.ProcessingRequest_RequestHeaders:
		st.headers, st.path = httpHeaders(v.RequestHeaders.GetHeaders())
		if v.RequestHeaders.GetEndOfStream() {
			return st.pick(false, false)
		}
	case *extprocv3.ProcessingRequest_RequestBody:
		st.body = append(st.body, v.RequestBody.GetBody()...)
		if limit := st.s.cfg.Picker.MaxBodyBytes(); int64(len(st.body)) > limit {
			return st.refuse(&frontend.PickError{Status: http.StatusRequestEntityTooLarge, Code: "request_too_large",
				Body: []byte(`{"error":{"message":"the request body is larger than ` + strconv.FormatInt(limit, 10) + ` bytes","type":"invalid_request_error","param":null,"code":"request_too_large"}}`)})
		}
		if v.RequestBody.GetEndOfStream() {
			return st.pick(true, true)
		}
	case *extprocv3.ProcessingRequest_RequestTrailers:
		if done, err := st.pick(true, false); done || err != nil {
			return done, err
		}
		return false, st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestTrailers{RequestTrailers: &extprocv3.TrailersResponse{}}})
	case *extprocv3.ProcessingRequest_ResponseHeaders:
		st.readServed(req.GetMetadataContext())
		if v.ResponseHeaders.GetEndOfStream() {
			st.release()
		}
		return false, st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseHeaders{ResponseHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{}}}})
	case *extprocv3.ProcessingRequest_ResponseBody:
		st.readServed(req.GetMetadataContext())
		b := v.ResponseBody
		if len(b.GetBody()) > 0 && st.booking != nil {
			st.booking.FirstToken()
		}
		if b.GetEndOfStream() {
			st.release()
		}
		if !st.respDuplex {
			return false, st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{Response: &extprocv3.CommonResponse{}}}})
		}
		return false, st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseBody{ResponseBody: &extprocv3.BodyResponse{Response: streamedBody(b.GetBody(), b.GetEndOfStream())}}})
	case *extprocv3.ProcessingRequest_ResponseTrailers:
		st.readServed(req.GetMetadataContext())
		st.release()
		return false, st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ResponseTrailers{ResponseTrailers: &extprocv3.TrailersResponse{}}})
	}
	return false, nil
}

func (st *stream) release() {
	if st.booking != nil {
		st.booking.Release()
	}
}

// pick routes the whole request and answers its headers, then, when it
// has one, its body (ending it when eos: trailers may follow).
func (st *stream) pick(hasBody, eos bool) (bool, error) {
	if st.picked {
		return false, nil
	}
	st.picked = true
	only := st.only
	if st.subset && only == nil {
		only = []uint64{}
	}
	b, perr := st.s.cfg.Picker.Pick(st.srv.Context(), frontend.PickRequest{Path: st.path, Header: st.headers, Body: st.body, Only: only})
	if perr != nil {
		if st.srv.Context().Err() != nil {
			return true, nil
		}
		return st.refuse(perr)
	}
	st.booking = b
	st.endpoint = Endpoint(b.Worker.BaseURL)
	body := st.body
	outcome := "any"
	if b.Routed {
		body, outcome = b.Body, "routed"
	}
	st.s.m.requests.WithLabelValues(outcome).Inc()
	st.body = nil
	set := []*corev3.HeaderValueOption{header(DestinationHeader, st.endpoint)}
	if len(body) > 0 {
		set = append(set, header("content-length", strconv.Itoa(len(body))))
	}
	if err := st.send(&extprocv3.ProcessingResponse{
		Response: &extprocv3.ProcessingResponse_RequestHeaders{RequestHeaders: &extprocv3.HeadersResponse{Response: &extprocv3.CommonResponse{
			ClearRouteCache: true,
			HeaderMutation:  &extprocv3.HeaderMutation{SetHeaders: set},
		}}},
		DynamicMetadata: destinationMetadata(st.endpoint),
	}); err != nil {
		return true, err
	}
	if !hasBody {
		return false, nil
	}
	for i := 0; ; i += maxStreamedBodyLen {
		end := min(i+maxStreamedBodyLen, len(body))
		if err := st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_RequestBody{RequestBody: &extprocv3.BodyResponse{Response: streamedBody(body[i:end], eos && end == len(body))}}}); err != nil {
			return true, err
		}
		if end == len(body) {
			return false, nil
		}
	}
}

// refuse ends the stream with an immediate response.
func (st *stream) refuse(perr *frontend.PickError) (bool, error) {
	st.s.m.requests.WithLabelValues(strconv.Itoa(perr.Status)).Inc()
	st.s.log.Debug("endpoint picker refused a request", "status", perr.Status, "code", perr.Code, "path", st.path)
	return true, st.send(&extprocv3.ProcessingResponse{Response: &extprocv3.ProcessingResponse_ImmediateResponse{ImmediateResponse: &extprocv3.ImmediateResponse{
		Status:  &typev3.HttpStatus{Code: typev3.StatusCode(perr.Status)},
		Headers: &extprocv3.HeaderMutation{SetHeaders: []*corev3.HeaderValueOption{header("content-type", "application/json")}},
		Body:    perr.Body,
		Details: "kvrouter_epp_" + perr.Code,
	}}})
}

func (st *stream) send(resp *extprocv3.ProcessingResponse) error {
	if err := st.srv.Send(resp); err != nil {
		return status.Errorf(codes.Unavailable, "sending to the gateway: %v", err)
	}
	return nil
}

// readSubset reads the gateway's subset of endpoints, if it sends one.
func (st *stream) readSubset(md *corev3.Metadata) {
	ns := md.GetFilterMetadata()[SubsetNamespace]
	if ns == nil {
		return
	}
	v, ok := ns.GetFields()[SubsetKey]
	if !ok {
		return
	}
	st.subset, st.only = true, nil
	ws := st.s.cfg.Workers()
	for _, e := range v.GetListValue().GetValues() {
		for _, w := range ws {
			if matches(e.GetStringValue(), w.BaseURL) {
				st.only = append(st.only, w.ID)
			}
		}
	}
}

// readServed moves the request's load to the engine the gateway says
// served it, when that is not the one picked.
func (st *stream) readServed(md *corev3.Metadata) {
	served := md.GetFilterMetadata()[LBNamespace].GetFields()[ServedKey].GetStringValue()
	if served == "" || st.booking == nil || !st.booking.Routed || sameEndpoint(served, st.endpoint) {
		return
	}
	st.s.m.moved.Inc()
	prev := st.endpoint
	st.endpoint = served
	for _, w := range st.s.cfg.Workers() {
		if sameEndpoint(served, Endpoint(w.BaseURL)) {
			if err := st.booking.MoveTo(st.srv.Context(), w.ID); err != nil {
				st.s.log.Warn("endpoint picker: could not move a request's load to the engine that served it", "picked", prev, "served", served, "err", err)
				st.booking.Release()
			}
			return
		}
	}
	st.s.log.Warn("endpoint picker: the gateway served a request on an endpoint that is no engine in routing", "picked", prev, "served", served)
	st.booking.Release()
}

// Endpoint is an engine's ip:port, as the gateway names it, from its base
// URL.
func Endpoint(baseURL string) string {
	u, err := url.Parse(baseURL)
	if err != nil || u.Host == "" {
		return baseURL
	}
	if u.Port() != "" {
		return u.Host
	}
	port := "80"
	if u.Scheme == "https" {
		port = "443"
	}
	return net.JoinHostPort(u.Hostname(), port)
}

func sameEndpoint(a, b string) bool {
	ha, pa, errA := net.SplitHostPort(a)
	hb, pb, errB := net.SplitHostPort(b)
	if errA != nil || errB != nil {
		return a == b
	}
	return pa == pb && sameHost(ha, hb)
}

func sameHost(a, b string) bool {
	ia, ib := net.ParseIP(a), net.ParseIP(b)
	if ia != nil && ib != nil {
		return ia.Equal(ib)
	}
	return strings.EqualFold(a, b)
}

// matches tells whether a subset entry (ip:port, or an address alone)
// names the engine at baseURL.
func matches(entry, baseURL string) bool {
	ep := Endpoint(baseURL)
	if _, _, err := net.SplitHostPort(entry); err == nil {
		return sameEndpoint(entry, ep)
	}
	host, _, err := net.SplitHostPort(ep)
	return err == nil && sameHost(strings.Trim(entry, "[]"), host)
}

// httpHeaders turns Envoy's headers into an http.Header and the path.
func httpHeaders(hm *corev3.HeaderMap) (http.Header, string) {
	h := http.Header{}
	path := ""
	for _, kv := range hm.GetHeaders() {
		v := kv.GetValue()
		if len(kv.GetRawValue()) > 0 {
			v = string(kv.GetRawValue())
		}
		if kv.GetKey() == ":path" {
			path = v
		}
		h.Add(kv.GetKey(), v)
	}
	return h, path
}

func header(key, value string) *corev3.HeaderValueOption {
	return &corev3.HeaderValueOption{
		Header:       &corev3.HeaderValue{Key: key, RawValue: []byte(value)},
		AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD,
	}
}

func streamedBody(b []byte, eos bool) *extprocv3.CommonResponse {
	return &extprocv3.CommonResponse{BodyMutation: &extprocv3.BodyMutation{Mutation: &extprocv3.BodyMutation_StreamedResponse{
		StreamedResponse: &extprocv3.StreamedBodyResponse{Body: b, EndOfStream: eos},
	}}}
}

func destinationMetadata(endpoint string) *structpb.Struct {
	return &structpb.Struct{Fields: map[string]*structpb.Value{
		LBNamespace: structpb.NewStructValue(&structpb.Struct{Fields: map[string]*structpb.Value{
			DestinationHeader: structpb.NewStringValue(endpoint),
		}}),
	}}
}
