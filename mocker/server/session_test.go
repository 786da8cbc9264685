package server

import (
	"encoding/json"
	"testing"
	"time"
)

func TestSessionAPIAnswersAsSGLang(t *testing.T) {
	srv, _ := start(t, 1024, 1000)
	url := srv.URL
	for _, tc := range []struct {
		name   string
		path   string
		body   map[string]any
		status int
		want   string // the id answered, for a 200 open
	}{
		{"capacity is required", "/open_session", map[string]any{"session_id": "a"}, 400, ""},
		{"open with an id", "/open_session", map[string]any{"capacity_of_str_len": 65536, "session_id": "a", "timeout": 30}, 200, "a"},
		{"the same id again", "/open_session", map[string]any{"capacity_of_str_len": 65536, "session_id": "a"}, 400, ""},
		{"close needs an id", "/close_session", map[string]any{}, 400, ""},
		{"close", "/close_session", map[string]any{"session_id": "a"}, 200, ""},
		{"close an id not open", "/close_session", map[string]any{"session_id": "zzz"}, 200, ""},
		{"reopen after close", "/open_session", map[string]any{"capacity_of_str_len": 1, "session_id": "a"}, 200, "a"},
		{"a negative timeout", "/open_session", map[string]any{"capacity_of_str_len": 1, "session_id": "b", "timeout": -1}, 400, ""},
	} {
		resp, b := post(t, url+tc.path, tc.body)
		if resp.StatusCode != tc.status {
			t.Fatalf("%s: %d %s, want %d", tc.name, resp.StatusCode, b, tc.status)
		}
		switch {
		case tc.status == 400:
			var e struct {
				Error struct {
					Message string `json:"message"`
				} `json:"error"`
			}
			if json.Unmarshal(b, &e) != nil || e.Error.Message == "" {
				t.Fatalf("%s: error body %s is not SGLang's", tc.name, b)
			}
		case tc.want != "":
			var id string
			if err := json.Unmarshal(b, &id); err != nil || id != tc.want {
				t.Fatalf("%s: answered %s, want the id %q as a JSON string", tc.name, b, tc.want)
			}
		}
	}
	resp, b := post(t, url+"/open_session", map[string]any{"capacity_of_str_len": 1})
	var id string
	if resp.StatusCode != 200 || json.Unmarshal(b, &id) != nil || id == "" || id == "a" {
		t.Fatalf("open without an id: %d %s, want a fresh id", resp.StatusCode, b)
	}
}

func TestEngineSessionsEndAtTheirTimeout(t *testing.T) {
	now := time.Unix(1000, 0)
	ss := sessions{now: func() time.Time { return now }}
	if _, ok := ss.add("s", 10*time.Second); !ok {
		t.Fatal("first open refused")
	}
	if _, ok := ss.add("forever", 0); !ok {
		t.Fatal("open without timeout refused")
	}
	now = now.Add(9 * time.Second)
	if _, ok := ss.add("s", 0); ok {
		t.Fatal("a live session was opened twice")
	}
	now = now.Add(time.Second)
	if n := ss.count(); n != 1 {
		t.Fatalf("%d sessions open after the timeout, want 1 (the one without timeout)", n)
	}
	if _, ok := ss.add("s", 0); !ok {
		t.Fatal("an expired session's id could not be opened again")
	}
}
