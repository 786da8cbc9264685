// Package zmtptest plays misbehaving ZMTP peers for tests of the ZMQ
// sockets: raw bytes on a TCP connection, below any ZMQ library.
package zmtptest

import (
	"encoding/binary"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
)

// Greeting is a valid ZMTP 3.0 NULL-mechanism greeting.
func Greeting() []byte {
	g := make([]byte, 64)
	g[0], g[9], g[10], g[11] = 0xff, 0x7f, 3, 0
	copy(g[12:], "NULL")
	return g
}

// HugeHeader is a long frame header with the given flags claiming 2^50
// bytes.
func HugeHeader(flags byte) []byte {
	h := make([]byte, 9)
	h[0] = flags | 0x02
	binary.BigEndian.PutUint64(h[1:], 1<<50)
	return h
}

// Hostile is a greeting followed by a command frame header claiming 2^50
// bytes where the handshake's READY command is expected.
func Hostile() []byte { return append(Greeting(), HugeHeader(0x04)...) }

// Send connects to a listening ZMQ socket at endpoint ("tcp://host:port"),
// sends b and reads whatever comes back; the channel is closed when the
// socket closes the connection.
func Send(t testing.TB, endpoint string, b []byte) (closed <-chan struct{}) {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(endpoint, "tcp://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	if _, err := c.Write(b); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { _, _ = io.Copy(io.Discard, c); close(done) }()
	return done
}

// FirstThenProxy listens on a free port of 127.0.0.1: its first
// connection gets first (nothing at all when nil) and is then only read,
// the later ones are piped to target, so a dialing socket meets a
// misbehaving peer first and a well-behaved one on its next attempt. It
// returns its endpoint.
func FirstThenProxy(t testing.TB, first []byte, target string) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		conns []net.Conn
	)
	track := func(c net.Conn) {
		mu.Lock()
		conns = append(conns, c)
		mu.Unlock()
	}
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		for _, c := range conns {
			_ = c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; ; i++ {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			track(c)
			if i == 0 {
				_, _ = c.Write(first)
				wg.Add(1)
				go func() { defer wg.Done(); _, _ = io.Copy(io.Discard, c) }()
				continue
			}
			up, err := net.Dial("tcp", strings.TrimPrefix(target, "tcp://"))
			if err != nil {
				_ = c.Close()
				continue
			}
			track(up)
			wg.Add(2)
			go func() { defer wg.Done(); _, _ = io.Copy(up, c); _ = up.Close() }()
			go func() { defer wg.Done(); _, _ = io.Copy(c, up); _ = c.Close() }()
		}
	}()
	return "tcp://" + ln.Addr().String()
}
