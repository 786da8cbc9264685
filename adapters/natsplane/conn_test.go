package natsplane

import (
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/kvrouter/kvrouter/internal/testwait"
)

// Closing a connection is not losing it: only a server that goes away is
// worth a warning.
func TestConnectWarnsOnlyAboutALostConnection(t *testing.T) {
	srv, err := StartEmbedded(EmbeddedConfig{StoreDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Shutdown()

	var clean testwait.Buffer
	closed := make(chan struct{})
	nc, err := Connect(srv.URL(), "clean", slog.New(slog.NewTextHandler(&clean, nil)),
		nats.ClosedHandler(func(*nats.Conn) { close(closed) }))
	if err != nil {
		t.Fatal(err)
	}
	nc.Close()
	select {
	case <-closed: // callbacks run in order: a disconnect warning would be logged by now
	case <-time.After(5 * time.Second):
		t.Fatal("the connection never reported its close")
	}
	if strings.Contains(clean.String(), "lost") {
		t.Fatalf("a clean close logged a lost connection:\n%s", clean.String())
	}

	var lost testwait.Buffer
	nc, err = Connect(srv.URL(), "lost", slog.New(slog.NewTextHandler(&lost, nil)))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	srv.Shutdown()
	testwait.Until(t, 5*time.Second, "a warning about the lost connection", func() bool {
		return strings.Contains(lost.String(), "level=WARN msg=\"NATS connection lost")
	})
}
