package router

import (
	"context"
	"errors"
	"testing"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/core/index"
	"github.com/kvrouter/kvrouter/core/kv"
)

// fakeRemote answers with fixed overlaps, or fails.
type fakeRemote struct {
	dev   []index.Overlap
	err   error
	asked []RemoteQuery
}

func (f *fakeRemote) Overlaps(q RemoteQuery) ([]index.Overlap, []index.TierOverlap, error) {
	f.asked = append(f.asked, RemoteQuery{Model: q.Model, Local: append([]uint64(nil), q.Local...)})
	return f.dev, nil, f.err
}

func remoteRouter(t *testing.T, rem RemoteIndex) *Router {
	t.Helper()
	cfg := DefaultConfig()
	cfg.Remote = rem
	cfg.PredictedTTL = 0
	r, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	r.AddWorker(WorkerInfo{ID: 1})
	r.AddWorker(WorkerInfo{ID: 2})
	return r
}

func toks(n int, seed uint32) []uint32 {
	t := make([]uint32, n)
	for i := range t {
		t[i] = seed*100000 + uint32(i)
	}
	return t
}

// The remote primary's answer is the overlap, asked with the request's
// local hashes (capped at the prompt); a failed remote falls back to the
// approximate index of the router's own decisions.
func TestRemotePrimaryAnswersAndFallsBack(t *testing.T) {
	rem := &fakeRemote{dev: []index.Overlap{{Worker: kv.Worker{ID: 2}, Blocks: 99}}}
	r := remoteRouter(t, rem)
	p := toks(64, 1)
	d, err := r.BestWorker(context.Background(), &Request{Tokens: p, Model: "m"})
	if err != nil || d.Worker.ID != 2 || d.OverlapBlocks != 4 {
		t.Fatalf("decision %+v %v: the remote says worker 2 holds the whole prompt", d, err)
	}
	if want := blockhash.New(16, "").LocalHashes(p); len(rem.asked) != 1 || rem.asked[0].Model != "m" || len(rem.asked[0].Local) != len(want) || rem.asked[0].Local[3] != want[3] {
		t.Errorf("asked %+v", rem.asked)
	}

	// Book q on worker 1, then the remote fails: the approximate index
	// remembers the decision.
	q := toks(64, 2)
	rem.dev = []index.Overlap{{Worker: kv.Worker{ID: 1}, Blocks: 1}}
	if d, err := r.BestWorker(context.Background(), &Request{ID: "q", Tokens: q}); err != nil || d.Worker.ID != 1 {
		t.Fatalf("booking q: %+v %v", d, err)
	}
	rem.err, rem.dev = errors.New("connection refused"), nil
	d, err = r.BestWorker(context.Background(), &Request{Tokens: q})
	if err != nil || d.Worker.ID != 1 || d.OverlapBlocks != 4 {
		t.Errorf("with the remote down, q: %+v %v; the approximate index holds it on worker 1", d, err)
	}
	if st := r.RemoteStats(); st.Answered != 2 || st.Failed != 1 {
		t.Errorf("remote stats %+v", st)
	}
	if r.DumpEvents() != nil {
		t.Error("a router with a remote primary has no index of its own to dump")
	}
}

// A remote primary is an event-fed index: without events there is
// nothing to share.
func TestRemotePrimaryNeedsEvents(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Remote = &fakeRemote{}
	cfg.KVEvents = false
	if _, err := New(cfg); !errors.Is(err, errRemoteWithoutEvents) {
		t.Fatalf("no events: %v", err)
	}
}

// PrimaryMatch answers from the event-fed index only, never from the
// predict-on-route side index.
func TestPrimaryMatchIgnoresPredictions(t *testing.T) {
	r, err := New(DefaultConfig())
	if err != nil {
		t.Fatal(err)
	}
	r.AddWorker(WorkerInfo{ID: 1})
	p := toks(64, 3)
	if _, err := r.BestWorker(context.Background(), &Request{ID: "a", Tokens: p}); err != nil {
		t.Fatal(err)
	}
	_, seq := blockhash.New(16, "").Hashes(p)
	var m index.Matcher
	if dev, _, ok := r.PrimaryMatch(&m, seq); !ok || len(dev) != 0 {
		t.Errorf("a prediction was served: %+v %v", dev, ok)
	}
	if d, _ := r.BestWorker(context.Background(), &Request{Tokens: p}); d.OverlapBlocks != 4 {
		t.Errorf("the router itself still sees its prediction: %+v", d)
	}
}
