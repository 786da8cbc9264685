package jsonerr

import (
	"encoding/json"
	"testing"
)

type common struct {
	MaxTokens *int `json:"max_tokens"`
}

type request struct {
	common
	Hints *struct {
		OSL *int `json:"osl"`
	} `json:"agent_hints"`
	Tokens   []uint32 `json:"token_data"`
	Stream   bool     `json:"stream"`
	Messages []struct {
		Role string `json:"role"`
	} `json:"messages"`
}

func TestDescribe(t *testing.T) {
	for _, tc := range []struct{ in, prefix, want string }{
		{`{"max_tokens": "x"}`, "", "max_tokens must be an integer, got a string"},
		{`{"max_tokens": 1.5}`, "", "max_tokens must be an integer, got number 1.5"},
		{`{"agent_hints": {"osl": true}}`, "nvext", "nvext.agent_hints.osl must be an integer, got true or false"},
		{`{"token_data": [1, -2]}`, "nvext", "nvext.token_data must be a list of non-negative integers, got number -2"},
		{`{"token_data": 5}`, "", "token_data must be a list, got a number"},
		{`{"stream": "yes"}`, "", "stream must be true or false, got a string"},
		{`{"messages": {}}`, "", "messages must be a list, got an object"},
		{`{"messages": [{"role": 1}]}`, "", "messages.role must be a string, got a number"},
		{`[1]`, "nvext", "nvext must be an object, got a list"},
		{`{"a":`, "", "the body is not valid JSON (it ends early)"},
		{`{"a" 1}`, "", "the body is not valid JSON (near byte 6)"},
	} {
		var r request
		err := json.Unmarshal([]byte(tc.in), &r)
		if got := Describe(err, &r, tc.prefix); got != tc.want {
			t.Errorf("%s: %q, want %q (from %v)", tc.in, got, tc.want, err)
		}
	}
	if got := Describe(nil, &request{}, ""); got != "" {
		t.Errorf("nil error: %q", got)
	}
}
