package router

import (
	"context"
	"testing"
	"time"
)

// A booking another replica made is predicted here as this router's own
// decisions are: the next turn of that conversation finds its prefix on
// the engine before the engine's KV events arrive, and the prediction
// ends with the request, as a local one does. An update that predicts
// nothing (from a replica that predates the field) only books load.
func TestRemoteBookingsArePredicted(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	clock := func(c *Config) { c.Now = func() time.Time { return now } }
	a, b := newSyncRouter(t, clock), newSyncRouter(t, clock)
	var log updateLog
	a.SetLoadObserver(log.add)
	turn1 := syncPrompt(7, 6, 0, 6)
	d, err := a.BestWorker(context.Background(), &Request{ID: "t1", Tokens: turn1})
	if err != nil {
		t.Fatal(err)
	}
	turn2 := append(append([]uint32(nil), turn1...), syncPrompt(8, 2, 1, 2)...)
	overlap := func(r *Router) int {
		for _, l := range r.PotentialLoads(turn2, "") {
			if l.Worker == d.Worker {
				return l.OverlapBlocks
			}
		}
		t.Fatalf("no load for %v", d.Worker)
		return 0
	}
	add := log.u[0]
	if add.Kind != LoadAdd || add.Predict != 6 {
		t.Fatalf("the booking's update: %+v, want an add predicting its 6 blocks", add)
	}
	legacy := add
	legacy.Predict, legacy.Request.ID = 0, "old/t1"
	if err := b.ApplyRemoteLoad(legacy); err != nil {
		t.Fatal(err)
	}
	if n := overlap(b); n != 0 {
		t.Fatalf("an update without predict_blocks predicted %d blocks", n)
	}
	add.Request.ID = "a/t1"
	if err := b.ApplyRemoteLoad(add); err != nil {
		t.Fatal(err)
	}
	if n, want := overlap(b), overlap(a); n != 6 || want != 6 {
		t.Fatalf("turn 2 overlaps %d blocks on the replica, %d on the router that routed turn 1; want 6 and 6", n, want)
	}
	if err := b.ApplyRemoteLoad(LoadUpdate{Kind: LoadFree, ID: "a/t1"}); err != nil {
		t.Fatal(err)
	}
	now = now.Add(predictionConfirmWindow)
	if n := overlap(b); n != 0 {
		t.Fatalf("%d blocks still predicted once the request ended and its events could have come", n)
	}
}
