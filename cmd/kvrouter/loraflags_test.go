package main

import (
	"encoding/json"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/testwait"
)

func TestLoRAFlags(t *testing.T) {
	for _, tc := range []struct {
		name    string
		f       loraFlags
		err     string
		modules int
		poll    time.Duration
	}{
		{"defaults", loraFlags{poll: 5 * time.Second}, "", 0, 5 * time.Second},
		{"poll off", loraFlags{poll: 0}, "", 0, -1},
		{"negative poll", loraFlags{poll: -time.Second}, "--lora-poll-interval", 0, 0},
		{"both forms", loraFlags{dynamic: true, poll: time.Second, modules: []string{"a=/x", `{"name": "b", "path": "/y", "base_model_name": "m"}`}}, "", 2, time.Second},
		{"dynamic without modules", loraFlags{dynamic: true, poll: time.Second}, "give at least one", 0, 0},
		{"no path", loraFlags{modules: []string{"a"}}, "want name=path", 0, 0},
		{"JSON without path", loraFlags{modules: []string{`{"name": "b"}`}}, "with name and path", 0, 0},
		{"twice", loraFlags{modules: []string{"a=/x", "a=/y"}}, "twice", 0, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, poll, err := tc.f.config()
			switch {
			case tc.err != "":
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err %v, want one saying %q", err, tc.err)
				}
				return
			case err != nil:
				t.Fatal(err)
			}
			if len(l.Modules) != tc.modules || poll != tc.poll || l.DynamicLoading != tc.f.dynamic {
				t.Fatalf("config %+v, poll %v", l, poll)
			}
			if m, ok := l.Modules["b"]; ok && (m.Path != "/y" || m.Base != "m") {
				t.Fatalf("the JSON form read as %+v", m)
			}
		})
	}
}

// up --lora-dynamic-loading places an adapter on first use and serves it.
func TestUpLoadsAnAdapterOnFirstUse(t *testing.T) {
	t.Setenv("NATS_SERVER", "")
	out, _ := startCmd(t, "up", "--http-port", "0", "--workers", "3", "--speedup-ratio", "50",
		"--lora-dynamic-loading", "--lora-modules", "sql-lora=/adapters/sql")
	serving := regexp.MustCompile(`requests to (http://\S+) `)
	testwait.Until(t, 20*time.Second, "up to serve", func() bool { return serving.MatchString(out.String()) })
	url := serving.FindStringSubmatch(out.String())[1]
	var first uint64
	for i := range 4 {
		body, _ := json.Marshal(map[string]any{"model": "sql-lora", "prompt": "SELECT a prompt for the adapter " + strings.Repeat("x ", i), "max_tokens": 2,
			"nvext": map[string]any{"extra_fields": []string{"worker_id"}}})
		resp, err := http.Post(url+"/v1/completions", "application/json", strings.NewReader(string(body)))
		if err != nil {
			t.Fatal(err)
		}
		var ans struct {
			Model string `json:"model"`
			NVExt struct {
				WorkerID uint64 `json:"worker_id"`
			} `json:"nvext"`
		}
		err = json.NewDecoder(resp.Body).Decode(&ans)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || err != nil || ans.Model != "sql-lora" {
			t.Fatalf("request %d: %d %v %+v", i, resp.StatusCode, err, ans)
		}
		if i == 0 {
			first = ans.NVExt.WorkerID
		} else if ans.NVExt.WorkerID != first {
			t.Fatalf("request %d went to engine %d; the adapter was loaded on %d", i, ans.NVExt.WorkerID, first)
		}
	}
}
