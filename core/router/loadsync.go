package router

import (
	"errors"
	"fmt"
	"slices"

	"github.com/kvrouter/kvrouter/core/load"
)

// LoadUpdateKind says what a LoadUpdate does to the predicted load.
type LoadUpdateKind uint8

// The kinds of load updates, one per booking call of the Router.
const (
	LoadAdd         LoadUpdateKind = iota + 1 // a request was booked
	LoadPrefillDone                           // its prefill completed
	LoadFree                                  // it ended
)

func (k LoadUpdateKind) String() string {
	switch k {
	case LoadAdd:
		return "add"
	case LoadPrefillDone:
		return "prefill_completed"
	case LoadFree:
		return "free"
	}
	return fmt.Sprintf("LoadUpdateKind(%d)", uint8(k))
}

// LoadUpdate is one change a router made to its predicted load, in the
// form another replica needs to make the same change to its own.
type LoadUpdate struct {
	Kind LoadUpdateKind
	// Request is the booking, for LoadAdd. Its slices and pointers are the
	// update's own: they may be kept.
	Request load.Request
	// ID is the request's id, for LoadPrefillDone and LoadFree.
	ID string
	// Predict is how many leading blocks of Request.Blocks the worker is
	// predicted to cache once it has the prompt, for LoadAdd: all of them
	// but those at and after an unknown multimodal item, which must never
	// be credited. 0 predicts nothing.
	Predict int
}

// ErrUnknownRequest is returned by ApplyRemoteLoad for a prefill completion
// or a free that changes nothing: the request is not active here (never
// seen, expired, or its worker was removed) or its prefill already ended.
var ErrUnknownRequest = errors.New("router: no active request with this id")

// SetLoadObserver makes fn see every load change this router books itself:
// each successful booking, each MarkPrefillCompleted and Free that changed
// something, in the order they happened. Changes applied with
// ApplyRemoteLoad are not observed, so replicas that relay each other's
// updates never echo them. nil removes the observer.
//
// fn runs on the routing path, for bookings with the router's lock held: it
// must be quick, must not block and must not call back into the Router.
func (r *Router) SetLoadObserver(fn func(LoadUpdate)) {
	if fn == nil {
		r.observer.Store(nil)
		return
	}
	r.observer.Store(&fn)
}

func (r *Router) observe(u LoadUpdate) {
	if fn := r.observer.Load(); fn != nil {
		(*fn)(u)
	}
}

// observeAdd reports a booking, predict of its blocks predictable. The
// request's hashes and override pointers point into a pooled prepared
// request that the next one overwrites, so the observer gets copies.
func (r *Router) observeAdd(req load.Request, predict int) {
	fn := r.observer.Load()
	if fn == nil {
		return
	}
	req.Blocks = slices.Clone(req.Blocks)
	req.TrackPrefill = cloneBool(req.TrackPrefill)
	req.AssumeReuse = cloneBool(req.AssumeReuse)
	req.TrackBlocks = cloneBool(req.TrackBlocks)
	(*fn)(LoadUpdate{Kind: LoadAdd, Request: req, Predict: predict})
}

func cloneBool(p *bool) *bool {
	if p == nil {
		return nil
	}
	v := *p
	return &v
}

// ApplyRemoteLoad makes a change another replica booked, so that this
// router scores against the whole fleet's load and not only its own share.
// A booking's predictable blocks join predict-on-route as this router's
// own decisions do, until the request's first token or end settles them:
// the next turn of a conversation another replica routed finds its
// prefix on the engine before that engine's KV events arrive, as it would
// on a single router. It is not passed to the load observer. A LoadAdd for a worker rank this
// router does not know is refused: the booking could never be scored and
// would only hold memory until it expired.
func (r *Router) ApplyRemoteLoad(u LoadUpdate) error {
	switch u.Kind {
	case LoadAdd:
		w := u.Request.Worker
		info, ok := r.fleet.Load().infos[w.ID]
		switch {
		case !ok:
			return fmt.Errorf("%w: %v", ErrUnknownWorker, w)
		case int(w.DPRank) >= info.DPSize:
			return fmt.Errorf("%w: rank %d of %d", ErrDPRankRange, w.DPRank, info.DPSize)
		}
		if err := r.tracker.AddRequest(u.Request); err != nil {
			if errors.Is(err, load.ErrDuplicateRequest) {
				return fmt.Errorf("%w: %v", ErrDuplicateID, err)
			}
			return err
		}
		n := min(u.Predict, len(u.Request.Blocks))
		if r.predicted != nil && n > 0 {
			r.predicted.Add(u.Request.ID, w, u.Request.Blocks[:n], r.now())
		}
		// The engine's events show the prefill's end only by the blocks
		// it stores: a prompt it already held whole, or one past an
		// unknown multimodal item (never whole in the index), waits for
		// the relayed first token.
		if r.exact != nil && n == len(u.Request.Blocks) && u.Request.OverlapBlocks < n {
			r.remotePrefill.watch(u.Request.ID, w, u.Request.Blocks)
		}
		return nil
	case LoadPrefillDone:
		if r.remotePrefill.ended(u.ID) {
			return nil // settled from the engine's events
		}
		if !r.tracker.MarkPrefillCompleted(u.ID) {
			return fmt.Errorf("%w: prefill completed of %q", ErrUnknownRequest, u.ID)
		}
		r.settlePrediction(u.ID)
	case LoadFree:
		r.remotePrefill.ended(u.ID)
		if !r.tracker.Free(u.ID) {
			return fmt.Errorf("%w: free of %q", ErrUnknownRequest, u.ID)
		}
		r.settlePrediction(u.ID)
	default:
		return fmt.Errorf("router: unknown load update kind %d", uint8(u.Kind))
	}
	// The other replica's request no longer holds capacity here either.
	r.drain()
	return nil
}
