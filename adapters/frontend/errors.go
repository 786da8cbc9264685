package frontend

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strings"

	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/core/sched"
)

// apiError is OpenAI's error object.
type apiError struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    string  `json:"code"`
}

// httpError is an error bound for the client, with its status.
type httpError struct {
	status int
	apiError
}

func (e *httpError) Error() string { return e.Message }

func newError(status int, typ, code, param, format string, args ...any) *httpError {
	e := &httpError{status: status, apiError: apiError{Message: fmt.Sprintf(format, args...), Type: typ, Code: code}}
	if param != "" {
		e.Param = &param
	}
	return e
}

func badRequest(code, param, format string, args ...any) *httpError {
	return newError(http.StatusBadRequest, "invalid_request_error", code, param, format, args...)
}

func writeError(w http.ResponseWriter, status int, typ, code, param, format string, args ...any) {
	writeHTTPError(w, newError(status, typ, code, param, format, args...))
}

func writeHTTPError(w http.ResponseWriter, e *httpError) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Del("Content-Length")
	w.WriteHeader(e.status)
	_ = json.NewEncoder(w).Encode(struct {
		Error apiError `json:"error"`
	}{e.apiError})
}

// errorEvent is the SSE event that ends a broken stream.
func errorEvent(code, format string, args ...any) []byte {
	b, _ := json.Marshal(struct {
		Error apiError `json:"error"`
	}{apiError{Message: fmt.Sprintf(format, args...), Type: "server_error", Code: code}})
	return append(append([]byte("data: "), b...), "\n\n"...)
}

// readBody reads a request body of at most limit bytes.
func readBody(w http.ResponseWriter, r *http.Request, limit int64) ([]byte, *httpError) {
	in := http.MaxBytesReader(w, r.Body, limit)
	var body []byte
	var err error
	if r.ContentLength >= 0 && r.ContentLength <= limit {
		// Sized once: a body read by doubling leaves up to twice its size
		// behind, and bodies are the largest buffers a client controls.
		body = make([]byte, r.ContentLength)
		_, err = io.ReadFull(in, body)
	} else {
		body, err = io.ReadAll(in)
	}
	if err != nil {
		var tooBig *http.MaxBytesError
		if errors.As(err, &tooBig) {
			return nil, newError(http.StatusRequestEntityTooLarge, "invalid_request_error", "request_too_large", "", "request body larger than %d bytes", tooBig.Limit)
		}
		return nil, badRequest("invalid_body", "", "the request body could not be read: %v", err)
	}
	return body, nil
}

// routeError turns a router error into the client's answer.
func routeError(err error, model string) *httpError {
	switch {
	case errors.Is(err, sched.ErrAllBusy):
		return newError(http.StatusServiceUnavailable, "server_error", "all_workers_busy", "", "all workers serving model %q are busy; retry later", model)
	case errors.Is(err, router.ErrNoWorkers), errors.Is(err, sched.ErrNoCandidates):
		return newError(http.StatusServiceUnavailable, "server_error", "no_workers", "", "no worker serves model %q", model)
	case errors.Is(err, sched.ErrUnknownWorker):
		return badRequest("unknown_worker", "nvext.backend_instance_id", "nvext.backend_instance_id and dp_rank name no worker rank serving model %q", model)
	case errors.Is(err, sched.ErrNoTarget):
		return badRequest("no_target", "nvext.backend_instance_id", "the router is in direct mode: name a worker with nvext.backend_instance_id")
	case errors.Is(err, sched.ErrTooManySessions):
		return newError(http.StatusTooManyRequests, "invalid_request_error", "too_many_sessions", "nvext.session_control.session_id", "%s; close sessions or let them time out", detail(err, sched.ErrTooManySessions))
	case errors.Is(err, sched.ErrInvalidParams):
		return badRequest("invalid_nvext", "nvext", "%s", detail(err, sched.ErrInvalidParams))
	case errors.Is(err, sched.ErrInvalidRequest):
		msg := detail(err, sched.ErrInvalidRequest)
		if strings.HasPrefix(msg, "session_control") {
			return badRequest("invalid_nvext", "nvext.session_control", "nvext.%s", msg)
		}
		return badRequest("invalid_nvext", "nvext", "%s", msg)
	case errors.Is(err, router.ErrDuplicateID):
		return newError(http.StatusConflict, "invalid_request_error", "duplicate_request_id", "request_id", "a request with this request_id is already booked")
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return newError(http.StatusServiceUnavailable, "server_error", "cancelled", "", "the request ended while waiting for a worker: %v", err)
	}
	return newError(http.StatusInternalServerError, "server_error", "routing_failed", "", "routing failed: %v", err)
}

// detail is what err says beyond its sentinel's own text: the part written
// in the request's terms.
func detail(err, sentinel error) string {
	msg := strings.TrimPrefix(err.Error(), sentinel.Error())
	if msg = strings.TrimPrefix(msg, ": "); msg == "" {
		return sentinel.Error()
	}
	return msg
}

// engineFault is a failure to reach or read an engine. What the transport
// says of it names sockets and addresses ("read tcp 10.0.0.5:41234->
// 10.0.0.7:8000: connection reset by peer"), which are for the log: the
// client's message says only what happened, with the engine's name around
// it.
type engineFault struct {
	what string
	err  error
}

func (e *engineFault) Error() string { return e.what }
func (e *engineFault) Unwrap() error { return e.err }

// LogValue is the whole story, for the log.
func (e *engineFault) LogValue() slog.Value { return slog.StringValue(e.what + ": " + e.err.Error()) }
