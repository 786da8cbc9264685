package replay

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/lab/workload"
	"github.com/kvrouter/kvrouter/mocker/fleet"
)

// counted fronts target with a proxy that counts the completions it
// forwards. It reads each request whole before forwarding it: a
// streaming proxy whose upstream answers before the last read of the
// request body sees that body closed under it (an HTTP/1 server closes
// it once the response starts) and drops the connection mid-answer.
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
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		r.Body = io.NopCloser(bytes.NewReader(body))
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

// sessionTarget is an OpenAI endpoint that answers every completion with
// one token from worker id, recording under the prompt's last token (the
// request's index) the session header it carried.
func sessionTarget(t *testing.T, id uint64, mu *sync.Mutex, seen map[uint32]string) string {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet {
			fmt.Fprint(w, `{"data":[{"id":"m"}]}`)
			return
		}
		var body struct {
			Prompt []uint32 `json:"prompt"`
		}
		if err := json.NewDecoder(r.Body).Decode(&body); err != nil || len(body.Prompt) == 0 {
			http.Error(w, "bad body", http.StatusBadRequest)
			return
		}
		mu.Lock()
		seen[body.Prompt[len(body.Prompt)-1]] = fmt.Sprintf("%d:%s", id, r.Header.Get("X-Dynamo-Session-ID"))
		mu.Unlock()
		fmt.Fprintf(w, "data: {\"choices\":[{\"text\":\"x\"}],\"nvext\":{\"worker_id\":%d}}\n\n", id)
		fmt.Fprint(w, "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":1}}\n\ndata: [DONE]\n\n")
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

// With --session-header every request names its session and a session's
// turns take the routers in turn, whatever other sessions interleave; the
// results count the sessions whose turns went to more than one engine.
func TestSessionTurnsTakeTheTargetsInTurn(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var mu sync.Mutex
	seen := map[uint32]string{}
	cfg := smallConfig()
	cfg.SessionHeader = true
	cfg.Target = sessionTarget(t, 1, &mu, seen) + "," + sessionTarget(t, 2, &mu, seen)
	var reqs []workload.Request
	sessions := []string{"s1", "s2", "s2", "s1", "", "s1", "s2", "s3"}
	for i, s := range sessions {
		reqs = append(reqs, workload.Request{At: time.Duration(i) * time.Millisecond, Tokens: []uint32{1, 2, 3, uint32(i)}, OSL: 1, Session: s})
	}
	res, err := Run(ctx, cfg, reqs)
	if err != nil {
		t.Fatal(err)
	}
	// s1 is the first session seen, so it starts on the first router; s2
	// on the second; a request without a session goes by its position.
	want := []string{"1:s1", "2:s2", "1:s2", "2:s1", "1:", "1:s1", "2:s2", "1:s3"}
	mu.Lock()
	for i, w := range want {
		if seen[uint32(i)] != w {
			t.Errorf("request %d (session %q) reached %q, want %q", i, sessions[i], seen[uint32(i)], w)
		}
	}
	mu.Unlock()
	if m := res.Modes["target"]; m.Errors != 0 || m.Sessions != 3 || m.SplitSessions != 2 {
		t.Errorf("%d errors (%s), %d sessions, %d split; want 0, 3 and 2", m.Errors, m.FirstError, m.Sessions, m.SplitSessions)
	}
}

func TestSplitSessions(t *testing.T) {
	reqs := []workload.Request{{Session: "a"}, {Session: "a"}, {Session: "b"}, {Session: "b"}, {}, {Session: "c"}, {Session: "c"}}
	recs := []Record{
		{Index: 0, Worker: "e1"}, {Index: 1, Worker: "e1"},
		{Index: 2, Worker: "e1"}, {Index: 3, Worker: "e2"},
		{Index: 4, Worker: "e2"},
		{Index: 5, Worker: "e2"}, {Index: 6, Worker: "e1", Err: "boom"},
	}
	if n, split := splitSessions(recs, reqs); n != 3 || split != 1 {
		t.Errorf("%d sessions, %d split; want 3 and 1", n, split)
	}
}
