package frontend

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/core/sched"
)

// engineSessionCapacity is the capacity_of_str_len sent with
// /open_session: SGLang requires the field, and Dynamo sends this value.
const engineSessionCapacity = 65536

// engineSessionTimeout bounds one /open_session or /close_session call, so
// that an engine that hangs on it delays its request by at most this much.
const engineSessionTimeout = 5 * time.Second

// engineSessions carries nvext.session_control's open and close to the
// engines' own session API (SGLang's /open_session and /close_session).
// An engine that has none (it answers 404 or 405) is told once in the log
// and not asked again: its sessions are bound in the router only.
type engineSessions struct {
	mu      sync.Mutex
	without map[string]bool // base URLs of engines without a session API
}

func (e *engineSessions) lacks(base string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.without[base]
}

// markLacking records that base has no session API and reports whether
// that is news.
func (e *engineSessions) markLacking(base string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.without == nil {
		e.without = map[string]bool{}
	}
	if e.without[base] {
		return false
	}
	e.without[base] = true
	return true
}

// engineSession calls the engine's session API for sess's open or close
// (other actions call nothing). A failure is logged, never the request's:
// the router's binding still keeps the session on its engine.
func (c *call) engineSession(sess *sched.SessionControl) {
	if sess == nil || (sess.Action != sched.SessionOpen && sess.Action != sched.SessionClose) || c.worker.BaseURL == "" {
		return
	}
	f, wk := c.f, c.worker
	base := strings.TrimRight(wk.BaseURL, "/")
	if f.sessions.lacks(base) {
		return
	}
	path := "/close_session"
	body := map[string]any{"session_id": sess.ID}
	if sess.Action == sched.SessionOpen {
		path = "/open_session"
		body["capacity_of_str_len"] = engineSessionCapacity
		if sess.Timeout > 0 {
			body["timeout"] = sess.Timeout.Seconds()
		}
	}
	// The client may have left: a close still goes out, so that the
	// engine does not hold the session until its timeout.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(c.ctx), engineSessionTimeout)
	defer cancel()
	status, msg, err := postJSON(ctx, f.cfg.Client, base+path, body)
	switch {
	case err != nil:
		f.log.Warn("engine session call failed", "worker", wk.Name, "path", path, "session", sess.ID, "err", err)
	case status == http.StatusNotFound || status == http.StatusMethodNotAllowed:
		if f.sessions.markLacking(base) {
			f.log.Warn("engine has no session API: its sessions are bound in the router only", "worker", wk.Name, "path", path, "status", status)
		}
	case status != http.StatusOK:
		f.log.Warn("engine refused a session call", "worker", wk.Name, "path", path, "session", sess.ID, "status", status, "answer", msg)
	}
}

// postJSON posts v and returns the status and, for an error, the start of
// the answer.
func postJSON(ctx context.Context, client *http.Client, url string, v any) (int, string, error) {
	b, err := json.Marshal(v)
	if err != nil {
		return 0, "", err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(b))
	if err != nil {
		return 0, "", err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return 0, "", fmt.Errorf("POST %s: %w", url, err)
	}
	defer resp.Body.Close()
	data, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
	if resp.StatusCode == http.StatusOK {
		return resp.StatusCode, "", nil
	}
	return resp.StatusCode, string(bytes.TrimSpace(data)), nil
}
