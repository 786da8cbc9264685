package serve

import (
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
)

// Access secures the HTTP listener: who may call what, and TLS.
type Access struct {
	// APIKey is required on /v1/* (--api-key, as vLLM's).
	APIKey string
	// AdminToken is required to change the router's state and to profile
	// it (--admin-token).
	AdminToken string
	// TLSCertFile and TLSKeyFile, PEM, serve HTTPS (--tls-cert-file,
	// --tls-key-file); both or neither.
	TLSCertFile, TLSKeyFile string
}

func (a Access) tlsConfig() (*tls.Config, error) {
	if a.TLSCertFile == "" && a.TLSKeyFile == "" {
		return nil, nil
	}
	if a.TLSCertFile == "" || a.TLSKeyFile == "" {
		return nil, errors.New("serve: TLS needs both --tls-cert-file and --tls-key-file")
	}
	cert, err := tls.LoadX509KeyPair(a.TLSCertFile, a.TLSKeyFile)
	if err != nil {
		return nil, fmt.Errorf("serve: TLS certificate: %w", err)
	}
	return &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12, NextProtos: []string{"h2", "http/1.1"}}, nil
}

// warnIfOpen says what anyone who reaches a listener beyond loopback can
// do without the credentials.
func (a Access) warnIfOpen(log *slog.Logger, addr net.Addr) {
	tcp, ok := addr.(*net.TCPAddr)
	if !ok || tcp.IP.IsLoopback() {
		return
	}
	if a.APIKey == "" {
		log.Warn("listening beyond loopback without --api-key: anyone who reaches the port can send requests to the engines", "addr", addr.String())
	}
	if a.AdminToken == "" {
		log.Warn("listening beyond loopback without --admin-token: anyone who reaches the port can change busy thresholds and book or free load", "addr", addr.String())
	}
}
