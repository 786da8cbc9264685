package chaos

import (
	"io"
	"net"
	"sync"
	"time"
)

// proxy forwards TCP connections to target and can cut them all at once,
// which is how a network partition or a restarted load balancer looks to
// the two ends: their connections die and, for a while, new ones do too.
type proxy struct {
	ln     net.Listener
	target string

	mu          sync.Mutex
	conns       map[net.Conn]struct{}
	refuseUntil time.Time
	connectedAt time.Time // when the latest pair was established
	wg          sync.WaitGroup
	closed      bool
}

func newProxy(target string) (*proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &proxy{ln: ln, target: target, conns: map[net.Conn]struct{}{}}
	p.wg.Add(1)
	go p.serve()
	return p, nil
}

func (p *proxy) addr() string { return p.ln.Addr().String() }

func (p *proxy) serve() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		refuse := p.closed || time.Now().Before(p.refuseUntil)
		p.mu.Unlock()
		if refuse {
			c.Close()
			continue
		}
		up, err := net.DialTimeout("tcp", p.target, time.Second)
		if err != nil {
			c.Close() // the engine is down: its clients see a dropped connection
			continue
		}
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			c.Close()
			up.Close()
			continue
		}
		p.conns[c], p.conns[up] = struct{}{}, struct{}{}
		p.connectedAt = time.Now()
		p.mu.Unlock()
		p.wg.Add(2)
		go p.pipe(c, up)
		go p.pipe(up, c)
	}
}

func (p *proxy) pipe(dst, src net.Conn) {
	defer p.wg.Done()
	_, _ = io.Copy(dst, src)
	p.mu.Lock()
	delete(p.conns, dst)
	delete(p.conns, src)
	p.mu.Unlock()
	dst.Close()
	src.Close()
}

// cut closes every connection and refuses new ones for refuse.
func (p *proxy) cut(refuse time.Duration) {
	p.mu.Lock()
	p.refuseUntil = time.Now().Add(refuse)
	for c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
}

// connectedSince reports whether a connection established after t is
// still open.
func (p *proxy) connectedSince(t time.Time) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.conns) > 0 && p.connectedAt.After(t)
}

func (p *proxy) close() {
	p.mu.Lock()
	p.closed = true
	for c := range p.conns {
		c.Close()
	}
	p.mu.Unlock()
	p.ln.Close()
	p.wg.Wait()
}
