package frontend

import (
	"crypto/sha256"
	"crypto/subtle"
	"mime"
	"net"
	"net/http"
	"net/http/pprof"
	"net/netip"
	"strings"
)

// secret is a token compared in constant time: both sides are hashed first
// so that not even the token's length leaks through timing.
type secret struct {
	set  bool
	hash [sha256.Size]byte
}

func newSecret(token string) secret {
	if token == "" {
		return secret{}
	}
	return secret{set: true, hash: sha256.Sum256([]byte(token))}
}

func (s secret) matches(presented string) bool {
	if !s.set {
		return false
	}
	h := sha256.Sum256([]byte(presented))
	return subtle.ConstantTimeCompare(s.hash[:], h[:]) == 1
}

func bearer(r *http.Request) string {
	scheme, token, ok := strings.Cut(r.Header.Get("Authorization"), " ")
	if !ok || !strings.EqualFold(scheme, "Bearer") {
		return ""
	}
	return strings.TrimSpace(token)
}

// isAdmin reports whether the caller holds the admin token. Without one
// configured no one does: pins then respect busy thresholds for everyone.
func (f *Frontend) isAdmin(r *http.Request) bool { return f.admin.matches(bearer(r)) }

func unauthorized(w http.ResponseWriter, code, format string, args ...any) {
	w.Header().Set("WWW-Authenticate", `Bearer realm="kvrouter"`)
	writeError(w, http.StatusUnauthorized, "invalid_request_error", code, "", format, args...)
}

// allowAdmin answers 401 and returns false when an admin token is
// configured and the caller does not present it.
func (f *Frontend) allowAdmin(w http.ResponseWriter, r *http.Request) bool {
	if !f.admin.set || f.isAdmin(r) {
		return true
	}
	unauthorized(w, "invalid_admin_token", "this endpoint changes the router's state: send the admin token as \"Authorization: Bearer <token>\"")
	return false
}

// guard checks what every request must pass before its handler:
//
//   - a request that changes state (any method but GET, HEAD and OPTIONS)
//     made by a browser for a page of another origin is refused (403): a
//     page the operator opens must not drain engines or change thresholds.
//     Without an admin token such a request must also name the router by
//     address or as localhost (DNS rebinding would make another site's
//     page same-origin); outside /v1/* its body must also be
//     application/json (jsonOnly);
//   - with an API key, every endpoint but the probes, /metrics and the
//     dashboard's page needs it (or the admin token), as vLLM's --api-key
//     does for /v1/*: the router API and the dashboard's feed tell how
//     much of any prompt each engine holds, which reveals other clients'
//     prompts, and tokenizing a prompt costs CPU. CORS preflights carry no
//     credentials.
func (f *Frontend) guard(next http.Handler) http.Handler {
	cross := http.NewCrossOriginProtection()
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !safeMethod(r.Method) {
			if err := cross.Check(r); err != nil {
				writeError(w, http.StatusForbidden, "invalid_request_error", "cross_origin_request", "",
					"cross-origin requests may not change the router's state (%v)", err)
				return
			}
			if !f.admin.set && fromBrowser(r) && !addressedByIP(r.Host) {
				writeError(w, http.StatusForbidden, "invalid_request_error", "cross_origin_request", "",
					"without an admin token, a browser may change the router's state only when it names the router by address or as localhost, not %q", r.Host)
				return
			}
		}
		if f.apiKey.set && r.Method != http.MethodOptions && !keyFree(r.URL.Path) {
			if tok := bearer(r); !f.apiKey.matches(tok) && !f.admin.matches(tok) {
				unauthorized(w, "invalid_api_key", "Incorrect API key provided: send it as \"Authorization: Bearer <key>\"")
				return
			}
		}
		next.ServeHTTP(w, r)
	})
}

func safeMethod(m string) bool {
	return m == http.MethodGet || m == http.MethodHead || m == http.MethodOptions
}

// keyFree are the paths served without the API key: the probes, /metrics
// (as vLLM's) and the dashboard's page, which holds nothing but itself.
func keyFree(path string) bool {
	switch path {
	case "/live", "/ready", "/health", "/metrics", "/ui":
		return true
	}
	return false
}

// fromBrowser reports whether r carries what browsers add to every
// request that changes state.
func fromBrowser(r *http.Request) bool {
	return r.Header.Get("Origin") != "" || r.Header.Get("Sec-Fetch-Site") != ""
}

// addressedByIP reports whether host (a Host header) is an IP address or
// localhost: names a DNS server can re-point at the router are neither.
func addressedByIP(host string) bool {
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	host = strings.TrimSuffix(strings.TrimPrefix(host, "["), "]")
	if _, err := netip.ParseAddr(host); err == nil {
		return true
	}
	return strings.EqualFold(host, "localhost")
}

// jsonOnly serves h only a body sent as application/json (415 else): no
// HTML form and no cross-origin request a browser sends without asking
// first can carry it.
func jsonOnly(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type")); err != nil || mt != "application/json" {
			writeError(w, http.StatusUnsupportedMediaType, "invalid_request_error", "unsupported_media_type", "",
				"%s %s takes a JSON body: send it with \"Content-Type: application/json\"", r.Method, r.URL.Path)
			return
		}
		h(w, r)
	}
}

// fromLoopback reports whether r came from this machine.
func fromLoopback(r *http.Request) bool {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return false
	}
	ip, err := netip.ParseAddr(host)
	return err == nil && ip.IsLoopback()
}

// seesEngineURLs reports whether r may learn the engines' addresses: the
// admin token's holder, or, on a router without one, a caller on this
// machine.
func (f *Frontend) seesEngineURLs(r *http.Request) bool {
	if f.admin.set {
		return f.isAdmin(r)
	}
	return fromLoopback(r)
}

// adminOnly serves h only to the admin token's holder.
func (f *Frontend) adminOnly(h http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if f.allowAdmin(w, r) {
			h(w, r)
		}
	}
}

// handlePprof serves Go's profiler, which reveals the process's memory and
// can stall it for a profile's duration: only with an admin token, and only
// to its holder; without one the paths do not exist.
func (f *Frontend) handlePprof(mux *http.ServeMux) {
	if !f.admin.set {
		return
	}
	mux.HandleFunc("/debug/pprof/", f.adminOnly(pprof.Index))
	mux.HandleFunc("/debug/pprof/cmdline", f.adminOnly(pprof.Cmdline))
	mux.HandleFunc("/debug/pprof/profile", f.adminOnly(pprof.Profile))
	mux.HandleFunc("/debug/pprof/symbol", f.adminOnly(pprof.Symbol))
	mux.HandleFunc("/debug/pprof/trace", f.adminOnly(pprof.Trace))
}
