package frontend

import (
	"net/http"
	"sync"
	"time"

	"github.com/kvrouter/kvrouter/core/router"
)

// BookingLifetime is how long a booking made through /router/best_worker
// may hold load: the router's own request TTL, enforced here too so that
// the count of bookings cannot be filled up for good.
const BookingLifetime = 300 * time.Second

// MaxBookingTokens bounds a booked prompt where no engine reports its KV
// capacity: far beyond any context window, small enough that one booking
// cannot stand for a whole fleet's memory.
const MaxBookingTokens = 1 << 20

// bookings are the requests booked through the router API and not yet
// freed, by id, with their time of booking.
type bookings struct {
	max int
	mu  sync.Mutex
	at  map[string]time.Time
}

func newBookings(max int) *bookings { return &bookings{max: max, at: map[string]time.Time{}} }

// reserve makes room for one more booking, freeing those past their
// lifetime first; false when the bound is reached.
func (b *bookings) reserve(r *router.Router, id string, now time.Time) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, dup := b.at[id]; dup {
		return true // the router refuses it as a duplicate
	}
	if len(b.at) >= b.max {
		for old, t := range b.at {
			if now.Sub(t) >= BookingLifetime {
				r.Free(old)
				delete(b.at, old)
			}
		}
	}
	if len(b.at) >= b.max {
		return false
	}
	b.at[id] = now
	return true
}

func (b *bookings) release(id string) {
	b.mu.Lock()
	delete(b.at, id)
	b.mu.Unlock()
}

// checkBookingSize refuses a booking no single engine serving the model
// could hold.
func (f *Frontend) checkBookingSize(req *router.Request) *httpError {
	limit := MaxBookingTokens
	largest := 0 // tokens; engines count their capacity in their own blocks
	for _, in := range f.cfg.Router.Workers() {
		if req.Model == "" || in.Model == "" || in.Model == req.Model {
			largest = max(largest, in.TotalKVBlocks*f.cfg.Router.WorkerBlockSize(in.ID))
		}
	}
	if largest > 0 {
		limit = min(limit, largest)
	}
	if len(req.Tokens) > limit {
		return badRequest("booking_too_large", "tokens", "a booking of %d tokens exceeds %d, the most any engine serving the model can hold", len(req.Tokens), limit)
	}
	return nil
}

func tooManyBookings(limit int) *httpError {
	return newError(http.StatusTooManyRequests, "rate_limit_error", "too_many_bookings",
		"request_id", "%d requests are booked through the router API; free some first (bookings expire after %v)", limit, BookingLifetime)
}
