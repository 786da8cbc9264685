package serve

import (
	"bufio"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/testwait"
)

// streamOutcome is what a client of one stream saw: its data payloads.
type streamOutcome struct {
	long bool
	data []string
	err  error
}

// Streams that end within the shutdown timeout end normally; those still
// running then get an error event and [DONE]. Meanwhile /ready is 503,
// /live 200, and no new connection is accepted.
func TestShutdownDrainsStreams(t *testing.T) {
	s := startServer(t, spec(1, engineFleetAt(t, 1)))
	const streams = 40
	started := make(chan struct{}, streams)
	outcomes := make([]streamOutcome, streams)
	var wg sync.WaitGroup
	for i := range streams {
		long := i%2 == 1
		maxTokens := 10
		if long {
			maxTokens = 100000 // far beyond the timeout at the modelled speed
		}
		wg.Go(func() {
			o := &outcomes[i]
			o.long = long
			body := `{"model":"kvrouter-mock","stream":true,"ignore_eos":true,"max_tokens":` + mustJSON(maxTokens) + `,"prompt":` + mustJSON(prompt(0, 500+i, 64)) + `}`
			resp, err := http.Post(s.URL()+"/v1/completions", "application/json", strings.NewReader(body))
			if err != nil {
				o.err = err
				started <- struct{}{}
				return
			}
			defer resp.Body.Close()
			sc := bufio.NewScanner(resp.Body)
			first := true
			for sc.Scan() {
				if v, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
					o.data = append(o.data, v)
					if first {
						first = false
						started <- struct{}{}
					}
				}
			}
			if first {
				started <- struct{}{}
			}
			o.err = sc.Err()
		})
	}
	for range streams {
		select {
		case <-started:
		case <-time.After(30 * time.Second):
			t.Fatal("streams did not start")
		}
	}

	const timeout = 3 * time.Second
	done := make(chan error, 1)
	begun := time.Now()
	go func() { done <- s.Shutdown(timeout) }()
	testwait.Until(t, 5*time.Second, "new connections refused", func() bool {
		c, err := net.Dial("tcp", s.Addr())
		if err == nil {
			c.Close()
		}
		return err != nil
	})
	probe := func(path string) int {
		rec := httptest.NewRecorder()
		s.http.Handler.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
		return rec.Code
	}
	if got := probe("/ready"); got != http.StatusServiceUnavailable {
		t.Errorf("/ready while draining: %d", got)
	}
	if got := probe("/live"); got != http.StatusOK {
		t.Errorf("/live while draining: %d", got)
	}
	if err := <-done; err != nil {
		t.Fatalf("Shutdown: %v", err)
	}
	if took := time.Since(begun); took < timeout || took > timeout+abortGrace {
		t.Errorf("Shutdown took %v with a %v timeout", took, timeout)
	}
	wg.Wait()
	for i, o := range outcomes {
		n := len(o.data)
		if o.err != nil || n < 2 || o.data[n-1] != "[DONE]" {
			t.Fatalf("stream %d (long %v): %v, ends %q", i, o.long, o.err, o.data[max(0, n-2):])
		}
		cut := strings.Contains(o.data[n-2], `"code":"shutting_down"`)
		if cut != o.long {
			t.Errorf("stream %d (long %v): cut %v, ends %q", i, o.long, cut, o.data[n-2:])
		}
		for _, d := range o.data[:n-2] {
			if strings.Contains(d, `"error"`) {
				t.Errorf("stream %d: error before its end: %s", i, d)
			}
		}
	}
	for _, l := range s.Router().Loads() {
		if l.ActiveRequests != 0 {
			t.Errorf("load left after the drain: %+v", l)
		}
	}
}
