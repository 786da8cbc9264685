package natsplane

import (
	"log/slog"
	"time"

	"github.com/nats-io/nats.go"
)

// Connect dials url with the reconnect behaviour every kvrouter process
// wants: retry forever (an outage degrades routing to the last known state,
// it does not end the process), and say so in the log.
func Connect(url, name string, log *slog.Logger) (*nats.Conn, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return nats.Connect(url,
		nats.Name(name),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(100*time.Millisecond),
		nats.RetryOnFailedConnect(false),
		nats.ReconnectBufSize(64<<20),
		nats.DisconnectErrHandler(func(c *nats.Conn, err error) {
			if c.IsClosed() {
				return // our own Close: nothing was lost
			}
			log.Warn("NATS connection lost; routing on the last known state until it is back", "err", err)
		}),
		nats.ClosedHandler(func(*nats.Conn) { log.Debug("NATS connection closed") }),
		nats.ReconnectHandler(func(c *nats.Conn) {
			log.Info("NATS connection restored", "url", c.ConnectedUrl())
		}),
	)
}
