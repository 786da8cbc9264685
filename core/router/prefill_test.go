package router

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/kv"
)

// trainPrefill sends n pinned requests of 1,600 tokens to each worker,
// each first token coming after perToken[worker] per prompt token.
func trainPrefill(t *testing.T, r *Router, c *clock, perToken map[uint64]time.Duration, n int) {
	t.Helper()
	for i := range n {
		for id, d := range perToken {
			target := kv.Worker{ID: id}
			rid := fmt.Sprintf("train-%d-%d", id, i)
			toks := tokens(1000+i*7+int(id), 0, 1000+i*7+int(id), 100+i%5)
			if _, err := r.BestWorker(ctx(), &Request{ID: rid, Tokens: toks, Target: &target}); err != nil {
				t.Fatal(err)
			}
			c.advance(time.Duration(len(toks)) * d)
			r.MarkPrefillCompleted(rid)
			r.Free(rid)
		}
	}
}

// Learned prefill times route by time: worker 0 prefills four times
// faster, so a prompt goes there even behind one of the same size, where
// counting tokens sends it to the idle slow worker.
func TestLearnedPrefillRoutesByTime(t *testing.T) {
	for _, tc := range []struct {
		model string
		want  uint64
	}{{"none", 1}, {"learned", 0}} {
		t.Run(tc.model, func(t *testing.T) {
			r, c := newRouter(t, 2, func(cfg *Config) { cfg.PrefillLoadModel = tc.model; cfg.PredictedTTL = 0 })
			trainPrefill(t, r, c, map[uint64]time.Duration{0: 100 * time.Microsecond, 1: 400 * time.Microsecond}, 20)
			if tc.model == "learned" {
				fits := r.PrefillFits()
				if len(fits) != 2 || fits[0].TokensPerSecond < 9000 || fits[0].TokensPerSecond > 11000 || fits[1].TokensPerSecond < 2250 || fits[1].TokensPerSecond > 2750 {
					t.Fatalf("fits %+v, want 10,000 and 2,500 tokens/s", fits)
				}
			} else if r.PrefillFits() != nil {
				t.Fatal("fits without the learned model")
			}
			fast := kv.Worker{ID: 0}
			if _, err := r.BestWorker(ctx(), &Request{ID: "ahead", Tokens: tokens(1, 0, 1, 100), Target: &fast}); err != nil {
				t.Fatal(err)
			}
			d, err := route(r, "next", tokens(2, 0, 2, 100))
			if err != nil || d.Worker.ID != tc.want {
				t.Fatalf("went to %d (%v), want %d", d.Worker.ID, err, tc.want)
			}
		})
	}
}

func TestPrefillLoadModelChoices(t *testing.T) {
	cfg := DefaultConfig()
	cfg.BlockSize = bs
	for _, tc := range []struct{ model, err string }{
		{"aic", "use learned"}, {"psychic", "want none or learned"},
	} {
		cfg.PrefillLoadModel = tc.model
		if _, err := New(cfg); err == nil || !strings.Contains(err.Error(), tc.err) {
			t.Errorf("%s: %v, want an error saying %q", tc.model, err, tc.err)
		}
	}
	cfg.PrefillLoadModel = "learned"
	off := false
	cfg.Routing.TrackPrefillTokens = &off
	if _, err := New(cfg); err == nil {
		t.Error("learned without prompt tracking accepted")
	}
}
