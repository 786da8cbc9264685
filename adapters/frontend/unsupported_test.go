package frontend

import (
	"encoding/json"
	"maps"
	"net/http"
	"reflect"
	"strings"
	"testing"
)

// KV event fields the router does not honour show per engine in /health
// (with a note, status still ok) and on the dashboard's engine card, for
// engines in routing and out of it.
func TestUnsupportedFieldsShowInHealthAndDashboard(t *testing.T) {
	counts := map[string]uint64{"medium=unknown": 2, "group_idx": 5}
	var e *env
	e = newEnv(t, envOpts{frontend: func(c *Config) {
		c.Engines = func() []EngineStatus {
			out := []EngineStatus{{ID: 12, Name: "gone", State: "down", Why: "unreachable", Unsupported: map[string]uint64{"session_id": 1}}}
			for _, w := range e.list() {
				st := EngineStatus{ID: w.ID, Name: w.Name, Model: w.Model, State: "up"}
				if w.ID == 5 {
					st.Unsupported = maps.Clone(counts)
				}
				out = append(out, st)
			}
			return out
		}
	}})
	e.fake(5, mockModel, 1, func(http.ResponseWriter, *http.Request) {})
	e.fake(6, mockModel, 1, func(http.ResponseWriter, *http.Request) {})

	resp, body := e.get("/health")
	var h struct {
		Status  string         `json:"status"`
		Workers []healthWorker `json:"workers"`
		Notes   []string       `json:"notes"`
		Reasons []string       `json:"reasons"`
	}
	if err := json.Unmarshal(body, &h); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	by := map[uint64]healthWorker{}
	for _, w := range h.Workers {
		by[w.ID] = w
	}
	if !maps.Equal(by[5].Unsupported, counts) || by[6].Unsupported != nil || by[12].Unsupported["session_id"] != 1 {
		t.Fatalf("workers %+v", h.Workers)
	}
	want := "engine fake-" + mockModel + " (5): KV event fields the router does not honour, routing without them: group_idx (5), medium=unknown (2)"
	if len(h.Notes) != 2 || h.Notes[0] != want || !strings.Contains(h.Notes[1], "gone (12)") {
		t.Fatalf("notes %q, want %q first", h.Notes, want)
	}
	// Only the engine that is down degrades it, not the fields.
	for _, r := range h.Reasons {
		if strings.Contains(r, "honour") {
			t.Fatalf("reasons %q", h.Reasons)
		}
	}

	st := getState(t, e, 0)
	cards := map[uint64]uiEngine{}
	for _, c := range st.Engines {
		cards[c.WorkerID] = c
	}
	if got, want := cards[5].Unsupported, []uiUnsupported{{"group_idx", 5}, {"medium=unknown", 2}}; !reflect.DeepEqual(got, want) {
		t.Fatalf("card 5: %+v, want %+v", got, want)
	}
	if got := cards[6].Unsupported; got == nil || len(got) != 0 {
		t.Fatalf("card 6: %#v, want []", got)
	}
}

func TestHealthWithoutUnsupportedFieldsHasNoNotes(t *testing.T) {
	e := newEnv(t, envOpts{})
	e.fake(5, mockModel, 1, func(http.ResponseWriter, *http.Request) {})
	if _, body := e.get("/health"); strings.Contains(string(body), "notes") || strings.Contains(string(body), "kv_events_unsupported") {
		t.Fatalf("%s", body)
	}
}
