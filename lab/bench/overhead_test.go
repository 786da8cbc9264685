package bench

import (
	"strings"
	"testing"
)

func TestCheckTokenized(t *testing.T) {
	if err := checkTokenized("in_process", map[string]int{"in_process": 12}, 10); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		where  string
		counts map[string]int
		want   string
	}{
		{"in_process", map[string]int{"in_process": 12, "engine": 1}, "tokenized 1 prompts engine"},
		{"engine", map[string]int{"in_process": 12}, "tokenized 12 prompts in_process"},
		{"engine", map[string]int{}, "counted 0 prompts there for 10"},
	} {
		if err := checkTokenized(c.where, c.counts, 10); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s %v: %v, want an error with %q", c.where, c.counts, err, c.want)
		}
	}
}
