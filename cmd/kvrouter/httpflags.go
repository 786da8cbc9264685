package main

import (
	"fmt"
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
	fs.StringVar(&h.access.APIKey, "api-key", "", "require \"Authorization: Bearer <key>\" on /v1/* (also VLLM_API_KEY, as vLLM)")
	fs.StringVar(&h.access.AdminToken, "admin-token", "", "require \"Authorization: Bearer <token>\" to change the router's state (POST /busy_threshold, booking /router/best_worker, /router/mark_prefill_complete, /router/free), to pin requests to busy engines, and for /debug/pprof/ (served only with this)")
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
