package natsplane

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/kvrouter/kvrouter/internal/testwait"
)

func startDurable(t *testing.T, url, id string, threshold uint64, workers ...uint64) (*Subscriber, func() []string) {
	t.Helper()
	sub, r := startSubscriber(t, url, SubscriberConfig{RouterID: id, Durable: true, SnapshotThreshold: threshold}, workers...)
	return sub, func() []string { return canonical(r.DumpEvents()) }
}

func streamLastSeq(t *testing.T, url string) uint64 {
	t.Helper()
	js, err := jetstream.New(connect(t, url))
	if err != nil {
		t.Fatal(err)
	}
	s, err := EnsureStream(context.Background(), js, Names{})
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return info.State.LastSeq
}

// caughtUp reports whether sub applied everything the stream holds; the
// stream is read anew each time since publishing is asynchronous.
func caughtUp(t *testing.T, sub *Subscriber, url string) bool {
	return sub.Stats().StreamSeq == streamLastSeq(t, url)
}

func TestDurablePlaneRecoversAcrossRestartsAndNewReplicas(t *testing.T) {
	srv := startServer(t)
	ids := []uint64{41, 42, 43}
	pubs := startPublishers(t, srv.URL(), ids...)
	js, _ := jetstream.New(connect(t, srv.URL()))
	if _, err := EnsureStream(context.Background(), js, Names{}); err != nil {
		t.Fatal(err)
	}
	a, dumpA := startDurable(t, srv.URL(), "a", 0, ids...)
	b, dumpB := startDurable(t, srv.URL(), "b", 0, ids...)
	publishAll(t, pubs, 800)
	want := truth(pubs...)
	onEveryTier(t, want)
	for _, s := range []*Subscriber{a, b} {
		testwait.Until(t, 10*time.Second, "replicas consumed the stream", func() bool { return caughtUp(t, s, srv.URL()) })
	}
	if got := dumpA(); !slices.Equal(got, want) || !slices.Equal(dumpB(), want) {
		t.Fatalf("replicas differ from the workers: %d/%d/%d blocks", len(got), len(dumpB()), len(want))
	}
	a.Close()
	b.Close()

	// Restarted a: same durable name, fresh memory.
	a2, dumpA2 := startDurable(t, srv.URL(), "a", 0, ids...)
	testwait.Until(t, 10*time.Second, "restarted replica caught up", func() bool { return caughtUp(t, a2, srv.URL()) })
	if !slices.Equal(dumpA2(), want) {
		t.Fatal("restarted replica's index differs from the one it had")
	}
	a2.Close()
	// A third replica, started while the others are down.
	c, dumpC := startDurable(t, srv.URL(), "c", 0, ids...)
	testwait.Until(t, 10*time.Second, "new replica caught up", func() bool { return caughtUp(t, c, srv.URL()) })
	if !slices.Equal(dumpC(), want) {
		t.Fatal("new replica's index differs")
	}
}

func TestDurablePlaneSnapshotsPurgesAndLoads(t *testing.T) {
	srv := startServer(t)
	p := startPublishers(t, srv.URL(), 51)[0]
	a, dumpA := startDurable(t, srv.URL(), "a", 300, 51)
	publishAll(t, []*Publisher{p}, 1000)
	want := truth(p)
	onEveryTier(t, want)
	testwait.Until(t, 10*time.Second, "consumed", func() bool { return caughtUp(t, a, srv.URL()) })
	testwait.Until(t, 10*time.Second, "snapshot written", func() bool { return a.Stats().Snapshots > 0 })
	js, _ := jetstream.New(connect(t, srv.URL()))
	stream, _ := EnsureStream(context.Background(), js, Names{})
	info, err := stream.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs >= 1000 {
		t.Fatalf("stream not purged after the snapshot: %d messages", info.State.Msgs)
	}
	if !slices.Equal(dumpA(), want) {
		t.Fatal("snapshotting replica diverged")
	}
	publishAll(t, []*Publisher{p}, 10) // after the snapshot, too
	want = truth(p)
	b, dumpB := startDurable(t, srv.URL(), "b", 0, 51)
	testwait.Until(t, 10*time.Second, "new replica caught up from the snapshot", func() bool { return caughtUp(t, b, srv.URL()) })
	if b.Stats().SnapshotBlocksLoaded == 0 {
		t.Fatal("the new replica did not load the snapshot")
	}
	if !slices.Equal(dumpB(), want) {
		t.Fatal("snapshot + stream differs from the worker")
	}

	// --router-reset-states starts from nothing.
	b.Close()
	c, r := startSubscriber(t, srv.URL(), SubscriberConfig{RouterID: "c", Durable: true, ResetStates: true}, 51)
	if n := len(r.DumpEvents()); n != 0 || c.Stats().SnapshotBlocksLoaded != 0 {
		t.Fatalf("reset router starts with %d blocks", n)
	}
}
