package frontend

import (
	"encoding/json"
	"math"
	"slices"
	"strings"
	"testing"
)

// referenceTokenList is what encoding/json makes of a /tokenize answer.
func referenceTokenList(in string) ([]uint32, bool) {
	var ref struct {
		Tokens *[]int64 `json:"tokens"`
	}
	if json.Unmarshal([]byte(in), &ref) != nil || ref.Tokens == nil {
		return nil, false
	}
	out := make([]uint32, len(*ref.Tokens))
	for i, v := range *ref.Tokens {
		if v < 0 || v > math.MaxUint32 {
			return nil, false
		}
		out[i] = uint32(v)
	}
	return out, true
}

func TestDecodeTokenList(t *testing.T) {
	for _, in := range []string{
		`{"count":3,"max_model_len":8192,"tokens":[1,22,333],"token_strs":null}`,
		` { "token_strs" : ["a\"]}", {"x": [1, {"y": "}"}]}], "tokens" : [ 0 , 4294967295 ] , "z": true } `,
		`{"tokens":[]}`,
		`{"a":-1.5e3,"b":false,"tokens":[7]}`,
	} {
		want, ok := referenceTokenList(in)
		got, err := decodeTokenList(strings.NewReader(in))
		if !ok || err != nil || !slices.Equal(got, want) {
			t.Errorf("%s: %v %v, want %v", in, got, err, want)
		}
	}
	for _, in := range []string{``, `[]`, `{}`, `{"count":3}`, `{"tokens":[1,-2]}`, `{"tokens":[1.5]}`, `{"tokens":[4294967296]}`,
		`{"tokens":[1,2`, `{"tokens":"1,2"}`, `{"tokens":[1 2]}`, `{"tokens" [1]}`} {
		if got, err := decodeTokenList(strings.NewReader(in)); err == nil {
			t.Errorf("%q accepted as %v", in, got)
		}
	}
}

// FuzzDecodeTokenList: whatever an engine answers, the streaming decoder
// never panics, and where encoding/json reads a token list from a valid
// answer, it reads the same one.
func FuzzDecodeTokenList(f *testing.F) {
	f.Add(`{"count":3,"max_model_len":8192,"tokens":[1,22,333],"token_strs":null}`)
	f.Add(`{"x":{"y":["]"]},"tokens":[0]}`)
	f.Fuzz(func(t *testing.T, in string) {
		got, err := decodeTokenList(strings.NewReader(in))
		if want, ok := referenceTokenList(in); ok {
			var check struct {
				Tokens []json.RawMessage `json:"tokens"`
			}
			plain := json.Unmarshal([]byte(in), &check) == nil
			for _, raw := range check.Tokens {
				plain = plain && fastTokenOK(raw)
			}
			if plain && (err != nil || !slices.Equal(got, want)) {
				t.Fatalf("%q: %v %v, want %v", in, got, err, want)
			}
		}
	})
}

// fastTokenOK: a token id written as plain digits (the streaming decoder,
// like engines, does not take exponents or fractions).
func fastTokenOK(raw json.RawMessage) bool {
	for _, c := range raw {
		if c < '0' || c > '9' {
			return false
		}
	}
	return len(raw) > 0
}

// BenchmarkDecodeTokenListShort: a short prompt's answer, where the
// decoder's own setup is most of the cost.
func BenchmarkDecodeTokenListShort(b *testing.B) {
	const answer = `{"count":3,"max_model_len":8192,"tokens":[1,22,333],"token_strs":null}`
	b.ReportAllocs()
	for b.Loop() {
		if _, err := decodeTokenList(strings.NewReader(answer)); err != nil {
			b.Fatal(err)
		}
	}
}
