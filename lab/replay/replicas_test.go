package replay

import (
	"context"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/mocker/fleet"
)

// counted fronts target with a proxy that counts the completions it
// forwards.
func counted(t *testing.T, target string, n *atomic.Int64) string {
	t.Helper()
	u, err := url.Parse(target)
	if err != nil {
		t.Fatal(err)
	}
	proxy := httputil.NewSingleHostReverseProxy(u)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost {
			n.Add(1)
		}
		proxy.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

// Several targets take the requests in turn, as router replicas behind a
// round-robin client.
func TestReplayTargetsTakeTurns(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a fleet")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	fcfg := fleet.DefaultConfig()
	fcfg.NumWorkers, fcfg.SpeedupRatio, fcfg.HTTPPort, fcfg.KVEventsPort, fcfg.KVEventsReplayPort = 2, 20, 0, 0, 0
	engines, err := fleet.Start(ctx, fcfg)
	if err != nil {
		t.Fatal(err)
	}
	defer engines.Close()
	var a, b atomic.Int64
	cfg := smallConfig()
	cfg.Target = counted(t, engines.Engines()[0].HTTPURL, &a) + " , " + counted(t, engines.Engines()[1].HTTPURL, &b) + "/"
	res, err := Run(ctx, cfg, sharedPrefixWorkload(t)[:20])
	if err != nil {
		t.Fatal(err)
	}
	if m := res.Modes["target"]; m == nil || m.Requests != 20 || m.Errors != 0 {
		t.Fatalf("target run: %+v", m)
	}
	if a.Load() != 10 || b.Load() != 10 {
		t.Fatalf("the targets got %d and %d requests, want 10 each", a.Load(), b.Load())
	}
	cfg.Target = " , "
	if _, err := Run(ctx, cfg, sharedPrefixWorkload(t)[:1]); err == nil {
		t.Fatal("a --target naming no endpoint was accepted")
	}
}

// Two router replicas on a NATS plane with replica sync, the requests in
// turn, find the caches one router finds.
func TestReplayRouterReplicas(t *testing.T) {
	res, reqs := replaySharedPrefix(t, "kv+replicas=1", "kv+replicas=2")
	for _, mode := range res.Order {
		m := res.Modes[mode]
		if m.Requests != len(reqs) || m.Errors != 0 {
			t.Fatalf("%s: %d requests, %d errors (%s)", mode, m.Requests, m.Errors, m.FirstError)
		}
		if m.PrefixHitRate < 0.8*m.CeilingHitRate {
			t.Errorf("%s: hit rate %.3f, under 80%% of the ceiling %.3f", mode, m.PrefixHitRate, m.CeilingHitRate)
		}
	}
}
