package frontend

import (
	"encoding/json"
	"io"
	"net/http"
	"testing"

	"github.com/kvrouter/kvrouter/core/router"
)

// FuzzParseNvext: no nvext makes parsing panic, and a refused one is a 400
// in OpenAI's shape with a message.
func FuzzParseNvext(f *testing.F) {
	f.Add(`{"backend_instance_id": 3, "dp_rank": 1, "extra_fields": ["worker_id", "timing"]}`)
	f.Add(`{"agent_hints": {"priority": 2, "osl": 100}, "session_control": {"session_id": "s", "action": "open", "timeout": 60}}`)
	f.Add(`{"router_config_override": {"router_temperature": 0.5, "overlap_score_credit": 1}, "token_data": [1, 2, 3]}`)
	f.Add(`{"session_control": {"timeout": 1e308}}`)
	f.Fuzz(func(t *testing.T, raw string) {
		var req router.Request
		_, _, _, herr := parseNvext(nvextInput{nvext: json.RawMessage(raw), override: json.RawMessage(raw), header: http.Header{}, strict: len(raw)%2 == 0}, &req)
		if herr != nil && (herr.status != http.StatusBadRequest || herr.Message == "" || herr.Code == "") {
			t.Fatalf("%q: %d %+v", raw, herr.status, herr.apiError)
		}
	})
}

// FuzzRequestBody runs a body through what the frontend does with it
// before any engine is involved: cut into members, prompt checked and read,
// nvext parsed, the body for the engine spliced. Nothing panics; a body the
// frontend accepts and splices is valid JSON when the client's was.
func FuzzRequestBody(f *testing.F) {
	f.Add(`{"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "nvext": {"extra_fields": ["worker_id"]}}`)
	f.Add(`{"model": "m", "prompt": "hello", "data_parallel_rank": 0}`)
	f.Add(`{"model": "m", "prompt": [[5, 6], [7]], "stream": true}`)
	f.Add(`{"model": "m", "messages": [{"role": "user", "content": "hi"}], "nvext": {"session_control": {"session_id": "a", "action": "bind"}}}`)
	f.Add(`{"model": "m", "prompt": ["a\"b", "c"]}`)
	f.Fuzz(func(t *testing.T, body string) {
		ms, err := objectMembers([]byte(body))
		if err != nil {
			return
		}
		top := make(map[string]json.RawMessage, len(ms))
		for _, m := range ms {
			top[m.key] = m.val
		}
		for _, kind := range []promptKind{kindCompletion, kindChat, kindAny} {
			if herr := checkPrompt(top, kind); herr != nil && herr.Code == "" {
				t.Fatalf("%q: error without a code", body)
			}
		}
		if present(top["prompt"]) {
			ids, text, herr := completionPrompt(top["prompt"])
			if herr == nil && ids == nil && text == nil {
				t.Fatalf("%q: prompt accepted as nothing", body)
			}
			if text != nil && !json.Valid(text) {
				t.Fatalf("%q: prompt text %q is not a JSON string", body, text)
			}
		}
		var req router.Request
		if _, _, _, herr := parseNvext(requestNvext(top, http.Header{}, false), &req); herr != nil && herr.status != http.StatusBadRequest {
			t.Fatalf("%q: nvext answered %d", body, herr.status)
		}
		out, err := io.ReadAll(without([]byte(body), ms, []string{"nvext", "data_parallel_rank"}, []byte("data_parallel_rank"), []byte("1")).reader())
		if err != nil {
			t.Fatal(err)
		}
		if json.Valid([]byte(body)) && !json.Valid(out) {
			t.Fatalf("%q spliced into invalid JSON %q", body, out)
		}
	})
}
