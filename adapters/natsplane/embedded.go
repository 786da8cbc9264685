package natsplane

import (
	"errors"
	"fmt"
	"net"
	"strconv"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// EmbeddedConfig configures an in-process NATS server.
type EmbeddedConfig struct {
	// Host to listen on; "" means 127.0.0.1.
	Host string
	// Port to listen on; 0 picks a free one.
	Port int
	// StoreDir keeps JetStream's streams and buckets; a server restarted on
	// the same directory finds them again. Required.
	StoreDir string
}

// MaxPayload is raised from NATS' 1 MiB default so that a recovery chunk
// of a few thousand blocks always fits in one message.
const MaxPayload = 8 << 20

// Embedded is a NATS server with JetStream running inside kvrouter.
type Embedded struct {
	srv *server.Server
}

// StartEmbedded starts the server and waits until it accepts clients.
func StartEmbedded(cfg EmbeddedConfig) (*Embedded, error) {
	if cfg.StoreDir == "" {
		return nil, errors.New("natsplane: embedded server needs a store directory")
	}
	host := cfg.Host
	if host == "" {
		host = "127.0.0.1"
	}
	port := cfg.Port
	if port == 0 {
		port = server.RANDOM_PORT
	} else {
		// The server only logs a failed bind, which would surface as a
		// timeout; a port in use deserves its own message.
		ln, err := net.Listen("tcp", net.JoinHostPort(host, strconv.Itoa(port)))
		if err != nil {
			return nil, fmt.Errorf("natsplane: embedded server cannot listen on %s:%d (another kvrouter or NATS? use --nats-url to join it, or --nats-port): %w", host, port, err)
		}
		ln.Close()
	}
	srv, err := server.NewServer(&server.Options{
		ServerName: "kvrouter-embedded",
		Host:       host,
		Port:       port,
		JetStream:  true,
		StoreDir:   cfg.StoreDir,
		MaxPayload: MaxPayload,
		NoSigs:     true,
		NoLog:      true,
	})
	if err != nil {
		return nil, fmt.Errorf("natsplane: embedded server: %w", err)
	}
	go srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		srv.Shutdown()
		return nil, errors.New("natsplane: embedded server did not start within 10 s")
	}
	return &Embedded{srv: srv}, nil
}

// URL is the address clients connect to.
func (e *Embedded) URL() string { return e.srv.ClientURL() }

// Port is the port the server listens on, to restart it on the same one.
func (e *Embedded) Port() int { return e.srv.Addr().(*net.TCPAddr).Port }

// Shutdown stops the server and waits for it to finish.
func (e *Embedded) Shutdown() {
	e.srv.Shutdown()
	e.srv.WaitForShutdown()
}
