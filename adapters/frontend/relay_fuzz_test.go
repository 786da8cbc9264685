package frontend

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/kvrouter/kvrouter/core/router"
)

// FuzzRelay feeds arbitrary bytes as two engines' event streams through
// the frontend, with one migration allowed: whatever the engines send, the
// client's stream is well-formed server-sent events whose data are JSON,
// ending with one [DONE], or, when both engines broke before their first
// event, the frontend's 502; and no load is left behind.
func FuzzRelay(f *testing.F) {
	f.Add([]byte("data: {\"id\":\"a\",\"choices\":[{\"index\":0,\"text\":\" x\"}]}\n\ndata: [DONE]\n\n"))
	f.Add([]byte("data: {\"id\":\"a\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"x\"}}]}\n\n"))
	f.Add([]byte("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":2}}\n\ndata: [DONE]\n\n"))
	f.Add([]byte(": comment\nevent: x\ndata: {\"a\":\ndata: 1}\n\n"))
	f.Add([]byte("data: {\"error\":{\"message\":\"m\"}}\n\ndata: [DONE]\n\n"))
	f.Add([]byte("data: {not json\n\n"))
	f.Add([]byte("garbage"))
	f.Add([]byte("data: [1,2]\r\n\r\ndata: \"s\"\n\n"))

	var stream atomic.Pointer[[]byte]
	engine := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// Hiding the body's WriteTo lets io.Discard read it with its pooled
		// buffer instead of a fresh 32 KiB one per request.
		_, _ = io.Copy(io.Discard, struct{ io.Reader }{r.Body})
		if r.URL.Path == "/tokenize" {
			_, _ = io.WriteString(w, `{"tokens":[1,2,3]}`)
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = w.Write(*stream.Load())
	})
	rt, err := router.New(router.DefaultConfig())
	if err != nil {
		f.Fatal(err)
	}
	var workers []Worker
	for id := range uint64(2) {
		workers = append(workers, Worker{ID: id, Name: "fuzz", BaseURL: fmt.Sprintf("http://engine%d", id), Model: "m"})
		rt.AddWorker(router.WorkerInfo{ID: id, Model: "m", TotalKVBlocks: 4096})
	}
	// Engines and client are reached in memory: sockets and their
	// goroutines would cost an execution far more than the relay does.
	client := &http.Client{Transport: handlerTransport{engine}}
	fe, err := New(Config{Router: rt, Workers: func() []Worker { return workers }, MigrationLimit: 1, Client: client})
	if err != nil {
		f.Fatal(err)
	}
	front := fe.Handler()

	f.Fuzz(func(t *testing.T, in []byte) {
		stream.Store(&in)
		for _, path := range []string{"/v1/completions", "/v1/chat/completions"} {
			body := `{"model":"m","prompt":"p","messages":[{"role":"user","content":"u"}],"max_tokens":4,"stream":true}`
			req := httptest.NewRequest(http.MethodPost, path, strings.NewReader(body))
			req.Header.Set("Content-Type", "application/json")
			rec := httptest.NewRecorder()
			front.ServeHTTP(rec, req)
			if rec.Code == http.StatusBadGateway && bytes.Contains(rec.Body.Bytes(), []byte(`"engine_unreachable"`)) {
				continue
			}
			if rec.Code != 200 {
				t.Fatalf("%d %q", rec.Code, rec.Body.Bytes())
			}
			checkWellFormed(t, rec.Body.Bytes())
		}
		for _, l := range rt.Loads() {
			if l.ActiveRequests != 0 {
				t.Fatalf("load left: %+v", l)
			}
		}
	})
}

// handlerTransport answers a client's requests with a handler, in memory.
type handlerTransport struct{ h http.Handler }

func (t handlerTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	rec := httptest.NewRecorder()
	t.h.ServeHTTP(rec, req)
	if req.Body != nil {
		_ = req.Body.Close()
	}
	resp := rec.Result()
	resp.Request = req
	return resp, nil
}

// checkWellFormed fails unless out is a complete event stream whose data
// are JSON, ending with one [DONE].
func checkWellFormed(t *testing.T, out []byte) {
	t.Helper()
	s := newSSEReader(bytes.NewReader(out))
	done := 0
	var last []byte
	for {
		ev, err := s.next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("client stream %q: %v", out, err)
		}
		if !ev.hasData {
			continue
		}
		last = bytes.Clone(ev.data)
		switch {
		case bytes.Equal(ev.data, doneData):
			done++
		case !json.Valid(ev.data):
			t.Fatalf("data %q is not JSON in %q", ev.data, out)
		}
	}
	if done != 1 || !bytes.Equal(last, doneData) {
		t.Fatalf("client stream does not end with one [DONE]: %q", out)
	}
}
