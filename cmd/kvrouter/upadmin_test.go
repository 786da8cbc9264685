package main

import (
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/kvrouter/kvrouter/internal/testwait"
)

// up listening beyond loopback makes up an admin token and prints it once:
// without it no one who reaches the port can drain engines. On loopback it
// stays tokenless.
func TestUpBeyondLoopbackRequiresAGeneratedAdminToken(t *testing.T) {
	t.Setenv("NATS_SERVER", "")
	drain := func(base, token string) int {
		req, _ := http.NewRequest(http.MethodPost, base+"/router/drain", strings.NewReader(`{"worker_id":1,"drained":false}`))
		req.Header.Set("Content-Type", "application/json")
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	serving := regexp.MustCompile(`requests to https?://\S+:(\d+) `)
	tokenLine := regexp.MustCompile(`admin token,\n.*\n\n  (\S+)\n`)
	for _, c := range []struct {
		host      string
		generated bool
	}{{"0.0.0.0", true}, {"127.0.0.1", false}} {
		out, stop := startCmd(t, "up", "--http-host", c.host, "--http-port", "0", "--workers", "1", "--speedup-ratio", "50", "--nats-port", "0")
		testwait.Until(t, 20*time.Second, "up to serve", func() bool { return serving.MatchString(out.String()) })
		base := "http://127.0.0.1:" + serving.FindStringSubmatch(out.String())[1]
		m := tokenLine.FindStringSubmatch(out.String())
		if (m != nil) != c.generated {
			t.Fatalf("--http-host %s: admin token printed %v, want %v:\n%s", c.host, m != nil, c.generated, out.String())
		}
		if c.generated {
			if st := drain(base, ""); st != http.StatusUnauthorized {
				t.Fatalf("drain without the generated token: %d", st)
			}
			if st := drain(base, m[1]); st != http.StatusOK {
				t.Fatalf("drain with the generated token: %d", st)
			}
			if n := strings.Count(out.String(), m[1]); n != 1 {
				t.Fatalf("the token was printed %d times", n)
			}
		} else if st := drain(base, ""); st != http.StatusOK {
			t.Fatalf("drain on loopback: %d", st)
		}
		if err := stop(); err != nil {
			t.Fatal(err)
		}
	}
}
