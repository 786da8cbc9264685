package frontend

import (
	"crypto/sha256"
	"crypto/subtle"
	"net/http"
	"net/http/pprof"
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

// guardOpenAI requires the API key on /v1/*, as vLLM's --api-key does (the
// admin token is accepted too). CORS preflights carry no credentials.
func (f *Frontend) guardOpenAI(next http.Handler) http.Handler {
	if !f.apiKey.set {
		return next
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodOptions && (r.URL.Path == "/v1" || strings.HasPrefix(r.URL.Path, "/v1/")) {
			if tok := bearer(r); !f.apiKey.matches(tok) && !f.admin.matches(tok) {
				unauthorized(w, "invalid_api_key", "Incorrect API key provided: send it as \"Authorization: Bearer <key>\"")
				return
			}
		}
		next.ServeHTTP(w, r)
	})
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
