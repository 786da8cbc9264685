package frontend

import (
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
	"testing/iotest"
	"time"

	"github.com/kvrouter/kvrouter/core/kv"
	"github.com/kvrouter/kvrouter/core/router"
	"github.com/kvrouter/kvrouter/core/sched"
)

func readAll(t *testing.T, in string, oneByte bool) ([]event, error) {
	t.Helper()
	var r io.Reader = strings.NewReader(in)
	if oneByte {
		r = iotest.OneByteReader(r)
	}
	s := newSSEReader(r)
	var out []event
	for range 1000 {
		ev, err := s.next()
		if err != nil {
			return out, err
		}
		out = append(out, ev)
	}
	t.Fatal("no end")
	return nil, nil
}

func TestSSEReader(t *testing.T) {
	big := strings.Repeat("x", 100<<10)
	in := "\n: keep-alive\n\n" +
		"data: {\"a\":1}\n\n" +
		"event: message\r\nid: 7\r\ndata:{\"b\":\r\ndata: 2}\r\n\r\n" +
		"data: \"" + big + "\"\n\n" +
		"data: [DONE]\n\n"
	for _, oneByte := range []bool{false, true} {
		evs, err := readAll(t, in, oneByte)
		if !errors.Is(err, io.EOF) {
			t.Fatal(err)
		}
		if len(evs) != 5 {
			t.Fatalf("%d events", len(evs))
		}
		if evs[0].hasData || string(evs[0].raw) != ": keep-alive\n\n" {
			t.Fatalf("comment %+v", evs[0])
		}
		if string(evs[1].data) != `{"a":1}` || string(evs[1].raw) != "data: {\"a\":1}\n\n" {
			t.Fatalf("%q", evs[1].raw)
		}
		if string(evs[2].data) != "{\"b\":\n2}" || string(evs[2].raw) != "event: message\r\nid: 7\r\ndata:{\"b\":\r\ndata: 2}\r\n\r\n" {
			t.Fatalf("%q %q", evs[2].data, evs[2].raw)
		}
		if len(evs[3].data) != len(big)+2 {
			t.Fatalf("big event %d bytes", len(evs[3].data))
		}
		if string(evs[4].data) != "[DONE]" {
			t.Fatalf("%q", evs[4].data)
		}
	}
}

func TestSSEReaderErrors(t *testing.T) {
	for in, want := range map[string]error{
		"data: {}\n\ngarbage\n\n":  errMalformed,
		"data: {}\n\ndata: {\"a\"": io.ErrUnexpectedEOF,
		"data: {}\n":               io.EOF,
		"":                         io.EOF,
	} {
		_, err := readAll(t, in, false)
		if !errors.Is(err, want) {
			t.Errorf("%q: %v, want %v", in, err, want)
		}
	}
}

func FuzzSSEReader(f *testing.F) {
	f.Add("data: {}\n\n")
	f.Add(": c\n\nevent: x\ndata: [DONE]\n\n")
	f.Add("data\n\n")
	f.Fuzz(func(t *testing.T, in string) {
		s := newSSEReader(strings.NewReader(in))
		total := 0
		for range len(in) + 2 {
			ev, err := s.next()
			if err != nil {
				return
			}
			total += len(ev.raw)
			if total > len(in) {
				t.Fatalf("events hold more bytes than the input")
			}
		}
		t.Fatal("reader did not end")
	})
}

func TestInjectNvext(t *testing.T) {
	ext := []byte(`{"worker_id":1}`)
	for in, want := range map[string]string{
		`{}`:                        `{"nvext":{"worker_id":1}}`,
		"{\"a\": 1}\n":              "{\"a\": 1,\"nvext\":{\"worker_id\":1}}\n",
		`{"nvext":{"x":2},"a":[1]}`: `{"a":[1],"nvext":{"worker_id":1}}`,
		` { "b" : "}" } `:           ` { "b" : "}" ,"nvext":{"worker_id":1}} `,
	} {
		got, ok := injectNvext([]byte(in), ext)
		if !ok || string(got) != want {
			t.Errorf("%q → %q %v, want %q", in, got, ok, want)
		}
	}
	for _, in := range []string{`[1]`, `"s"`, `null`, `{`} {
		if _, ok := injectNvext([]byte(in), ext); ok {
			t.Errorf("%q accepted", in)
		}
	}
}

func TestParseNvext(t *testing.T) {
	raw := `{"overlap_score_credit": 0.5, "kv_overlap_score_credit": 0.9, "prefill_load_scale": 2,
		"router_temperature": 0.3, "assume_kv_reuse": false, "router_track_prefill_tokens": false,
		"router_config_override": {"overlap_score_weight": 1.5, "router_temperature": 0.7},
		"backend_instance_id": 4, "dp_rank": 1, "agent_hints": {"priority": 3, "osl": 128},
		"session_control": {"session_id": "s", "action": "bind", "timeout": 2.5},
		"extra_fields": ["timing", "unknown"], "greed_sampling": true}`
	var req router.Request
	_, ex, herr := parseNvext([]byte(raw), http.Header{}, &req)
	if herr != nil {
		t.Fatal(herr)
	}
	o := req.Overrides
	if *o.OverlapCredit != 0.5 || *o.PrefillLoadScale != 2 || *o.LegacyOverlapWeight != 1.5 || *o.Temperature != 0.7 ||
		*o.AssumeKVReuse || *o.TrackPrefillTokens {
		t.Fatalf("overrides %+v", o)
	}
	if *req.Target != (kv.Worker{ID: 4, DPRank: 1}) || req.Priority != 3 || req.OSL != 128 {
		t.Fatalf("%+v", req)
	}
	if s := req.Session; s.ID != "s" || s.Action != sched.SessionBind || s.Timeout != 2500*time.Millisecond {
		t.Fatalf("%+v", s)
	}
	if ex.workerID || !ex.timing {
		t.Fatalf("%+v", ex)
	}
	// The header names the worker over the body.
	req = router.Request{}
	if _, _, herr := parseNvext([]byte(`{"backend_instance_id": 4}`), http.Header{"X-Worker-Instance-Id": {"9"}}, &req); herr != nil || req.Target.ID != 9 {
		t.Fatalf("%v %+v", herr, req.Target)
	}
	for _, bad := range []string{`[]`, `{"agent_hints": {"osl": -1}}`, `{"session_control": {"action": "open"}}`, `{"session_control": {"session_id": "s", "timeout": -1}}`} {
		if _, _, herr := parseNvext([]byte(bad), http.Header{}, &router.Request{}); herr == nil || herr.status != 400 {
			t.Errorf("%s accepted", bad)
		}
	}
}
