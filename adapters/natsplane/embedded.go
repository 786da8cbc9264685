package natsplane

import (
	"crypto/rand"
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
	// Token, or User and Password, are required of every client. With
	// neither, a server listening beyond loopback requires a token of its
	// own (see Embedded.TokenGenerated): whoever can connect can register
	// an engine and receive the prompts routed to it.
	Token          string
	User, Password string
}

// MaxPayload is raised from NATS' 1 MiB default so that a recovery chunk
// of a few thousand blocks always fits in one message.
const MaxPayload = 8 << 20

// Embedded is a NATS server with JetStream running inside kvrouter.
type Embedded struct {
	srv       *server.Server
	auth      Auth
	generated bool
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
	e := &Embedded{}
	opts := &server.Options{
		ServerName: "kvrouter-embedded",
		Host:       host,
		Port:       port,
		JetStream:  true,
		StoreDir:   cfg.StoreDir,
		MaxPayload: MaxPayload,
		NoSigs:     true,
		NoLog:      true,
	}
	switch {
	case cfg.Token != "" && cfg.User != "":
		return nil, errors.New("natsplane: embedded server: give a token or a user and password, not both")
	case cfg.User != "" && cfg.Password == "":
		return nil, errors.New("natsplane: embedded server: the user needs a password")
	case cfg.User != "":
		opts.Username, opts.Password = cfg.User, cfg.Password
		e.auth = Auth{User: cfg.User, Password: cfg.Password}
	case cfg.Token != "":
		opts.Authorization = cfg.Token
		e.auth = Auth{Token: cfg.Token}
	case !isLoopback(host):
		opts.Authorization, e.generated = rand.Text(), true
		e.auth = Auth{Token: opts.Authorization}
	}
	srv, err := server.NewServer(opts)
	if err != nil {
		return nil, fmt.Errorf("natsplane: embedded server: %w", err)
	}
	go srv.Start()
	if !srv.ReadyForConnections(10 * time.Second) {
		srv.Shutdown()
		return nil, errors.New("natsplane: embedded server did not start within 10 s")
	}
	e.srv = srv
	return e, nil
}

func isLoopback(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// ClientAuth is what a client of this server presents: the configured or
// generated token, or user and password; zero for an open server.
func (e *Embedded) ClientAuth() Auth { return e.auth }

// TokenGenerated tells whether the server made up the token it requires,
// which then has to reach the clients that run elsewhere.
func (e *Embedded) TokenGenerated() bool { return e.generated }

// URL is the address clients connect to.
func (e *Embedded) URL() string { return e.srv.ClientURL() }

// Port is the port the server listens on, to restart it on the same one.
func (e *Embedded) Port() int { return e.srv.Addr().(*net.TCPAddr).Port }

// Shutdown stops the server and waits for it to finish.
func (e *Embedded) Shutdown() {
	e.srv.Shutdown()
	e.srv.WaitForShutdown()
}
