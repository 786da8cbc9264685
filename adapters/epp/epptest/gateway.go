// Package epptest is a gateway in miniature that uses an endpoint picker
// as Envoy's ext_proc filter does in FULL_DUPLEX_STREAMED mode (the
// Gateway API Inference Extension's configuration): the request's headers,
// its body in chunks up to end of stream, then, once the picker has
// answered with an endpoint, the upstream's response headers and its body
// chunk by chunk, each sent back through the picker. Tests and benchmarks
// drive the picker through it where no Envoy can run; it is no proxy for
// production (no retries, no TLS upstream, one endpoint).
package epptest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/structpb"
)

// The protocol's names (proposal 004 of the Inference Extension).
const (
	destinationHeader = "x-gateway-destination-endpoint"
	servedKey         = "x-gateway-destination-endpoint-served"
	subsetKey         = "x-gateway-destination-endpoint-subset"
	lbNamespace       = "envoy.lb"
	subsetNamespace   = "envoy.lb.subset_hint"
)

// Stream is one request's ext_proc stream, as Envoy holds it.
type Stream struct {
	pc     extprocv3.ExternalProcessor_ProcessClient
	cancel context.CancelFunc
	// Served, when set, is sent as the endpoint that served the request
	// (metadata envoy.lb / x-gateway-destination-endpoint-served) with
	// every response message.
	Served string
}

// Open starts a request's stream on conn; Cancel (or ctx) ends it as
// Envoy does when its client goes away.
func Open(ctx context.Context, conn grpc.ClientConnInterface) (*Stream, error) {
	ctx, cancel := context.WithCancel(ctx)
	pc, err := extprocv3.NewExternalProcessorClient(conn).Process(ctx)
	if err != nil {
		cancel()
		return nil, err
	}
	return &Stream{pc: pc, cancel: cancel}, nil
}

// Cancel resets the stream, as Envoy does when the downstream client
// disconnects mid-request.
func (s *Stream) Cancel() { s.cancel() }

// Close ends the stream as Envoy does after the response: half-close,
// then wait for the picker's end.
func (s *Stream) Close() error {
	defer s.cancel()
	if err := s.pc.CloseSend(); err != nil {
		return err
	}
	for {
		if _, err := s.pc.Recv(); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
	}
}

// Pick is the picker's answer to a request.
type Pick struct {
	// Endpoint is the x-gateway-destination-endpoint header it set, and
	// Metadata the same under dynamic metadata envoy.lb.
	Endpoint, Metadata string
	// Headers are the request's headers once the picker's mutation is
	// applied.
	Headers map[string]string
	// Body is the request body it sent back (the bytes for upstream).
	Body []byte
	// Immediate is its immediate response instead of an endpoint.
	Immediate *extprocv3.ImmediateResponse
	// Latency is from the request's headers sent to the headers' answer
	// received: what the picker adds before the request can leave.
	Latency time.Duration
}

// Request sends the request as Envoy does — headers (with end of stream
// when there is no body), then the body in chunks of chunk bytes, the last
// with end of stream, all without waiting — then reads the picker's
// answer: the headers' response, then the body's until its end of stream,
// or an immediate response. subset, when not nil, is sent as the
// endpoint subset in filter metadata.
func (s *Stream) Request(method, path string, header http.Header, body []byte, chunk int, subset []string) (*Pick, error) {
	hs := []*corev3.HeaderValue{
		{Key: ":method", RawValue: []byte(method)}, {Key: ":path", RawValue: []byte(path)},
		{Key: ":scheme", RawValue: []byte("http")}, {Key: ":authority", RawValue: []byte("gateway")},
	}
	for k, vs := range header {
		for _, v := range vs {
			hs = append(hs, &corev3.HeaderValue{Key: strings.ToLower(k), RawValue: []byte(v)})
		}
	}
	if len(body) > 0 {
		hs = append(hs, &corev3.HeaderValue{Key: "content-length", RawValue: []byte(strconv.Itoa(len(body)))})
	}
	first := &extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{
		Headers: &corev3.HeaderMap{Headers: hs}, EndOfStream: len(body) == 0,
	}}}
	if subset != nil {
		vals := make([]*structpb.Value, len(subset))
		for i, e := range subset {
			vals[i] = structpb.NewStringValue(e)
		}
		first.MetadataContext = &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
			subsetNamespace: {Fields: map[string]*structpb.Value{subsetKey: structpb.NewListValue(&structpb.ListValue{Values: vals})}},
		}}
	}
	start := time.Now()
	if err := s.pc.Send(first); err != nil {
		return nil, err
	}
	if chunk <= 0 {
		chunk = 16 << 10
	}
	for i := 0; i < len(body); i += chunk {
		end := min(i+chunk, len(body))
		if err := s.pc.Send(&extprocv3.ProcessingRequest{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{
			Body: body[i:end], EndOfStream: end == len(body),
		}}}); err != nil {
			// io.EOF: the picker ended the stream early (a refusal
			// before the whole body); its answer waits in Recv, as
			// it does for Envoy.
			if errors.Is(err, io.EOF) {
				break
			}
			return nil, err
		}
	}
	resp, err := s.pc.Recv()
	if err != nil {
		return nil, err
	}
	p := &Pick{Latency: time.Since(start), Headers: map[string]string{}}
	if im := resp.GetImmediateResponse(); im != nil {
		p.Immediate = im
		return p, nil
	}
	hr := resp.GetRequestHeaders()
	if hr == nil {
		return nil, fmt.Errorf("the picker answered the request headers with %T", resp.Response)
	}
	if !hr.GetResponse().GetClearRouteCache() {
		return nil, errors.New("the picker's headers response does not clear the route cache: Envoy would keep the route it had chosen")
	}
	// The headers as Envoy applies the mutation to the request's: a set
	// header is appended to one the request has unless its action says
	// otherwise.
	for _, h := range hs {
		p.Headers[h.Key] = string(h.RawValue)
	}
	for _, h := range hr.GetResponse().GetHeaderMutation().GetSetHeaders() {
		k, v := strings.ToLower(h.GetHeader().GetKey()), string(h.GetHeader().GetRawValue())
		if v == "" {
			v = h.GetHeader().GetValue()
		}
		old, had := p.Headers[k]
		switch h.GetAppendAction() {
		case corev3.HeaderValueOption_APPEND_IF_EXISTS_OR_ADD:
			if had {
				v = old + "," + v
			}
		case corev3.HeaderValueOption_ADD_IF_ABSENT:
			if had {
				v = old
			}
		case corev3.HeaderValueOption_OVERWRITE_IF_EXISTS:
			if !had {
				continue
			}
		}
		p.Headers[k] = v
	}
	p.Endpoint = p.Headers[destinationHeader]
	p.Metadata = resp.GetDynamicMetadata().GetFields()[lbNamespace].GetStructValue().GetFields()[destinationHeader].GetStringValue()
	if len(body) == 0 {
		return p, nil
	}
	for {
		resp, err := s.pc.Recv()
		if err != nil {
			return nil, err
		}
		br := resp.GetRequestBody()
		if br == nil {
			return nil, fmt.Errorf("the picker answered a request body chunk with %T", resp.Response)
		}
		sr := br.GetResponse().GetBodyMutation().GetStreamedResponse()
		if sr == nil {
			return nil, errors.New("the picker answered a request body chunk without a streamed body (FULL_DUPLEX_STREAMED needs one)")
		}
		p.Body = append(p.Body, sr.GetBody()...)
		if sr.GetEndOfStream() {
			return p, nil
		}
	}
}

func (s *Stream) metadata() *corev3.Metadata {
	if s.Served == "" {
		return nil
	}
	return &corev3.Metadata{FilterMetadata: map[string]*structpb.Struct{
		lbNamespace: {Fields: map[string]*structpb.Value{servedKey: structpb.NewStringValue(s.Served)}},
	}}
}

// ResponseHeaders sends the upstream's response headers and reads the
// picker's answer.
func (s *Stream) ResponseHeaders(status int, header http.Header, eos bool) error {
	hs := []*corev3.HeaderValue{{Key: ":status", RawValue: []byte(strconv.Itoa(status))}}
	for k, vs := range header {
		for _, v := range vs {
			hs = append(hs, &corev3.HeaderValue{Key: strings.ToLower(k), RawValue: []byte(v)})
		}
	}
	if err := s.pc.Send(&extprocv3.ProcessingRequest{MetadataContext: s.metadata(), Request: &extprocv3.ProcessingRequest_ResponseHeaders{ResponseHeaders: &extprocv3.HttpHeaders{
		Headers: &corev3.HeaderMap{Headers: hs}, EndOfStream: eos,
	}}}); err != nil {
		return err
	}
	resp, err := s.pc.Recv()
	if err != nil {
		return err
	}
	if resp.GetResponseHeaders() == nil {
		return fmt.Errorf("the picker answered the response headers with %T", resp.Response)
	}
	return nil
}

// ResponseBody sends one chunk of the upstream's response body and
// returns what the picker sends back for the client.
func (s *Stream) ResponseBody(chunk []byte, eos bool) ([]byte, error) {
	if err := s.pc.Send(&extprocv3.ProcessingRequest{MetadataContext: s.metadata(), Request: &extprocv3.ProcessingRequest_ResponseBody{ResponseBody: &extprocv3.HttpBody{
		Body: chunk, EndOfStream: eos,
	}}}); err != nil {
		return nil, err
	}
	var out []byte
	for {
		resp, err := s.pc.Recv()
		if err != nil {
			return nil, err
		}
		br := resp.GetResponseBody()
		if br == nil {
			return nil, fmt.Errorf("the picker answered a response body chunk with %T", resp.Response)
		}
		sr := br.GetResponse().GetBodyMutation().GetStreamedResponse()
		if sr == nil {
			return nil, errors.New("the picker answered a response body chunk without a streamed body (FULL_DUPLEX_STREAMED needs one)")
		}
		out = append(out, sr.GetBody()...)
		if sr.GetEndOfStream() || !eos {
			return out, nil
		}
	}
}

// Gateway is an HTTP server in front of the engines that asks the picker
// on Conn where each request goes, as an Inference Extension gateway
// does, and proxies it there.
type Gateway struct {
	Conn grpc.ClientConnInterface
	// Client reaches the engines; nil is http.DefaultClient.
	Client *http.Client
	// Subset, when not nil, is sent with every request.
	Subset []string

	mu     sync.Mutex
	picks  []time.Duration
	chunks []time.Duration
}

// Picks returns the picker's latency of every request so far (Pick.Latency).
func (g *Gateway) Picks() []time.Duration {
	g.mu.Lock()
	defer g.mu.Unlock()
	return slices.Clone(g.picks)
}

// Chunks returns, for every response body chunk so far, the time from
// sending it to the picker to having it back for the client.
func (g *Gateway) Chunks() []time.Duration {
	g.mu.Lock()
	defer g.mu.Unlock()
	return slices.Clone(g.chunks)
}

func (g *Gateway) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	st, err := Open(r.Context(), g.Conn)
	if err != nil {
		http.Error(w, "ext_proc: "+err.Error(), http.StatusInternalServerError)
		return
	}
	defer st.Cancel()
	header := r.Header.Clone()
	header.Del("Content-Length")
	p, err := st.Request(r.Method, r.URL.RequestURI(), header, body, 0, g.Subset)
	if err != nil {
		http.Error(w, "ext_proc: "+err.Error(), http.StatusInternalServerError)
		return
	}
	g.mu.Lock()
	g.picks = append(g.picks, p.Latency)
	g.mu.Unlock()
	if im := p.Immediate; im != nil {
		for _, h := range im.GetHeaders().GetSetHeaders() {
			w.Header().Set(h.GetHeader().GetKey(), string(h.GetHeader().GetRawValue()))
		}
		w.WriteHeader(int(im.GetStatus().GetCode()))
		_, _ = w.Write(im.GetBody())
		return
	}
	if p.Endpoint == "" || p.Endpoint != p.Metadata {
		http.Error(w, fmt.Sprintf("the picker named endpoint %q in the header and %q in metadata", p.Endpoint, p.Metadata), http.StatusInternalServerError)
		return
	}
	up, err := http.NewRequestWithContext(r.Context(), r.Method, "http://"+p.Endpoint+r.URL.RequestURI(), bytes.NewReader(p.Body))
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	up.Header = header
	client := g.Client
	if client == nil {
		client = http.DefaultClient
	}
	resp, err := client.Do(up)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	defer resp.Body.Close()
	if err := st.ResponseHeaders(resp.StatusCode, resp.Header, false); err != nil {
		http.Error(w, "ext_proc: "+err.Error(), http.StatusInternalServerError)
		return
	}
	for k, vs := range resp.Header {
		if k != "Content-Length" {
			w.Header()[k] = vs
		}
	}
	// Tells the client which engine served it (Envoy's conformance
	// backends echo it likewise).
	w.Header().Set(servedKey, p.Endpoint)
	w.Header().Set(destinationHeader, p.Endpoint)
	w.WriteHeader(resp.StatusCode)
	flusher, _ := w.(http.Flusher)
	buf := make([]byte, 32<<10)
	for {
		n, rerr := resp.Body.Read(buf)
		eos := rerr != nil
		if n > 0 || eos {
			t0 := time.Now()
			out, err := st.ResponseBody(buf[:n], eos)
			if err != nil {
				return
			}
			g.mu.Lock()
			g.chunks = append(g.chunks, time.Since(t0))
			g.mu.Unlock()
			if _, err := w.Write(out); err != nil {
				return
			}
			if flusher != nil {
				flusher.Flush()
			}
		}
		if eos {
			_ = st.Close()
			return
		}
	}
}
