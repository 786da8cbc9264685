package main

import (
	"strings"
	"testing"
)

// A malformed address or a mistyped flag names the fix, not only the fault.
func TestMistakesNameTheirFix(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"serve", "--worker", "url=127.0.0.1:8101"}, "add the scheme: url=http://127.0.0.1:8101"},
		{[]string{"serve", "--worker", "url=http://127.0.0.1:8101,events=127.0.0.1:5557"}, "add the scheme: events=tcp://127.0.0.1:5557"},
		{[]string{"serve", "--worker", "url=http://127.0.0.1:8101,events=tcp://127.0.0.1:5557,replay=127.0.0.1:5558"}, "add the scheme: replay=tcp://127.0.0.1:5558"},
		{[]string{"doctor", "--worker", "url=localhost:8000"}, "add the scheme: url=http://localhost:8000"},
		{[]string{"serve", "--worker", "url=http://127.0.0.1:8101,events=http://127.0.0.1:5557"}, "events=tcp://127.0.0.1:5557"},
		{[]string{"up", "--worker", "2"}, "did you mean --workers?"},
		{[]string{"serve", "--router-temp", "0.5"}, "did you mean --router-temperature?"},
		{[]string{"serve", "--http-prot", "8000"}, "did you mean --http-port?"},
	} {
		t.Run(strings.Join(c.args, "_"), func(t *testing.T) {
			_, err := runCmd(t, c.args...)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Errorf("%v: %v, want %q", c.args, err, c.want)
			}
		})
	}
}

func TestClosestFlagStaysQuietWhenNothingIsNear(t *testing.T) {
	_, err := runCmd(t, "serve", "--zzzzzz")
	if err == nil || strings.Contains(err.Error(), "did you mean") {
		t.Errorf("%v", err)
	}
}
