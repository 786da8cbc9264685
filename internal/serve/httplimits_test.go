package serve

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/router"
)

// limitedServer is a frontend with short timeouts over an engine that never
// answers (routing is not what these tests are about).
func limitedServer(t *testing.T, l HTTPLimits) *Server {
	t.Helper()
	s, err := Start(context.Background(), Config{Router: router.DefaultConfig(), Addr: "127.0.0.1:0", HTTP: l,
		Workers: []WorkerSpec{{ID: 1, URL: "http://127.0.0.1:1"}}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// closedWithin reads c until the server closes it, failing if that takes
// longer than within; it returns what the server sent.
func closedWithin(t *testing.T, c net.Conn, within time.Duration) string {
	t.Helper()
	_ = c.SetReadDeadline(time.Now().Add(within))
	got, err := io.ReadAll(c)
	if errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("connection still open after %v (read %q)", within, got)
	}
	return string(got)
}

func TestDrippedBodyIsCutOff(t *testing.T) {
	s := limitedServer(t, HTTPLimits{ReadTimeout: 200 * time.Millisecond})
	c, err := net.Dial("tcp", s.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := io.WriteString(c, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{\"model\":"); err != nil {
		t.Fatal(err)
	}
	// The client drips a byte now and then, each well within any per-read
	// timeout; only a bound on the whole request ends it.
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
				if _, err := c.Write([]byte(" ")); err != nil {
					return
				}
			}
		}
	}()
	closedWithin(t, c, 10*time.Second)
}

func TestIdleKeepAliveIsClosed(t *testing.T) {
	s := limitedServer(t, HTTPLimits{IdleTimeout: 200 * time.Millisecond})
	c, err := net.Dial("tcp", s.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := io.WriteString(c, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if resp.Close {
		t.Fatal("the server did not keep the connection alive")
	}
	closedWithin(t, c, 10*time.Second)
}

func TestConnectionsOverTheLimitAre503(t *testing.T) {
	s := limitedServer(t, HTTPLimits{MaxConnections: 2})
	for range 2 {
		c, err := net.Dial("tcp", s.Addr())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
	}
	c, err := net.Dial("tcp", s.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := io.WriteString(c, "GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
		t.Fatal(err)
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var body struct {
		Error struct {
			Message string `json:"message"`
			Code    string `json:"code"`
		} `json:"error"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&body); err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" || body.Error.Code != "overloaded" || !strings.Contains(body.Error.Message, "2 connections") {
		t.Fatalf("third connection: %d, Retry-After %q, %+v", resp.StatusCode, resp.Header.Get("Retry-After"), body)
	}
}

// A connection the router closes for idleness just as a client reuses it
// fails that client's POST with a broken pipe, which it does not retry: the
// router must keep idle connections longer than clients do by default.
func TestIdleTimeoutOutlastsClientsIdleConnections(t *testing.T) {
	client := http.DefaultTransport.(*http.Transport).IdleConnTimeout
	if got := (HTTPLimits{}).withDefaults().IdleTimeout; got <= client {
		t.Fatalf("idle timeout %v, not above Go clients' %v", got, client)
	}
}
