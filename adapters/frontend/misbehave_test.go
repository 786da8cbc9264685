package frontend

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/internal/testwait"
)

// TestSSEReaderBoundsAnEvent: an engine's event may not grow past
// maxEventBytes (1 MiB), whether in one line or many.
func TestSSEReaderBoundsAnEvent(t *testing.T) {
	line := "data: \"" + strings.Repeat("x", 1<<20) + "\"\n\n"
	lines := strings.Repeat("data: "+strings.Repeat("y", 1000)+"\n", 1100) + "\n"
	for _, in := range []string{line, lines} {
		_, err := newSSEReader(strings.NewReader(in)).next()
		if !errors.Is(err, errMalformed) {
			t.Fatalf("an event of %d bytes: %v, want it refused", len(in), err)
		}
	}
	ok := "data: \"" + strings.Repeat("x", 1<<19) + "\"\n\n"
	if ev, err := newSSEReader(strings.NewReader(ok)).next(); err != nil || len(ev.data) != 1<<19+2 {
		t.Fatalf("an event of 512 KiB: %v", err)
	}
}

// TestSSEReaderReusesItsBuffers: reading a stream costs the reader's
// buffers, not an allocation or two per event.
func TestSSEReaderReusesItsBuffers(t *testing.T) {
	in := []byte(strings.Repeat("data: {\"choices\":[{\"index\":0,\"text\":\"tok\"}]}\n\n", 1000) + "event: x\ndata: a\ndata: b\n\n")
	var events int
	allocs := testing.AllocsPerRun(5, func() {
		s := newSSEReader(bytes.NewReader(in))
		events = 0
		for {
			if _, err := s.next(); err != nil {
				return
			}
			events++
		}
	})
	if events != 1001 {
		t.Fatalf("%d events", events)
	}
	if allocs > 20 {
		t.Fatalf("%v allocations to read 1001 events", allocs)
	}
}

// TestHugeEventEndsTheStream: an engine line beyond the bound ends the
// client's stream with an error event and [DONE].
func TestHugeEventEndsTheStream(t *testing.T) {
	e := newEnv(t, envOpts{})
	e.fake(1, "m", 1, sseHandler([]string{"data: {\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\n", "data: \"" + strings.Repeat("x", 2<<20) + "\"\n\n", "data: [DONE]\n\n"}, ""))
	resp, body := e.post("/v1/completions", map[string]any{"model": "m", "prompt": tokens(16, 1), "stream": true})
	data := sseData(t, bytes.NewReader(body))
	if resp.StatusCode != 200 || len(data) != 3 || !strings.Contains(data[1], "engine_stream_error") || data[2] != "[DONE]" {
		t.Fatalf("%d %.300q", resp.StatusCode, data)
	}
	e.settle()
}

// TestNonStreamAnswerToAStreamIsAnError: a client that asked for a stream
// cannot read a JSON answer as one, nor would it ever see [DONE].
func TestNonStreamAnswerToAStreamIsAnError(t *testing.T) {
	e := newEnv(t, envOpts{})
	e.fake(1, "m", 1, func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, `{"id":"c","choices":[{"index":0,"text":"hello"}]}`)
	})
	resp, body := e.post("/v1/completions", map[string]any{"model": "m", "prompt": tokens(16, 1), "stream": true})
	if code := openAIError(t, resp, body, http.StatusBadGateway); code != "engine_stream_error" {
		t.Fatalf("code %q: %s", code, body)
	}
	// Not streamed, the same answer is the client's.
	if resp, body := e.post("/v1/completions", map[string]any{"model": "m", "prompt": tokens(16, 1)}); resp.StatusCode != 200 || !strings.Contains(string(body), "hello") {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	e.settle()
}

// TestEnginesServerHeaderIsNotRelayed: what the engine runs is not the
// client's business.
func TestEnginesServerHeaderIsNotRelayed(t *testing.T) {
	e := newEnv(t, envOpts{})
	e.fake(1, "m", 1, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Server", "uvicorn-internal/0.1")
		if strings.Contains(r.URL.Path, "tokenize") {
			_, _ = io.WriteString(w, `{"tokens":[1,2,3]}`)
			return
		}
		b, _ := io.ReadAll(r.Body)
		switch {
		case bytes.Contains(b, []byte(`"max_tokens":99`)):
			w.WriteHeader(http.StatusBadRequest)
			_, _ = io.WriteString(w, `{"error":{"message":"no","code":400}}`)
		case bytes.Contains(b, []byte(`"stream":true`)):
			sseHandler([]string{"data: {\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\n", "data: [DONE]\n\n"}, "")(w, r)
		default:
			_, _ = io.WriteString(w, `{"choices":[{"index":0,"text":"a"}]}`)
		}
	})
	for _, req := range []map[string]any{
		{"model": "m", "prompt": tokens(16, 1)},
		{"model": "m", "prompt": tokens(16, 2), "stream": true},
		{"model": "m", "prompt": tokens(16, 3), "max_tokens": 99},
	} {
		resp, body := e.post("/v1/completions", req)
		if s := resp.Header.Get("Server"); s != "" {
			t.Fatalf("Server %q relayed (%d %s)", s, resp.StatusCode, body)
		}
	}
	e.settle()
}

// resetEngine accepts a request and resets the connection (RST), as an
// engine that crashes does; with midStream, after the headers and a first
// chunk of a stream, once release is closed.
func resetEngine(midStream bool, release <-chan struct{}) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		conn, buf, err := http.NewResponseController(w).Hijack()
		if err != nil {
			panic(err)
		}
		if midStream {
			_, _ = buf.WriteString("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
			chunk := "data: {\"choices\":[{\"index\":0,\"text\":\"a\"}]}\n\n"
			_, _ = fmt.Fprintf(buf, "%x\r\n%s\r\n", len(chunk), chunk)
			_ = buf.Flush()
			<-release
		}
		_ = conn.(*net.TCPConn).SetLinger(0)
		_ = conn.Close()
	}
}

// TestEngineFailuresKeepAddressesFromTheClient: what the client is told of
// an engine's failure names the engine, not sockets ("read tcp
// 127.0.0.1:…->…"); the log has the detail.
func TestEngineFailuresKeepAddressesFromTheClient(t *testing.T) {
	refused := func(e *env) { e.add(Worker{ID: 1, Name: "engine-one", BaseURL: closedURL(t), Model: "m", DPSize: 1}) }
	whole := func(e *env, req map[string]any) []byte { _, body := e.post("/v1/completions", req); return body }
	release := make(chan struct{})
	for _, tc := range []struct {
		name    string
		engine  func(e *env)
		request map[string]any
		send    func(e *env, req map[string]any) []byte
		logged  string
	}{
		{"refused", refused, map[string]any{"model": "m", "prompt": tokens(16, 1)}, whole, "connection refused"},
		{"tokenize refused", refused, map[string]any{"model": "m", "prompt": "some text"}, whole, "connection refused"},
		{"reset before answering", func(e *env) { e.fake(1, "m", 1, resetEngine(false, nil)) },
			map[string]any{"model": "m", "prompt": tokens(16, 1)}, whole, "127.0.0.1"},
		{"reset mid-stream", func(e *env) { e.fake(1, "m", 1, resetEngine(true, release)) },
			map[string]any{"model": "m", "prompt": tokens(16, 1), "stream": true},
			func(e *env, req map[string]any) []byte {
				b, _ := json.Marshal(req)
				resp, err := http.Post(e.srv.URL+"/v1/completions", "application/json", bytes.NewReader(b))
				if err != nil {
					t.Fatal(err)
				}
				defer resp.Body.Close()
				br := bufio.NewReader(resp.Body)
				first, err := br.ReadString('\n')
				if err != nil || !strings.HasPrefix(first, "data: ") {
					t.Fatalf("first line %q: %v", first, err)
				}
				close(release) // the chunk reached the client: now the reset
				rest, _ := io.ReadAll(br)
				return append([]byte(first), rest...)
			}, "127.0.0.1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var log testwait.Buffer
			e := newEnv(t, envOpts{frontend: func(c *Config) { c.Logger = slog.New(slog.NewTextHandler(&log, nil)) }})
			tc.engine(e)
			body := tc.send(e, tc.request)
			if !strings.Contains(string(body), "engine") {
				t.Fatalf("the client is not told which engine failed: %s", body)
			}
			for _, leak := range []string{"127.0.0.1", "tcp", "dial", "http://"} {
				if strings.Contains(string(body), leak) {
					t.Fatalf("the client got %q: %s", leak, body)
				}
			}
			e.settle()
			if !strings.Contains(log.String(), tc.logged) {
				t.Fatalf("the log lacks %q:\n%s", tc.logged, log.String())
			}
		})
	}
}

// BenchmarkHugeEvents150Streams: 150 streams at once whose engine sends
// one 15 MiB line each; reports the peak heap in use and what is left
// after a GC.
func BenchmarkHugeEvents150Streams(b *testing.B) {
	line := "data: \"" + strings.Repeat("x", 15<<20) + "\"\n\n"
	engine := httptest.NewServer(sseHandler([]string{line}, ""))
	defer engine.Close()
	rt, err := router.New(router.DefaultConfig())
	if err != nil {
		b.Fatal(err)
	}
	rt.AddWorker(router.WorkerInfo{ID: 1, Model: "m", DPSize: 1, TotalKVBlocks: 4096})
	fe, err := New(Config{Router: rt, Workers: func() []Worker { return []Worker{{ID: 1, Name: "e", BaseURL: engine.URL, Model: "m", DPSize: 1}} }})
	if err != nil {
		b.Fatal(err)
	}
	srv := httptest.NewServer(fe.Handler())
	defer srv.Close()
	body := `{"model":"m","prompt":[1,2,3],"stream":true}`
	var peak uint64
	for b.Loop() {
		stop, sampled := make(chan struct{}), make(chan struct{})
		go func() {
			defer close(sampled)
			var ms runtime.MemStats
			for {
				runtime.ReadMemStats(&ms)
				peak = max(peak, ms.HeapInuse)
				select {
				case <-stop:
					return
				case <-time.After(20 * time.Millisecond):
				}
			}
		}()
		var wg sync.WaitGroup
		for range 150 {
			wg.Go(func() {
				resp, err := http.Post(srv.URL+"/v1/completions", "application/json", strings.NewReader(body))
				if err != nil {
					b.Error(err)
					return
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			})
		}
		wg.Wait()
		close(stop)
		<-sampled
	}
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	b.ReportMetric(float64(peak)/(1<<20), "peak-heap-MiB")
	b.ReportMetric(float64(ms.HeapInuse)/(1<<20), "heap-after-GC-MiB")
}
