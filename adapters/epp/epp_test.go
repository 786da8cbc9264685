package epp

import (
	"bytes"
	"context"
	"net"
	"net/http"
	"strings"
	"testing"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	filterv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/service/ext_proc/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/kvrouter/kvrouter/adapters/epp/epptest"
	"github.com/kvrouter/kvrouter/adapters/frontend"
)

// fixedPicker picks one engine and sends back body (the request's own
// bytes when nil); it records what it was asked.
type fixedPicker struct {
	worker frontend.Worker
	body   []byte
	max    int64
	asked  []frontend.PickRequest
}

func (p *fixedPicker) Pick(_ context.Context, pr frontend.PickRequest) (*frontend.Booking, *frontend.PickError) {
	p.asked = append(p.asked, pr)
	body := p.body
	if body == nil {
		body = pr.Body
	}
	return &frontend.Booking{Worker: p.worker, Body: body, Routed: true}, nil
}
func (p *fixedPicker) Ready() bool         { return true }
func (p *fixedPicker) MaxBodyBytes() int64 { return p.max }

func serveFake(t *testing.T, p Picker) *grpc.ClientConn {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	New(Config{Picker: p, Workers: func() []frontend.Worker { return nil }}).Register(g)
	go func() { _ = g.Serve(ln) }()
	t.Cleanup(g.Stop)
	conn, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

func TestEndpointOfABaseURL(t *testing.T) {
	for url, want := range map[string]string{
		"http://10.0.0.7:8000":    "10.0.0.7:8000",
		"http://10.0.0.7:8000/":   "10.0.0.7:8000",
		"http://10.0.0.7":         "10.0.0.7:80",
		"https://10.0.0.7":        "10.0.0.7:443",
		"http://[fd00::7]:8000":   "[fd00::7]:8000",
		"http://vllm-0.vllm:8000": "vllm-0.vllm:8000",
	} {
		if got := Endpoint(url); got != want {
			t.Errorf("Endpoint(%q) = %q, want %q", url, got, want)
		}
	}
}

func TestSubsetEntriesMatchEngines(t *testing.T) {
	for _, c := range []struct {
		entry, url string
		want       bool
	}{
		{"10.0.0.7:8000", "http://10.0.0.7:8000", true},
		{"10.0.0.7:8001", "http://10.0.0.7:8000", false},
		{"10.0.0.8:8000", "http://10.0.0.7:8000", false},
		{"10.0.0.7", "http://10.0.0.7:8000", true},
		{"[fd00::7]:8000", "http://[fd00:0::7]:8000", true},
		{"fd00::7", "http://[fd00::7]:8000", true},
		{"", "http://10.0.0.7:8000", false},
	} {
		if got := matches(c.entry, c.url); got != c.want {
			t.Errorf("matches(%q, %q) = %v, want %v", c.entry, c.url, got, c.want)
		}
	}
}

// A body larger than one streamed chunk goes back in chunks of at most
// 62000 bytes, the last with end of stream; the content length is the new
// body's, and a destination header the client sent is overwritten, not
// added to.
func TestLargeBodiesGoBackInChunks(t *testing.T) {
	big := bytes.Repeat([]byte("x"), 150000)
	p := &fixedPicker{worker: frontend.Worker{ID: 1, BaseURL: "http://10.0.0.7:8000"}, body: big, max: 1 << 20}
	st, err := epptest.Open(context.Background(), serveFake(t, p))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Cancel()
	pick, err := st.Request("POST", "/v1/completions", http.Header{DestinationHeader: {"10.6.6.6:80"}}, []byte(`{"model":"m","prompt":"hi"}`), 7, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(pick.Body, big) || pick.Endpoint != "10.0.0.7:8000" || pick.Headers["content-length"] != "150000" {
		t.Fatalf("endpoint %q, headers %v, body of %d bytes", pick.Endpoint, pick.Headers, len(pick.Body))
	}
	if got := p.asked[0].Body; string(got) != `{"model":"m","prompt":"hi"}` || p.asked[0].Path != "/v1/completions" || p.asked[0].Only != nil {
		t.Fatalf("the picker was asked %+v", p.asked[0])
	}
}

// Each chunk goes back as at most 62000 bytes (Envoy's limit on a streamed
// body message is 64 KiB in some gateways).
func TestStreamedChunksStayUnderTheLimit(t *testing.T) {
	for n, want := range map[int]int{0: 1, 1: 1, 62000: 1, 62001: 2, 150000: 3} {
		p := &fixedPicker{worker: frontend.Worker{ID: 1, BaseURL: "http://10.0.0.7:8000"}, body: bytes.Repeat([]byte("y"), n), max: 1 << 20}
		conn := serveFake(t, p)
		pc, err := extprocv3.NewExternalProcessorClient(conn).Process(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		send := []*extprocv3.ProcessingRequest{
			{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":path", RawValue: []byte("/v1/completions")}}}}}},
			{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: []byte("{}"), EndOfStream: true}}},
		}
		for _, m := range send {
			if err := pc.Send(m); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := pc.Recv(); err != nil {
			t.Fatal(err)
		}
		chunks := 0
		for {
			resp, err := pc.Recv()
			if err != nil {
				t.Fatal(err)
			}
			sr := resp.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
			chunks++
			if len(sr.GetBody()) > maxStreamedBodyLen {
				t.Fatalf("%d bytes: a chunk of %d", n, len(sr.GetBody()))
			}
			if sr.GetEndOfStream() {
				break
			}
		}
		if chunks != want {
			t.Errorf("%d bytes went back in %d chunks, want %d", n, chunks, want)
		}
		_ = pc.CloseSend()
	}
}

// A body over the frontend's limit is refused with a 413 before it is
// read whole.
func TestOversizedBodyIs413(t *testing.T) {
	p := &fixedPicker{worker: frontend.Worker{ID: 1, BaseURL: "http://10.0.0.7:8000"}, max: 100}
	st, err := epptest.Open(context.Background(), serveFake(t, p))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Cancel()
	pick, err := st.Request("POST", "/v1/completions", nil, bytes.Repeat([]byte(" "), 1000), 64, nil)
	if err != nil {
		t.Fatal(err)
	}
	if pick.Immediate.GetStatus().GetCode() != http.StatusRequestEntityTooLarge || !bytes.Contains(pick.Immediate.GetBody(), []byte("request_too_large")) || len(p.asked) != 0 {
		t.Fatalf("%+v, picker asked %d times", pick.Immediate, len(p.asked))
	}
}

// A gateway configured for another body mode than FULL_DUPLEX_STREAMED is
// told so: the picker would otherwise hang it (BUFFERED waits for the
// headers' answer that the picker gives only after the body).
func TestOtherBodyModesAreRefused(t *testing.T) {
	conn := serveFake(t, &fixedPicker{max: 1 << 20})
	pc, err := extprocv3.NewExternalProcessorClient(conn).Process(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if err := pc.Send(&extprocv3.ProcessingRequest{
		ProtocolConfig: &extprocv3.ProtocolConfiguration{RequestBodyMode: filterv3.ProcessingMode_BUFFERED},
		Request:        &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{}}},
	}); err != nil {
		t.Fatal(err)
	}
	_, err = pc.Recv()
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "FULL_DUPLEX_STREAMED") {
		t.Fatalf("%v; want FailedPrecondition naming FULL_DUPLEX_STREAMED", err)
	}
}

// Request trailers end the body too: the pick comes then, the body goes
// back without end of stream, and the trailers are answered.
func TestRequestTrailersEndTheBody(t *testing.T) {
	p := &fixedPicker{worker: frontend.Worker{ID: 1, BaseURL: "http://10.0.0.7:8000"}, max: 1 << 20}
	pc, err := extprocv3.NewExternalProcessorClient(serveFake(t, p)).Process(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range []*extprocv3.ProcessingRequest{
		{Request: &extprocv3.ProcessingRequest_RequestHeaders{RequestHeaders: &extprocv3.HttpHeaders{Headers: &corev3.HeaderMap{Headers: []*corev3.HeaderValue{{Key: ":path", RawValue: []byte("/v1/completions")}}}}}},
		{Request: &extprocv3.ProcessingRequest_RequestBody{RequestBody: &extprocv3.HttpBody{Body: []byte(`{"a":1}`)}}},
		{Request: &extprocv3.ProcessingRequest_RequestTrailers{RequestTrailers: &extprocv3.HttpTrailers{}}},
	} {
		if err := pc.Send(m); err != nil {
			t.Fatal(err)
		}
	}
	var kinds []string
	for range 3 {
		resp, err := pc.Recv()
		if err != nil {
			t.Fatal(err)
		}
		switch {
		case resp.GetRequestHeaders() != nil:
			kinds = append(kinds, "headers")
		case resp.GetRequestBody() != nil:
			sr := resp.GetRequestBody().GetResponse().GetBodyMutation().GetStreamedResponse()
			if string(sr.GetBody()) != `{"a":1}` || sr.GetEndOfStream() {
				t.Fatalf("body %q eos %v", sr.GetBody(), sr.GetEndOfStream())
			}
			kinds = append(kinds, "body")
		case resp.GetRequestTrailers() != nil:
			kinds = append(kinds, "trailers")
		}
	}
	if strings.Join(kinds, ",") != "headers,body,trailers" {
		t.Fatalf("answered %v", kinds)
	}
}
