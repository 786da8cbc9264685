package frontend

import (
	"bytes"
	"encoding/json"
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
		// The reader's buffers are reused: what is kept is copied.
		out = append(out, event{raw: bytes.Clone(ev.raw), data: bytes.Clone(ev.data), hasData: ev.hasData})
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
		"router_cache_affinity": 3, "router_temperature": 0.3, "assume_kv_reuse": false, "router_track_prefill_tokens": false,
		"router_config_override": {"overlap_score_weight": 1.5, "router_temperature": 0.7, "shared_cache_multiplier": 0.2},
		"backend_instance_id": 4, "dp_rank": 1, "agent_hints": {"priority": 3, "osl": 128},
		"session_control": {"session_id": "s", "action": "bind", "timeout": 2.5},
		"extra_fields": ["timing", "unknown"], "greed_sampling": true}`
	var req router.Request
	_, ex, _, herr := parseNvext(nvextInput{nvext: []byte(raw)}, &req)
	if herr != nil {
		t.Fatal(herr)
	}
	o := req.Overrides
	if *o.OverlapCredit != 0.5 || *o.PrefillLoadScale != 2 || *o.CacheAffinity != 3 || *o.LegacyOverlapWeight != 1.5 || *o.Temperature != 0.7 ||
		*o.AssumeKVReuse || *o.TrackPrefillTokens || *o.SharedMultiplier != 0.2 {
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
	if _, _, _, herr := parseNvext(nvextInput{nvext: []byte(`{"backend_instance_id": 4}`), header: http.Header{"X-Worker-Instance-Id": {"9"}}}, &req); herr != nil || req.Target.ID != 9 {
		t.Fatalf("%v %+v", herr, req.Target)
	}
	for _, bad := range []string{`[]`, `{"agent_hints": {"osl": -1}}`, `{"session_control": {"action": "open"}}`, `{"session_control": {"session_id": "s", "timeout": -1}}`} {
		if _, _, _, herr := parseNvext(nvextInput{nvext: []byte(bad), header: http.Header{}}, &router.Request{}); herr == nil || herr.status != 400 {
			t.Errorf("%s accepted", bad)
		}
	}
}

func TestFastTokenIDsAgreesWithEncodingJSON(t *testing.T) {
	for _, in := range []string{
		`[1,2,3]`, ` [ 0 , 4294967295 ]  `, `[]`, `[ ]`, `[1,]`, `[01]`, `[-1]`, `[1e3]`, `[4294967296]`,
		`[1 2]`, `[1,2`, `1`, `["1"]`, `[1.0]`, `[1]x`, "[\n7,\t8\r]",
	} {
		fast, ok := fastTokenIDs([]byte(in))
		var ref []int64
		refErr := json.Unmarshal([]byte(in), &ref)
		if !ok {
			continue // left to the slow path, which decides
		}
		if refErr != nil || len(ref) != len(fast) {
			t.Fatalf("%q: fast path accepted %v, encoding/json says %v %v", in, fast, ref, refErr)
		}
		for i := range ref {
			if int64(fast[i]) != ref[i] {
				t.Fatalf("%q: %v vs %v", in, fast, ref)
			}
		}
	}
}

func FuzzFastTokenIDs(f *testing.F) {
	f.Add("[1,2,3]")
	f.Fuzz(func(t *testing.T, in string) {
		fast, ok := fastTokenIDs([]byte(in))
		if !ok {
			return
		}
		var ref []int64
		if err := json.Unmarshal([]byte(in), &ref); err != nil || len(ref) != len(fast) {
			t.Fatalf("%q: fast %v, encoding/json %v %v", in, fast, ref, err)
		}
		for i := range ref {
			if int64(fast[i]) != ref[i] {
				t.Fatalf("%q: %v vs %v", in, fast, ref)
			}
		}
	})
}

func TestSplitObjectAgreesWithEncodingJSON(t *testing.T) {
	valid := []string{`{}`, ` { "a" : 1 , "b":[1,2,{"c":"]"}], "d\"e": "x\"y\\", "n": null, "t": true, "f": -1.5e3 } `,
		`{"prompt": [1,2,3], "nvext": {"extra_fields": ["worker_id"]}}`}
	for _, in := range valid {
		got, err := splitObject([]byte(in))
		var ref map[string]json.RawMessage
		if err != nil || json.Unmarshal([]byte(in), &ref) != nil || len(got) != len(ref) {
			t.Fatalf("%q: %v %v / %v", in, got, err, ref)
		}
		for k, v := range ref {
			if string(got[k]) != string(v) {
				t.Fatalf("%q: member %q = %s, want %s", in, k, got[k], v)
			}
		}
	}
	for _, in := range []string{``, `[]`, `{`, `{"a"}`, `{"a":}`, `{"a":1,}`, `{"a":1}x`, `{"a":tru}`, `{"a":[1,2}`, `{"a":"x}`, `{a:1}`, `{"a":{"b":}}`} {
		if got, err := splitObject([]byte(in)); err == nil {
			t.Fatalf("%q accepted as %v", in, got)
		}
	}
}

func FuzzSplitObject(f *testing.F) {
	f.Add(`{"a": [1, {"b": "c"}], "d": null}`)
	f.Fuzz(func(t *testing.T, in string) {
		got, err := splitObject([]byte(in))
		var ref map[string]json.RawMessage
		if json.Unmarshal([]byte(in), &ref) == nil && ref != nil {
			if err != nil {
				t.Fatalf("%q: valid object refused: %v", in, err)
			}
			for k, v := range ref {
				if string(got[k]) != string(v) && len(ref) == len(got) {
					t.Fatalf("%q: member %q = %s, want %s", in, k, got[k], v)
				}
			}
		}
	})
}
