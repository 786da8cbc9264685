package serve

import (
	"net"
	"net/http"
	"time"
)

// systemPaths are what the system port serves: Dynamo's system status
// server (DYN_SYSTEM_PORT) answers health and metrics apart from the
// request port, so a scraper or a kubelet probe never queues behind
// inference traffic or its connection limit.
var systemPaths = []string{"/metrics", "/health", "/live", "/ready"}

// startSystem serves systemPaths from the frontend on cfg.SystemAddr, in
// plain HTTP as Dynamo's system server is.
func (s *Server) startSystem(h http.Handler) error {
	ln, err := net.Listen("tcp", s.cfg.SystemAddr)
	if err != nil {
		return err
	}
	mux := http.NewServeMux()
	for _, p := range systemPaths {
		mux.Handle(p, h)
	}
	s.system = &http.Server{Handler: mux, ReadHeaderTimeout: systemHeaderTimeout}
	s.systemLn = ln
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		_ = s.system.Serve(ln)
	}()
	return nil
}

// systemHeaderTimeout bounds a scraper's request headers.
const systemHeaderTimeout = 10 * time.Second

// SystemAddr is the address the system port listens on, "" without one.
func (s *Server) SystemAddr() string {
	if s.systemLn == nil {
		return ""
	}
	return s.systemLn.Addr().String()
}

func (s *Server) stopSystem() {
	if s.system != nil {
		_ = s.system.Close()
	}
}
