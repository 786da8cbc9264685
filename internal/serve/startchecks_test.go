package serve

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/internal/testwait"
)

func TestStartRefusesNoEnginesAndDuplicates(t *testing.T) {
	a := WorkerSpec{ID: 1, Name: "a", URL: "http://127.0.0.1:1", Events: "tcp://127.0.0.1:5557"}
	b := WorkerSpec{ID: 2, Name: "b", URL: "http://127.0.0.1:2", Events: "tcp://127.0.0.1:5558"}
	for _, tc := range []struct {
		name    string
		workers []WorkerSpec
		want    string
	}{
		{"no engines", nil, "--worker url="},
		{"same id", []WorkerSpec{a, func() WorkerSpec { w := b; w.ID = 1; return w }()}, `workers "a" (http://127.0.0.1:1) and "b" (http://127.0.0.1:2) both have id 1`},
		{"same url", []WorkerSpec{a, func() WorkerSpec { w := b; w.URL = a.URL + "/"; return w }()}, `workers "a" and "b" have the same url`},
		{"same events", []WorkerSpec{a, func() WorkerSpec { w := b; w.Events = a.Events; return w }()}, `workers "a" and "b" have the same KV-event endpoint`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := Start(context.Background(), Config{Router: router.DefaultConfig(), Workers: tc.workers, Addr: "127.0.0.1:0"})
			if err == nil {
				s.Close()
				t.Fatalf("started; want an error saying %q", tc.want)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q does not say %q", err, tc.want)
			}
		})
	}
}

func TestModelsDifferingOnlyInSpellingAreWarnedAbout(t *testing.T) {
	var logs testwait.Buffer
	workers := []WorkerSpec{
		{ID: 1, Name: "a", URL: "http://127.0.0.1:1", Model: "meta-llama/Llama-3-8B"},
		{ID: 2, Name: "b", URL: "http://127.0.0.1:2", Model: "meta-llama/Llama-3-8B"},
		{ID: 3, Name: "c", URL: "http://127.0.0.1:3", Model: "llama_3_8b"},
		{ID: 4, Name: "d", URL: "http://127.0.0.1:4", Model: "mistral-7b"},
		{ID: 5, Name: "e", URL: "http://127.0.0.1:5", Model: "mistral-7b-instruct"},
	}
	s, err := Start(context.Background(), Config{Router: router.DefaultConfig(), Workers: workers, Addr: "127.0.0.1:0", HealthInterval: time.Hour,
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	s.Close()
	log := logs.String()
	if want := `models \"llama_3_8b\" and \"meta-llama/Llama-3-8B\" differ only in spelling`; strings.Count(log, want) != 1 {
		t.Fatalf("want one warning %s; log:\n%s", want, log)
	}
	if strings.Count(log, "differ only in spelling") != 1 {
		t.Fatalf("distinct models warned about; log:\n%s", log)
	}
}

func TestServeWithNoEngineAnywhereSaysHowToGiveThem(t *testing.T) {
	srv := natsServer(t, t.TempDir(), 0)
	defer srv.Shutdown()
	var logs testwait.Buffer
	s, err := Start(context.Background(), Config{
		Router: router.DefaultConfig(), Addr: "127.0.0.1:0", Logger: slog.New(slog.NewTextHandler(&logs, nil)),
		Plane: &Plane{Conn: natsConn(t, srv.URL()), RouterID: "r1", LeaseTTL: testLease},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	for _, want := range []string{"no engines yet", "kvrouter agent --nats-url", "--worker"} {
		if !strings.Contains(logs.String(), want) {
			t.Fatalf("log lacks %q:\n%s", want, logs.String())
		}
	}
}
