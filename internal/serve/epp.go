package serve

import (
	"context"
	"crypto/tls"
	"net"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/kvrouter/kvrouter/adapters/epp"
)

// eppState is the endpoint picker's gRPC servers: ext_proc (with health)
// and, optionally, health alone on a port of its own.
type eppState struct {
	picker     *epp.Server
	servers    []*grpc.Server
	addr       string
	healthAddr string
}

// startEPP serves the endpoint picker on cfg.EPPAddr (and its health on
// cfg.EPPHealthAddr) beside the HTTP frontend, routing with the same
// frontend, over the same TLS when the frontend has one.
func (s *Server) startEPP(ctx context.Context, reg prometheus.Registerer, tlsConfig *tls.Config) error {
	p := epp.New(epp.Config{Picker: s.fe, Workers: s.liveWorkers, Logger: s.log, Registerer: reg})
	var opts []grpc.ServerOption
	if tlsConfig != nil {
		opts = append(opts, grpc.Creds(credentials.NewTLS(tlsConfig)))
	}
	st := &eppState{picker: p}
	listen := func(addr string, register func(*grpc.Server)) (net.Listener, error) {
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			for _, g := range st.servers {
				g.Stop()
			}
			return nil, err
		}
		g := grpc.NewServer(opts...)
		register(g)
		st.servers = append(st.servers, g)
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			_ = g.Serve(ln)
		}()
		return ln, nil
	}
	ln, err := listen(s.cfg.EPPAddr, p.Register)
	if err != nil {
		return err
	}
	st.addr = ln.Addr().String()
	if s.cfg.EPPHealthAddr != "" {
		hln, err := listen(s.cfg.EPPHealthAddr, p.RegisterHealth)
		if err != nil {
			return err
		}
		st.healthAddr = hln.Addr().String()
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		p.WatchReadiness(ctx)
	}()
	s.epp = st
	return nil
}

// EPPAddr is the address the endpoint picker listens on, "" without one.
func (s *Server) EPPAddr() string {
	if s.epp == nil {
		return ""
	}
	return s.epp.addr
}

// EPPHealthAddr is the address of the picker's separate health port, ""
// without one.
func (s *Server) EPPHealthAddr() string {
	if s.epp == nil {
		return ""
	}
	return s.epp.healthAddr
}

// drainEPP turns the picker's readiness off and lets its streams (each a
// request whose response is still coming) end within timeout, then cuts
// them.
func (s *Server) drainEPP(timeout time.Duration) {
	if s.epp == nil {
		return
	}
	s.epp.picker.Drain()
	done := make(chan struct{})
	go func() {
		for _, g := range s.epp.servers {
			g.GracefulStop()
		}
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(timeout):
		s.stopEPP()
		<-done
	}
}

func (s *Server) stopEPP() {
	if s.epp == nil {
		return
	}
	for _, g := range s.epp.servers {
		g.Stop()
	}
}
