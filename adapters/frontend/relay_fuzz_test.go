package frontend

import (
	"bytes"
	"encoding/json"
	"errors"
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
// ending with one [DONE], and no load is left behind.
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
		_, _ = io.Copy(io.Discard, r.Body)
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
		srv := httptest.NewServer(engine)
		f.Cleanup(srv.Close)
		workers = append(workers, Worker{ID: id, Name: "fuzz", BaseURL: srv.URL, Model: "m"})
		rt.AddWorker(router.WorkerInfo{ID: id, Model: "m", TotalKVBlocks: 4096})
	}
	fe, err := New(Config{Router: rt, Workers: func() []Worker { return workers }, MigrationLimit: 1})
	if err != nil {
		f.Fatal(err)
	}
	front := httptest.NewServer(fe.Handler())
	f.Cleanup(front.Close)

	f.Fuzz(func(t *testing.T, in []byte) {
		stream.Store(&in)
		for _, path := range []string{"/v1/completions", "/v1/chat/completions"} {
			body := `{"model":"m","prompt":"p","messages":[{"role":"user","content":"u"}],"max_tokens":4,"stream":true}`
			resp, err := http.Post(front.URL+path, "application/json", strings.NewReader(body))
			if err != nil {
				t.Fatal(err)
			}
			out, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil || resp.StatusCode != 200 {
				t.Fatalf("%d %v %q", resp.StatusCode, err, out)
			}
			checkWellFormed(t, out)
		}
		for _, l := range rt.Loads() {
			if l.ActiveRequests != 0 {
				t.Fatalf("load left: %+v", l)
			}
		}
	})
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
		last = ev.data
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
