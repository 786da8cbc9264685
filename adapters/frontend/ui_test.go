package frontend

import (
	"encoding/json"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/router"
)

func getState(t *testing.T, e *env, since uint64) uiState {
	t.Helper()
	resp, body := e.get("/ui/api/state?since=" + itoa(since))
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("state: %d %s", resp.StatusCode, body)
	}
	var st uiState
	if err := json.Unmarshal(body, &st); err != nil {
		t.Fatalf("state is not JSON: %v: %s", err, body)
	}
	return st
}

func itoa(v uint64) string { b, _ := json.Marshal(v); return string(b) }

func TestUIPageIsSelfContained(t *testing.T) {
	e := newEnv(t, envOpts{})
	resp, body := e.get("/ui")
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/html") {
		t.Fatalf("/ui: %d %q", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	if !strings.Contains(resp.Header.Get("Content-Security-Policy"), "default-src 'none'") {
		t.Fatal("the page must not be allowed to load anything from elsewhere")
	}
	for _, ext := range []string{"http://", "https://", "src=\"//"} {
		if strings.Contains(string(body), ext) {
			t.Fatalf("the page refers to an external resource (%q)", ext)
		}
	}
	if len(body) > 32<<10 {
		t.Fatalf("the page is %d bytes; keep it light", len(body))
	}
}

// A page's first poll, on a router that has decided nothing and with no
// page open before, gets empty lists, not nulls: a browser page iterating
// a null throws before it shows anything.
func TestUIFirstPollHasNoNullLists(t *testing.T) {
	e := newEnv(t, envOpts{})
	resp, body := e.get("/ui/api/state")
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("state: %d %s", resp.StatusCode, body)
	}
	var raw map[string]json.RawMessage
	if err := json.Unmarshal(body, &raw); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"engines", "decisions", "series", "thresholds"} {
		if v := strings.TrimSpace(string(raw[k])); !strings.HasPrefix(v, "[") {
			t.Errorf("%s is %s, want a list", k, v)
		}
	}
}

func TestUIStateRecordsDecisionsOnlyWhileWatched(t *testing.T) {
	e := newEnv(t, envOpts{engines: 2})
	complete := func(salt int) {
		t.Helper()
		resp, body := e.post("/v1/completions", map[string]any{"model": mockModel, "prompt": tokens(64, salt), "max_tokens": 2})
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("completion: %d %s", resp.StatusCode, body)
		}
	}
	complete(1) // nobody watches: not recorded
	st := getState(t, e, 0)
	if len(st.Decisions) != 0 || st.Next != 0 {
		t.Fatalf("decisions recorded with no page open: %+v", st.Decisions)
	}
	if len(st.Engines) != 2 || st.Engines[0].WorkerID != 10 || st.Engines[0].State != "up" || len(st.Engines[0].Ranks) != 1 {
		t.Fatalf("engines %+v", st.Engines)
	}
	if st.Totals.Decisions != 1 {
		t.Fatalf("totals %+v", st.Totals)
	}
	complete(2)
	complete(2) // the same prompt again: cached
	st = getState(t, e, 0)
	if len(st.Decisions) != 2 || st.Next != 2 {
		t.Fatalf("want the 2 decisions made while watched, got %d (next %d)", len(st.Decisions), st.Next)
	}
	d := st.Decisions[1]
	if d.PromptBlocks != 4 || d.OverlapBlocks != 4 || len(d.Candidates) != 2 || d.Candidates[0].WorkerID != d.WorkerID || d.RequestID == "" {
		t.Fatalf("second decision %+v: want 4 of 4 blocks cached on the cheapest candidate", d)
	}
	if c := d.Candidates[0]; c.CacheCredit <= 0 || c.Cost != round2(c.Prefill-c.CacheCredit+c.Decode) {
		t.Fatalf("cost terms do not add up: %+v", c)
	}
	if again := getState(t, e, st.Next); len(again.Decisions) != 0 {
		t.Fatalf("since=next must return only newer decisions, got %d", len(again.Decisions))
	}
	resp, body := e.get("/ui/api/state?since=x")
	if openAIError(t, resp, body, http.StatusBadRequest) != "invalid_since" {
		t.Fatal("a bad since must be a 400")
	}
	e.settle()
}

func TestUIDecisionRateIsBounded(t *testing.T) {
	e := newEnv(t, envOpts{engines: 1, frontend: func(c *Config) { c.UIDecisionsPerSecond = 3 }})
	e.fe.ui.touch(time.Now())
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, _ := e.post("/router/best_worker", map[string]any{"model": mockModel, "tokens": tokens(32, i)})
			if resp.StatusCode != http.StatusOK {
				t.Errorf("best_worker: %d", resp.StatusCode)
			}
		}()
	}
	wg.Wait()
	// The 8 may straddle a second boundary: at most two seconds' budget.
	if _, n := e.fe.ui.decisionsSince(0); n < 3 || n > 6 {
		t.Fatalf("%d decisions recorded of 8, at 3 a second", n)
	}
}

func TestUIFeedStopsWhenNoPageWatches(t *testing.T) {
	e := newEnv(t, envOpts{})
	u := e.fe.ui
	u.touch(time.Now())
	if !u.watched() {
		t.Fatal("a poll must start the feed")
	}
	u.watchMu.Lock()
	u.lastPoll = time.Now().Add(-2 * uiWatchWindow)
	u.watchMu.Unlock()
	u.idle()
	if u.watched() {
		t.Fatal("the feed goes on with no poll for a whole window")
	}
	u.touch(time.Now())
	u.idle() // fired just as a poll came in
	if !u.watched() {
		t.Fatal("a fresh poll must keep the feed")
	}
}

func TestDrainEndpoint(t *testing.T) {
	var mu sync.Mutex
	drained := map[uint64]bool{}
	e := newEnv(t, envOpts{adminToken: "adm", frontend: func(c *Config) {
		c.SetDrained = func(id uint64, d bool) error {
			if id != 7 {
				return ErrUnknownEngine
			}
			mu.Lock()
			drained[id] = d
			mu.Unlock()
			return nil
		}
	}})
	resp, body := e.do("POST", "/router/drain", "", map[string]any{"worker_id": 7, "drained": true})
	if openAIError(t, resp, body, http.StatusUnauthorized) != "invalid_admin_token" {
		t.Fatal("drain without the admin token")
	}
	resp, body = e.do("POST", "/router/drain", "adm", map[string]any{"worker_id": 7, "drained": true})
	if resp.StatusCode != http.StatusOK || !drained[7] {
		t.Fatalf("drain: %d %s", resp.StatusCode, body)
	}
	for _, c := range []struct {
		body any
		code string
		st   int
	}{
		{`{"worker_id": 7`, "invalid_json", 400},
		{`[1]`, "invalid_json", 400},
		{map[string]any{"worker_id": "seven", "drained": true}, "invalid_drain", 400},
		{map[string]any{"worker_id": -1, "drained": true}, "invalid_drain", 400},
		{map[string]any{"drained": true}, "missing_worker_id", 400},
		{map[string]any{"worker_id": 7}, "missing_drained", 400},
		{map[string]any{"worker_id": 8, "drained": false}, "unknown_worker", 404},
	} {
		resp, body := e.do("POST", "/router/drain", "adm", c.body)
		if got := openAIError(t, resp, body, c.st); got != c.code {
			t.Fatalf("%v: code %q, want %q", c.body, got, c.code)
		}
	}

	plain := newEnv(t, envOpts{})
	resp, body = plain.post("/router/drain", map[string]any{"worker_id": 1, "drained": true})
	if openAIError(t, resp, body, http.StatusNotImplemented) != "not_supported" {
		t.Fatal("drain without a registry must say so")
	}
}

// The dashboard answers under overload: that is when it is looked at.
func TestUIIsNotRefusedForOverload(t *testing.T) {
	for _, p := range []string{"/ui", "/ui/api/state"} {
		if !probePath(p) {
			t.Errorf("%s would be refused when the router serves its maximum of requests", p)
		}
	}
}

func TestUIWarnsOfAMismatchedBlockSize(t *testing.T) {
	e := newEnv(t, envOpts{})
	e.mu.Lock()
	e.workers = append(e.workers, Worker{ID: 5, Name: "odd", BaseURL: "http://127.0.0.1:1", Model: mockModel, DPSize: 2})
	e.mu.Unlock()
	e.router.AddWorker(router.WorkerInfo{ID: 5, Model: mockModel, DPSize: 2, TotalKVBlocks: 100, BlockSize: 2 * e.router.BlockSize()})
	st := getState(t, e, 0)
	if len(st.Engines) != 1 || len(st.Engines[0].Ranks) != 2 || st.Engines[0].BlockSize != 2*e.router.BlockSize() {
		t.Fatalf("engines %+v", st.Engines)
	}
	if w := st.Engines[0].Warnings; len(w) != 1 || !strings.Contains(w[0], "block size mismatch") {
		t.Fatalf("warnings %q, want the block size mismatch", w)
	}
	if r := st.Engines[0].Ranks[1]; r.DPRank != 1 || r.CapacityBlocks != 100 || r.KVEvents == "unknown" {
		t.Fatalf("rank 1: %+v", r)
	}
}
