package frontend

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"slices"
	"strings"

	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/core/sched"
)

// PickRequest is a request whose engine a proxy asks for and that the proxy
// then forwards itself (the Gateway API Inference Extension's endpoint
// picker): Pick reads and routes it exactly as the frontend routes its own.
type PickRequest struct {
	// Path is the request's path (a query is ignored).
	Path   string
	Header http.Header
	Body   []byte
	// Only, when not nil, are the only workers the request may go to (the
	// proxy's subset of endpoints).
	Only []uint64
}

// PickError is the answer the proxy gives the client instead of
// forwarding: an OpenAI error body and its HTTP status.
type PickError struct {
	Status int
	Code   string
	Body   []byte
}

func (e *PickError) Error() string { return e.Code }

// Booking is a picked request: its load counts in the router on Worker
// until Release. One goroutine uses a Booking.
type Booking struct {
	f        *Frontend
	req      router.Request
	booked   bool
	first    bool
	released bool

	Worker   Worker
	Decision router.Decision
	// Body is what the engine gets: the client's bytes less the router's
	// members, with the routed data-parallel rank, as the frontend
	// forwards them.
	Body []byte
	// Routed is false for a request the router does not route (not a
	// completion or a chat): Worker is then any worker in Only, nothing is
	// booked.
	Routed bool
}

// FirstToken records that the engine began to answer: the prompt stops
// counting as prefill work.
func (b *Booking) FirstToken() {
	if b.booked && !b.first && !b.released {
		b.first = true
		b.f.cfg.Router.MarkPrefillCompleted(b.req.ID)
	}
}

// Release gives the request's load back; later calls do nothing.
func (b *Booking) Release() {
	if b.booked && !b.released {
		b.released = true
		b.f.cfg.Router.Free(b.req.ID)
	}
}

// MoveTo books the request on the worker that really serves it (a proxy
// may try an endpoint other than the one picked) instead of the picked one.
func (b *Booking) MoveTo(ctx context.Context, id uint64) error {
	if !b.booked || b.released || id == b.Worker.ID {
		return nil
	}
	wk, ok := findWorker(b.f.cfg.Workers(), id)
	if !ok {
		return errWorkerGone
	}
	b.Release()
	q := b.req
	q.ID = b.f.newID()
	rank := b.Decision.Worker.DPRank
	if int(rank) >= max(wk.DPSize, 1) {
		rank = 0
	}
	q.Target, q.OverrideBusy, q.Only, q.Exclude = &kv.Worker{ID: id, DPRank: rank}, true, nil, nil
	d, err := b.f.cfg.Router.BestWorker(ctx, &q)
	if err != nil {
		return err
	}
	first := b.first
	*b = Booking{f: b.f, req: q, booked: true, Worker: wk, Decision: d, Body: b.Body, Routed: true}
	if first {
		b.FirstToken()
	}
	return nil
}

// pickableEndpoint is the OpenAI endpoint a path names.
func pickableEndpoint(path string) (endpoint, bool) {
	path, _, _ = strings.Cut(path, "?")
	switch path {
	case endpointCompletions.path:
		return endpointCompletions, true
	case endpointChat.path:
		return endpointChat, true
	}
	return endpoint{}, false
}

// Pick routes a request that a proxy forwards: completions and chats as
// the frontend routes them (tokenized, cache-aware, booked), any other
// path (e.g. GET /v1/models) to any worker in Only, in turn, unbooked. Every worker
// busy is a 429, as a proxy sheds load; no worker (in Only) a 503.
func (f *Frontend) Pick(ctx context.Context, pr PickRequest) (*Booking, *PickError) {
	ep, ok := pickableEndpoint(pr.Path)
	if !ok {
		return f.pickAny(pr.Only)
	}
	if int64(len(pr.Body)) > f.cfg.MaxBodyBytes {
		return nil, pickError(newError(http.StatusRequestEntityTooLarge, "invalid_request_error", "request_too_large", "", "the request body is larger than %d bytes", f.cfg.MaxBodyBytes))
	}
	p, herr := f.parse(ctx, ep, pr.Header, f.admin.matches(bearer(&http.Request{Header: pr.Header})), pr.Body)
	if herr != nil {
		return nil, pickError(herr)
	}
	req := p.req
	if pr.Only != nil {
		if req.Only == nil {
			req.Only = pr.Only
		} else {
			req.Only = slices.DeleteFunc(slices.Clone(req.Only), func(id uint64) bool { return !slices.Contains(pr.Only, id) })
		}
		if len(req.Only) == 0 {
			return nil, pickError(newError(http.StatusServiceUnavailable, "server_error", "no_workers", "", "no endpoint of the gateway's subset serves model %q", p.model))
		}
	}
	d, err := f.cfg.Router.BestWorker(ctx, f.withoutEjected(&req))
	if err != nil {
		herr := routeError(err, p.model)
		if errors.Is(err, sched.ErrAllBusy) {
			herr.status = http.StatusTooManyRequests
		}
		return nil, pickError(herr)
	}
	b := &Booking{f: f, req: req, booked: true, Decision: d, Routed: true}
	label := f.modelLabel(p.model)
	f.observeDecision(label, poolDecode, &d, true)
	wk, ok := findWorker(f.cfg.Workers(), d.Worker.ID)
	if !ok {
		b.Release()
		return nil, pickError(newError(http.StatusServiceUnavailable, "server_error", "no_workers", "", "the worker chosen for model %q left", p.model))
	}
	b.Worker = wk
	body, err := engineBody(p.top, pr.Body, p.members, wk, d.Worker.DPRank)
	if err != nil {
		b.Release()
		return nil, pickError(newError(http.StatusInternalServerError, "server_error", "internal", "", "re-encoding the request: %v", err))
	}
	b.Body = bytes.Join(body, nil)
	return b, nil
}

// pickAny is a worker for a request the router does not route, in turn.
func (f *Frontend) pickAny(only []uint64) (*Booking, *PickError) {
	ws := f.cfg.Workers()
	if only != nil {
		ws = slices.DeleteFunc(ws, func(w Worker) bool { return !slices.Contains(only, w.ID) })
	}
	if len(ws) == 0 {
		return nil, pickError(newError(http.StatusServiceUnavailable, "server_error", "no_workers", "", "no worker is in routing"))
	}
	n := f.anyNext.Add(1)
	return &Booking{f: f, Worker: ws[n%uint64(len(ws))]}, nil
}

func pickError(e *httpError) *PickError {
	b, _ := json.Marshal(struct {
		Error apiError `json:"error"`
	}{e.apiError})
	return &PickError{Status: e.status, Code: e.Code, Body: b}
}

// Ready reports whether the router can route every model it serves (what
// /ready answers).
func (f *Frontend) Ready() bool {
	return len(f.notReady(f.cfg.Workers(), f.registered())) == 0
}

// MaxBodyBytes is the largest request body the frontend reads.
func (f *Frontend) MaxBodyBytes() int64 { return f.cfg.MaxBodyBytes }
