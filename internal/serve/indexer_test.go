package serve

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/adapters/indexerapi"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/internal/indexer"
	"github.com/kvrouter/kvrouter/internal/testwait"
	"github.com/kvrouter/kvrouter/mocker/fleet"
)

func postIndexer(t *testing.T, url string, body any) (int, []byte) {
	t.Helper()
	b, _ := json.Marshal(body)
	resp, err := http.Post(url, "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, out
}

func scoreOf(t *testing.T, url string, tokens []int, model string) indexerapi.Score {
	t.Helper()
	code, b := postIndexer(t, url+"/query", map[string]any{"token_ids": tokens, "model_name": model})
	var sc indexerapi.Score
	if code != http.StatusOK || json.Unmarshal(b, &sc) != nil {
		t.Fatalf("query: %d %s", code, b)
	}
	return sc
}

// --serve-indexer: the router's own index, fed by its engines' events,
// answers the indexer API under /indexer; registrations are refused.
func TestServeIndexerServesTheRoutersIndex(t *testing.T) {
	f := engineFleet(t)
	cfg := Config{Router: router.DefaultConfig(), Workers: []WorkerSpec{spec(7, f)}, HealthInterval: 50 * time.Millisecond, ServeIndexer: true}
	s := startServerWith(t, cfg)
	p := prompt(0, 1, 64)
	completeOn(t, s, p, 0)
	base := s.URL() + IndexerPath
	testwait.Until(t, 30*time.Second, "the served index credits the prompt", func() bool {
		return scoreOf(t, base, p, "kvrouter-mock").Scores["7"]["0"] == 64
	})
	if code, b := postIndexer(t, base+"/register", map[string]any{"instance_id": 9, "endpoint": "tcp://127.0.0.1:1", "model_name": "kvrouter-mock", "block_size": 16}); code != http.StatusForbidden || !strings.Contains(string(b), "--worker") {
		t.Errorf("register on a router: %d %s", code, b)
	}
	if code, b := postIndexer(t, base+"/query", map[string]any{"token_ids": p, "model_name": "other-model"}); code != http.StatusNotFound {
		t.Errorf("a model the router does not serve: %d %s", code, b)
	}
	resp, err := http.Get(base + "/workers")
	if err != nil {
		t.Fatal(err)
	}
	var ws []indexerapi.WorkerView
	_ = json.NewDecoder(resp.Body).Decode(&ws)
	resp.Body.Close()
	// The replay endpoint is listed too: an indexer recovering from this
	// one replays from it what the dump missed.
	if len(ws) != 1 || ws[0].InstanceID != 7 || ws[0].Status != "active" || ws[0].Endpoints["0"] != f.Engines()[0].Ranks[0].Events ||
		ws[0].Listeners["0"].ReplayEndpoint != f.Engines()[0].Ranks[0].Replay {
		t.Errorf("workers: %+v", ws)
	}
	// The frontend's own routes are untouched.
	if h := getHealth(t, s); h.Status != "ok" {
		t.Errorf("health: %+v", h)
	}
}

// twoEngineFleet starts two fast engines.
func twoEngineFleet(t *testing.T) *fleet.Fleet {
	return engineFleetWith(t, func(cfg *fleet.Config) { cfg.SpeedupRatio = 100; cfg.NumWorkers = 2 })
}

func specOf(id uint64, e fleet.Engine) WorkerSpec {
	return WorkerSpec{ID: id, Name: e.Name, URL: e.HTTPURL, Events: e.Ranks[0].Events, Replay: e.Ranks[0].Replay, Model: "kvrouter-mock", KVBlocks: 16384, MaxBatchedTokens: 8192}
}

// --use-remote-indexer: the router routes by what the remote indexer
// learnt from the engines (a prompt sent to an engine behind the router's
// back), and when the indexer stops, every request still succeeds, routed
// by the local approximate index, and /health says so.
func TestRemoteIndexerRoutesAndDegradesWhenStopped(t *testing.T) {
	f := twoEngineFleet(t)
	es := f.Engines()
	ix, err := indexer.Start(context.Background(), indexer.Config{Addr: "127.0.0.1:0"})
	if err != nil {
		t.Fatal(err)
	}
	stopped := false
	t.Cleanup(func() {
		if !stopped {
			ix.Close()
		}
	})
	for i, e := range es {
		if code, b := postIndexer(t, ix.URL()+"/register", map[string]any{"instance_id": i + 1, "endpoint": e.Ranks[0].Events, "replay_endpoint": e.Ranks[0].Replay, "model_name": "kvrouter-mock", "block_size": 16}); code != http.StatusCreated {
			t.Fatalf("register: %d %s", code, b)
		}
	}
	cfg := Config{Router: router.DefaultConfig(), Workers: []WorkerSpec{specOf(1, es[0]), specOf(2, es[1])}, HealthInterval: 50 * time.Millisecond, RemoteIndexer: ix.URL()}
	s := startServerWith(t, cfg)

	// Engine 2 serves p directly: only the indexer knows.
	p := prompt(0, 3, 256)
	b, _ := json.Marshal(map[string]any{"model": "kvrouter-mock", "prompt": p, "max_tokens": 1})
	resp, err := http.Post(es[1].HTTPURL+"/v1/completions", "application/json", bytes.NewReader(b))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	testwait.Until(t, 30*time.Second, "the indexer learns engine 2 holds p", func() bool {
		return scoreOf(t, ix.URL(), p, "kvrouter-mock").Scores["2"]["0"] == 256
	})
	tokens := make([]uint32, len(p))
	for i, v := range p {
		tokens[i] = uint32(v)
	}
	d, err := s.Router().BestWorker(context.Background(), &router.Request{Tokens: tokens, Model: "kvrouter-mock"})
	if err != nil || d.Worker.ID != 2 || d.OverlapBlocks != 16 {
		t.Fatalf("decision for p: %+v %v; the remote indexer says engine 2 holds its 16 blocks", d, err)
	}
	for range 3 {
		if got := completeOn(t, s, p, 0); got != 2 {
			t.Fatalf("the router sent p to %d; the remote indexer says engine 2 holds it", got)
		}
	}
	if h := getHealth(t, s); h.Status != "ok" {
		t.Errorf("health with the indexer up: %+v", h)
	}
	answered := s.Router().RemoteStats().Answered

	ix.Close()
	stopped = true
	// Every request still succeeds; q, routed once, sticks to its engine
	// through the approximate index.
	q := prompt(0, 4, 256)
	first := completeOn(t, s, q, 0)
	for range 4 {
		if got := completeOn(t, s, q, 0); got != first {
			t.Errorf("with the indexer down, q went to %d then %d: the approximate index should keep it on one engine", first, got)
		}
	}
	if st := s.Router().RemoteStats(); st.Failed == 0 || st.Answered != answered {
		t.Errorf("remote stats after the stop: %+v (answered %d before)", st, answered)
	}
	h := getHealth(t, s)
	if h.Status != "degraded" || !strings.Contains(strings.Join(h.Reasons, "\n"), "remote_indexer: degraded") {
		t.Errorf("health with the indexer down: %+v", h)
	}
}

// The two flags are exclusive: a router asking a remote primary has none
// of its own to serve.
func TestServeIndexerAndRemoteAreExclusive(t *testing.T) {
	f := engineFleet(t)
	_, err := Start(context.Background(), Config{Router: router.DefaultConfig(), Workers: []WorkerSpec{spec(1, f)}, Addr: "127.0.0.1:0", ServeIndexer: true, RemoteIndexer: "http://127.0.0.1:1"})
	if err == nil || !strings.Contains(err.Error(), "one of the two") {
		t.Fatalf("both flags: %v", err)
	}
	_, err = Start(context.Background(), Config{Router: router.DefaultConfig(), Workers: []WorkerSpec{spec(1, f)}, Addr: "127.0.0.1:0", RemoteIndexer: "indexer:8090"})
	if err == nil || !strings.Contains(err.Error(), "base URL") {
		t.Fatalf("a URL without scheme: %v", err)
	}
}
