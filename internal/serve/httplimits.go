package serve

import (
	"fmt"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvrouter/kvrouter/adapters/frontend"
)

// HTTPLimits bound what clients can hold of the frontend: memory (body
// size), connections and their time. Zero fields take the defaults below;
// a negative one switches that bound off.
type HTTPLimits struct {
	MaxBodyBytes int64 // a request body; 413 beyond
	// MaxInflightBodyBytes bounds the bodies held at once (by their
	// Content-Length); beyond, 503 with Retry-After.
	MaxInflightBodyBytes int64
	// ReadTimeout bounds reading a whole request, body included: a client
	// dripping its body is cut off.
	ReadTimeout time.Duration
	// IdleTimeout closes keep-alive connections idle that long.
	IdleTimeout time.Duration
	// WriteTimeout bounds writing a non-streamed response to the client,
	// from its first byte; streams last as long as the generation.
	WriteTimeout time.Duration
	// MaxConcurrentRequests are served at once (besides /health and
	// /metrics); the others are answered 503 with Retry-After.
	MaxConcurrentRequests int
	// MaxConnections are open at once; one more is answered 503 with
	// Retry-After and closed.
	MaxConnections int
}

// Defaults of HTTPLimits: generous for real clients (a 16 MiB body in 60 s
// is 280 kB/s), tight enough that a slow or idle client lets go. The idle
// timeout outlasts clients' own (Go's default transport drops idle
// connections after 90 s): a client that reuses a connection the router is
// closing at that very moment sees its request fail with a broken pipe,
// which clients do not retry for a POST.
const (
	DefaultReadTimeout           = 60 * time.Second
	DefaultIdleTimeout           = 120 * time.Second
	DefaultWriteTimeout          = 60 * time.Second
	DefaultMaxConcurrentRequests = 1024
	DefaultMaxConnections        = 4096
	DefaultMaxInflightBodyBytes  = 128 << 20
)

func (l HTTPLimits) withDefaults() HTTPLimits {
	pick := func(v *time.Duration, def time.Duration) {
		switch {
		case *v == 0:
			*v = def
		case *v < 0:
			*v = 0
		}
	}
	pick(&l.ReadTimeout, DefaultReadTimeout)
	pick(&l.IdleTimeout, DefaultIdleTimeout)
	pick(&l.WriteTimeout, DefaultWriteTimeout)
	pickInt := func(v *int, def int) {
		switch {
		case *v == 0:
			*v = def
		case *v < 0:
			*v = 0
		}
	}
	pickInt(&l.MaxConcurrentRequests, DefaultMaxConcurrentRequests)
	pickInt(&l.MaxConnections, DefaultMaxConnections)
	switch {
	case l.MaxInflightBodyBytes == 0:
		l.MaxInflightBodyBytes = DefaultMaxInflightBodyBytes
	case l.MaxInflightBodyBytes < 0:
		l.MaxInflightBodyBytes = 0
	}
	if l.MaxBodyBytes <= 0 {
		l.MaxBodyBytes = frontend.DefaultMaxBodyBytes
	}
	return l
}

// limitListener admits at most max connections at once. One more is not
// left waiting in the accept backlog, where its client cannot tell an
// overloaded router from a dead one: it is answered 503 with Retry-After
// and closed.
type limitListener struct {
	net.Listener
	max  int64
	open atomic.Int64
}

func (l *limitListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if l.open.Add(1) <= l.max {
			return &countedConn{Conn: c, l: l}, nil
		}
		l.open.Add(-1)
		go refuse(c, l.max)
	}
}

type countedConn struct {
	net.Conn
	l    *limitListener
	once sync.Once
}

func (c *countedConn) Close() error {
	c.once.Do(func() { c.l.open.Add(-1) })
	return c.Conn.Close()
}

// refuse answers a connection over the limit. It reads what the client has
// sent first (briefly): closing a socket with unread data resets it, and
// the client would see the reset instead of the answer.
func refuse(c net.Conn, limit int64) {
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(time.Second))
	buf := make([]byte, 4096)
	_, _ = c.Read(buf)
	body := fmt.Sprintf(`{"error":{"message":"the router has its maximum of %d connections open; retry later","type":"server_error","param":null,"code":"overloaded"}}`, limit)
	_, _ = fmt.Fprintf(c, "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
}

// httpServer is the frontend's server with the limits applied.
func httpServer(h http.Handler, l HTTPLimits) *http.Server {
	header := 10 * time.Second
	if l.ReadTimeout > 0 {
		header = min(header, l.ReadTimeout)
	}
	return &http.Server{
		Handler:           h,
		ReadHeaderTimeout: header,
		ReadTimeout:       l.ReadTimeout,
		IdleTimeout:       l.IdleTimeout,
		// WriteTimeout is applied per response by the frontend, which
		// knows a stream from a whole answer.
	}
}

func limitConnections(ln net.Listener, max int) net.Listener {
	if max <= 0 {
		return ln
	}
	return &limitListener{Listener: ln, max: int64(max)}
}
