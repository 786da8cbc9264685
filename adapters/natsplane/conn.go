package natsplane

import (
	"log/slog"
	"net/url"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
)

// Connect dials url with the reconnect behaviour every kvrouter process
// wants: retry forever (an outage degrades routing to the last known state,
// it does not end the process), and say so in the log. opts add to these,
// e.g. credentials.
func Connect(url, name string, log *slog.Logger, opts ...nats.Option) (*nats.Conn, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return nats.Connect(url, append([]nats.Option{
		nats.Name(name),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(100 * time.Millisecond),
		nats.RetryOnFailedConnect(false),
		nats.ReconnectBufSize(64 << 20),
		nats.DisconnectErrHandler(func(c *nats.Conn, err error) {
			if c.IsClosed() {
				return // our own Close: a stop, not an outage
			}
			log.Warn("NATS connection lost; routing on the last known state until it is back", "err", err)
		}),
		nats.ErrorHandler(func(_ *nats.Conn, sub *nats.Subscription, err error) {
			// Permission violations and slow consumers land here: the
			// operator needs them in kvrouter's log, not on bare stderr.
			if sub != nil {
				log.Warn("NATS error", "subject", sub.Subject, "err", err)
				return
			}
			log.Warn("NATS error", "err", err)
		}),
		nats.ReconnectHandler(func(c *nats.Conn) {
			log.Info("NATS connection restored", "url", RedactURL(c.ConnectedUrl()))
		}),
	}, opts...)...)
}

// RedactURL drops the user, password or token a NATS URL (or a list of
// them) may carry, for logs and output.
func RedactURL(urls string) string {
	parts := strings.Split(urls, ",")
	for i, s := range parts {
		if u, err := url.Parse(strings.TrimSpace(s)); err == nil && u.User != nil {
			u.User = nil
			parts[i] = u.String()
		}
	}
	return strings.Join(parts, ",")
}
