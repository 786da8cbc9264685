package main

import (
	"crypto/rand"
	"fmt"
	"net/netip"
	"time"

	"github.com/spf13/pflag"

	"github.com/kvrouter/kvrouter/internal/serve"
)

// httpFlags secure and stop the router's HTTP listener; serve and up share
// them.
type httpFlags struct {
	access          serve.Access
	shutdownTimeout float64
}

func (h *httpFlags) register(fs *pflag.FlagSet) {
	fs.StringVar(&h.access.APIKey, "api-key", "", "require \"Authorization: Bearer <key>\" on /v1/* (also VLLM_API_KEY, as vLLM) and on every endpoint that takes a prompt or shows the cache (the router API, the dashboard's feed); the probes and /metrics stay open")
	fs.StringVar(&h.access.AdminToken, "admin-token", "", "require \"Authorization: Bearer <token>\" to change the router's state (POST /busy_threshold, booking /router/best_worker, /router/mark_prefill_complete, /router/free), to pin requests to busy engines, and for /debug/pprof/ (served only with this); up makes one up and prints it when --http-host is beyond loopback")
	fs.StringVar(&h.access.TLSCertFile, "tls-cert-file", "", "serve HTTPS with this PEM certificate (with --tls-key-file)")
	fs.StringVar(&h.access.TLSKeyFile, "tls-key-file", "", "PEM private key of --tls-cert-file")
	fs.Float64Var(&h.shutdownTimeout, "shutdown-timeout", serve.DefaultShutdownTimeout.Seconds(), "seconds in-flight requests get to finish after SIGTERM/SIGINT before they are ended")
}

func (h *httpFlags) timeout() (time.Duration, error) {
	if h.shutdownTimeout < 0 {
		return 0, fmt.Errorf("--shutdown-timeout %v: want seconds ≥ 0", h.shutdownTimeout)
	}
	return seconds(h.shutdownTimeout), nil
}

// adminTokenBeyondLoopback makes up an admin token when none is given and
// the frontend listens on host beyond loopback, as Jupyter does: anyone who
// reaches the port could otherwise drain every engine. It reports whether
// it made one. On loopback only this machine's users reach the router, and
// the frontend refuses what other sites' pages send it.
func (h *httpFlags) adminTokenBeyondLoopback(host string) bool {
	if h.access.AdminToken != "" || loopbackHost(host) {
		return false
	}
	h.access.AdminToken = rand.Text()
	return true
}

// loopbackHost reports whether a listen host reaches this machine only;
// "" and 0.0.0.0 listen everywhere.
func loopbackHost(host string) bool {
	if host == "localhost" {
		return true
	}
	ip, err := netip.ParseAddr(host)
	return err == nil && ip.IsLoopback()
}
