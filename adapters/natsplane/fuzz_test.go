package natsplane

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"log/slog"
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/core/sched"
)

// A dump comes from whoever answers a recovery request or wrote the
// object store's snapshot: any bytes must either decode into events that
// re-encode to the same records, or be refused whole, and the events a
// decode yields must be safe to apply.
func FuzzDecodeDump(f *testing.F) {
	p := uint64(7)
	good, err := EncodeDump(nil, []kv.Event{
		kv.StoredEvent(kv.Worker{ID: 1}, 0, nil, kv.Block{EngineHash: 10, LocalHash: 100}),
		kv.StoredEvent(kv.Worker{ID: 1, DPRank: 1}, 0, &p, kv.Block{EngineHash: 11, LocalHash: 101}),
		kv.RemovedEvent(kv.Worker{ID: 2}, 0, 12),
	})
	if err != nil {
		f.Fatal(err)
	}
	f.Add(good)
	f.Add(dumpMagic[:])
	f.Add(good[:len(good)-1])
	f.Add(append(slices.Clone(dumpMagic[:]), bytes.Repeat([]byte{0xff}, dumpRecord)...))

	r := newFuzzRouter(f)
	dirty := true
	f.Fuzz(func(t *testing.T, data []byte) {
		if dirty {
			resetFuzzRouter(r)
			dirty = false
		}
		var got []kv.Event
		err = DecodeDump(data, func(ev *kv.Event) error {
			got = append(got, cloneEvent(ev))
			dirty = true
			_ = r.ApplyEvent(ev) // unknown workers and parents are refused, not fatal
			return nil
		})
		if err != nil {
			return
		}
		if n := (len(data) - len(dumpMagic)) / dumpRecord; len(got) != n {
			t.Fatalf("%d records decoded into %d events", n, len(got))
		}
		again, err := EncodeDump(nil, got)
		if err != nil {
			t.Fatalf("decoded events do not encode: %v", err)
		}
		if !bytes.Equal(again, canonicalDump(data)) {
			t.Fatalf("round trip changed the dump:\n got %x\nwant %x", again, canonicalDump(data))
		}
	})
}

// canonicalDump zeroes the fields a record's flags say are unused, which
// the encoder writes as 0.
func canonicalDump(data []byte) []byte {
	out := slices.Clone(data)
	for rec := out[len(dumpMagic):]; len(rec) > 0; rec = rec[dumpRecord:] {
		switch rec[12] {
		case 0:
			binary.LittleEndian.PutUint64(rec[13:], 0)
		case flagRemoval:
			binary.LittleEndian.PutUint64(rec[13:], 0)
			binary.LittleEndian.PutUint64(rec[29:], 0)
		}
	}
	return out
}

// newFuzzRouter is built once per fuzz worker: a router's construction
// costs far more than what one input exercises.
func newFuzzRouter(f *testing.F) *router.Router {
	r, err := router.New(router.DefaultConfig())
	if err != nil {
		f.Fatal(err)
	}
	return r
}

// resetFuzzRouter gives each input the router a fresh one would be: worker
// 1 with two ranks, no blocks, no bookings. Removing the only worker takes
// all its state with it.
func resetFuzzRouter(r *router.Router) {
	r.RemoveWorker(1)
	r.AddWorker(router.WorkerInfo{ID: 1, DPSize: 2})
}

func cloneEvent(ev *kv.Event) kv.Event {
	c := *ev
	c.Stored.Blocks = slices.Clone(ev.Stored.Blocks)
	c.Removed.EngineHashes = slices.Clone(ev.Removed.EngineHashes)
	if ev.Stored.Parent != nil {
		p := *ev.Stored.Parent
		c.Stored.Parent = &p
	}
	return c
}

// Replica-sync messages come from any client of the subject: whatever
// they hold, they are applied or counted as malformed, and a free always
// undoes its booking.
func FuzzReplicaSyncMessage(f *testing.F) {
	f.Add([]byte(`{"router_id":"b","kind":"add","request_id":"x","worker_id":1,"dp_rank":0,"sequence_hashes":[1,2,3],"isl":48,"overlap_blocks":1,"track_prefill":true}`))
	f.Add([]byte(`{"router_id":"b","kind":"prefill_done","request_id":"x"}`))
	f.Add([]byte(`{"router_id":"b","kind":"free","request_id":"x"}`))
	f.Add([]byte(`{"router_id":"b/c","kind":"add","request_id":"x","worker_id":99,"dp_rank":4000000000}`))
	f.Add([]byte(`{"router_id":"me","kind":"add"}`))
	f.Add([]byte(`[]`))

	r := newFuzzRouter(f)
	dirty := true
	f.Fuzz(func(t *testing.T, data []byte) {
		if dirty {
			resetFuzzRouter(r)
		}
		s := &relay[router.LoadUpdate]{id: "me", what: "replica sync", log: slog.New(slog.DiscardHandler), decode: DecodeLoadUpdate, apply: r.ApplyRemoteLoad}
		s.handle(data)
		dirty = s.applied.Load()+s.applyErrors.Load() != 0
		if s.applied.Load()+s.ignored.Load()+s.malformed.Load()+s.applyErrors.Load() != 1 {
			t.Fatalf("a message was neither applied nor counted: %+v", s.Stats())
		}
		var m syncAdd
		if s.applied.Load() == 1 && json.Unmarshal(data, &m) == nil && m.Kind == router.LoadAdd.String() {
			free, _ := json.Marshal(syncAdd{syncHead: syncHead{RouterID: m.RouterID, Kind: router.LoadFree.String(), RequestID: m.RequestID}})
			s.handle(free)
			for _, l := range r.Loads() {
				if l.ActiveRequests != 0 || l.ActiveDecodeBlocks != 0 || l.ActivePrefillTokens != 0 {
					t.Fatalf("a freed booking left load behind: %+v", l)
				}
			}
		}
	})
}

// Session-sync messages come from any client of the subject: whatever
// they hold, they are applied or counted as malformed, and a binding
// applied is one the router then routes the session by.
func FuzzSessionSyncMessage(f *testing.F) {
	f.Add([]byte(`{"router_id":"b","kind":"bind","session_id":"s","worker_id":1,"dp_rank":1,"sequence":1,"ttl_secs":30}`))
	f.Add([]byte(`{"router_id":"b","kind":"refresh","session_id":"s","worker_id":1,"sequence":3}`))
	f.Add([]byte(`{"router_id":"b","kind":"close","session_id":"s","sequence":9}`))
	f.Add([]byte(`{"router_id":"b","kind":"bind","session_id":"s","worker_id":1,"dp_rank":4000000000,"ttl_secs":1e300}`))
	f.Add([]byte(`{"router_id":"me","kind":"bind"}`))
	f.Add([]byte(`[]`))

	r := newFuzzRouter(f)
	resetFuzzRouter(r)
	f.Fuzz(func(t *testing.T, data []byte) {
		var changed bool
		s := &relay[sched.SessionUpdate]{id: "me", what: "session sync", log: slog.New(slog.DiscardHandler), decode: DecodeSessionUpdate,
			apply: func(u sched.SessionUpdate) (err error) { changed, err = r.ApplyRemoteSession(u); return err }}
		s.handle(data)
		if s.applied.Load()+s.ignored.Load()+s.malformed.Load()+s.applyErrors.Load() != 1 {
			t.Fatalf("a message was neither applied nor counted: %+v", s.Stats())
		}
		_, u, _ := DecodeSessionUpdate(data)
		if !changed || u.Kind == sched.SessionClosed {
			return
		}
		d, err := r.BestWorker(context.Background(), &router.Request{Tokens: []uint32{1, 2, 3}, Session: &sched.SessionControl{ID: u.ID}})
		if err != nil || d.Via != sched.ViaSession || d.Worker != u.Worker {
			t.Fatalf("applied %+v, then routed %+v, %v", u, d, err)
		}
	})
}
