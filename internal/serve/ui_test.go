package serve

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/router"
)

func postJSON(t *testing.T, url, token, body string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

func TestDrainHoldsAnEngineOutUntilReadmitted(t *testing.T) {
	a, b := engineFleet(t), engineFleet(t)
	cfg := Config{Router: router.DefaultConfig(), Workers: []WorkerSpec{spec(1, a), spec(2, b)}, HealthInterval: 20 * time.Millisecond}
	cfg.Access.AdminToken = "adm"
	s := startServerWith(t, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	if code, body := postJSON(t, s.URL()+"/router/drain", "adm", `{"worker_id": 2, "drained": true}`); code != http.StatusOK {
		t.Fatalf("drain: %d %s", code, body)
	}
	if err := s.WaitWorkers(ctx, func(live int) bool { return live == 1 }); err != nil {
		t.Fatal(err)
	}
	// Several probe intervals: a healthy drained engine must stay out.
	deadline := time.Now().Add(10 * cfg.HealthInterval)
	for time.Now().Before(deadline) {
		for _, in := range s.Router().Workers() {
			if in.ID == 2 {
				t.Fatal("the drained engine came back into routing")
			}
		}
		time.Sleep(cfg.HealthInterval / 2)
	}
	states := map[uint64]string{}
	for _, e := range s.engineStatuses() {
		states[e.ID] = e.State
	}
	if states[1] != "up" || states[2] != "drained" {
		t.Fatalf("states %v", states)
	}
	if code, _ := postJSON(t, s.URL()+"/router/drain", "adm", `{"worker_id": 9, "drained": true}`); code != http.StatusNotFound {
		t.Fatalf("draining an unknown engine: %d, want 404", code)
	}
	if code, body := postJSON(t, s.URL()+"/router/drain", "adm", `{"worker_id": 2, "drained": false}`); code != http.StatusOK {
		t.Fatalf("re-admit: %d %s", code, body)
	}
	if err := s.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}

	resp, err := http.Get(s.URL() + "/ui/api/state")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var st struct {
		AdminRequired bool `json:"admin_required"`
		Controls      bool `json:"controls"`
		Engines       []struct {
			WorkerID uint64 `json:"worker_id"`
			State    string `json:"state"`
			Ranks    []struct {
				CapacityBlocks int `json:"capacity_blocks"`
			} `json:"ranks"`
		} `json:"engines"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
		t.Fatal(err)
	}
	if !st.AdminRequired || !st.Controls || len(st.Engines) != 2 || st.Engines[1].State != "up" || st.Engines[1].Ranks[0].CapacityBlocks != 16384 {
		t.Fatalf("state %+v", st)
	}
}
