package enginesource

import (
	"context"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/adapters/zmqevents"
	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/internal/testwait"
)

// probeEvery is short so that the tests wait little for a silence.
const probeEvery = 50 * time.Millisecond

func TestLossAtTheEndOfTheStreamIsRecoveredAfterSilence(t *testing.T) {
	p := newTestPub(t, pubOpts{})
	r := newRouter(t, router.WorkerInfo{ID: 1})
	w := kv.Worker{ID: 1}
	s := start(t, Config{Worker: w, Events: p.events(), Replay: p.replay(), SilenceProbe: probeEvery}, r)
	warmUp(t, p, s)
	before := s.Stats()
	a := toks(5, 11)
	wait(t, s, p.publish(t, stored(t, nil, a, 1100, 0, 2), true))
	p.publish(t, stored(t, nil, a, 1100, 2, 3), false) // lost on the wire, and nothing follows
	last := p.publish(t, stored(t, nil, a, 1100, 3, 5), false)
	// The probe publishes the position as it applies each batch and counts
	// the recovered gap after the last one: wait for both.
	waitFor(t, s, "the probe's recovery", func(st Stats) bool {
		return st.HaveSeq && st.LastSeq >= last && st.Recovered > before.Recovered
	})
	if got := overlap(t, r, w, a); got != 5 {
		t.Fatalf("overlap %d, want 5: the batches lost at the end must come back by replay", got)
	}
	st := s.Stats()
	if st.Gaps-before.Gaps != 1 || st.Recovered-before.Recovered != 1 || st.Replayed-before.Replayed != 2 || st.Rebuilds != 0 || st.Resets != 0 {
		t.Fatalf("stats %+v", st)
	}
	// Later probes of the same silence find nothing and change nothing.
	waitFor(t, s, "another probe", func(now Stats) bool { return now.Probes > st.Probes })
	if now := s.Stats(); now.Batches != st.Batches || now.Rebuilds != 0 || now.Resets != 0 || now.Gaps != st.Gaps {
		t.Fatalf("a probe that found nothing changed the source: %+v", now)
	}
	if got := overlap(t, r, w, a); got != 5 {
		t.Fatalf("overlap %d after more probes, want 5", got)
	}
}

func TestEngineRestartedWhileUnheardIsResetAfterSilence(t *testing.T) {
	for _, tc := range []struct {
		name string
		past bool // the new engine, all of whose batches are missed live, goes past the old position
	}{
		{"behind the old position", false}, // the replay has nothing at the last seq applied
		{"past the old position", true},    // it has another batch there
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newTestPub(t, pubOpts{})
			w := kv.Worker{ID: 1}
			r := newRouter(t, router.WorkerInfo{ID: 1})
			s := start(t, Config{Worker: w, Events: p.events(), Replay: p.replay(), SilenceProbe: probeEvery}, r)
			warmUp(t, p, s)
			old := toks(3, 12)
			oldLast := p.publish(t, stored(t, nil, old, 1200, 0, 3), true)
			wait(t, s, oldLast)
			batches := 2
			if tc.past {
				batches = int(oldLast) + 3
			}
			p.restart()
			y := toks(batches, 13)
			var last uint64
			for i := range batches {
				last = p.publish(t, stored(t, nil, y, 1300, i, i+1), false)
			}
			waitFor(t, s, "the restart", func(st Stats) bool { return st.Resets == 1 && st.HaveSeq && st.LastSeq >= last })
			if got := overlap(t, r, w, old); got != 0 {
				t.Fatalf("the old engine's blocks survived its restart: overlap %d", got)
			}
			if got := overlap(t, r, w, y); got != batches {
				t.Fatalf("the new engine's blocks: overlap %d, want %d", got, batches)
			}
			if st := s.Stats(); st.Rebuilds != 1 || st.Probes == 0 || st.LastSeq != last {
				t.Fatalf("stats %+v", st)
			}
		})
	}
}

// An engine process restarted on the same ports: the subscriber's
// connection breaks, and the new incarnation's first batches go out before
// the subscriber has redialled (ZeroMQ drops what a PUB socket sends with
// no subscriber connected).
func TestEngineRestartedOnTheSamePortsIsResetAfterSilence(t *testing.T) {
	newPub := func(events, replay string) *zmqevents.Publisher {
		t.Helper()
		p, err := zmqevents.NewPublisher(zmqevents.PublisherConfig{Endpoint: events, ReplayEndpoint: replay})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = p.Close() })
		return p
	}
	publish := func(p *zmqevents.Publisher, payload []byte) uint64 {
		t.Helper()
		seq, err := p.Publish(payload)
		if err != nil {
			t.Fatal(err)
		}
		return seq
	}
	old := newPub("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
	events, replay := old.Endpoint(), old.ReplayEndpoint()
	w := kv.Worker{ID: 1}
	r := newRouter(t, router.WorkerInfo{ID: 1})
	s := start(t, Config{Worker: w, Events: events, Replay: replay, SilenceProbe: probeEvery}, r)
	deadline := time.Now().Add(10 * time.Second)
	for s.Stats().Received == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the subscription never reached the publisher: %+v", s.Stats())
		}
		seq := publish(old, empty(t))
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
		_ = s.WaitSeq(ctx, seq) // pacing only; the condition is Received
		cancel()
	}
	a := toks(3, 14)
	wait(t, s, publish(old, stored(t, nil, a, 1400, 0, 3)))

	if err := old.Close(); err != nil {
		t.Fatal(err)
	}
	restarted := newPub(events, replay)
	y := toks(2, 15)
	publish(restarted, stored(t, nil, y, 1500, 0, 1))
	last := publish(restarted, stored(t, nil, y, 1500, 1, 2))
	waitFor(t, s, "the restart", func(st Stats) bool { return st.Resets == 1 && st.HaveSeq && st.LastSeq >= last })
	if got := overlap(t, r, w, a); got != 0 {
		t.Fatalf("the old engine's blocks survived its restart: overlap %d", got)
	}
	if got := overlap(t, r, w, y); got != 2 {
		t.Fatalf("the new engine's blocks: overlap %d, want 2", got)
	}
}

// A batch published after the start-up catch-up and before the
// subscription joined the stream (ZeroMQ sends a subscriber nothing from
// before it joined) is applied once the subscription joins, not only with
// the next batch or a silence probe (switched off here).
func TestBatchPublishedBeforeTheSubscriptionJoinedIsCaughtUp(t *testing.T) {
	p := newTestPub(t, pubOpts{late: true})
	r := newRouter(t, router.WorkerInfo{ID: 1})
	w := kv.Worker{ID: 1}
	a := toks(3, 16)
	first := p.publish(t, stored(t, nil, a, 1600, 0, 1), false)
	s := start(t, Config{Worker: w, Events: p.events(), Replay: p.replay(), SilenceProbe: -1}, r)
	wait(t, s, first) // the start-up catch-up, while nothing listens for the subscriber yet
	missed := p.publish(t, stored(t, nil, a, 1600, 1, 3), false)
	p.listen(t)
	testwait.Until(t, 10*time.Second, "the batch published before the subscription joined is applied", func() bool {
		return s.Synced(missed)
	})
	if got := overlap(t, r, w, a); got != 3 {
		t.Fatalf("overlap %d, want 3", got)
	}
	if st := s.Stats(); st.Joins == 0 || st.Probes != 0 || st.Received != 0 || st.Rebuilds != 0 || st.HistoryLost != 0 {
		t.Fatalf("stats %+v", st)
	}
}
