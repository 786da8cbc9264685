package bench

import (
	"io"
	"os"
	"strconv"
	"testing"
)

// TestRouteProfile runs the route bench under `go test -cpuprofile`.
// KVROUTER_PROFILE_WORKERS and KVROUTER_PROFILE_ITERATIONS override the
// default setup, so a profile can gather enough samples at any fleet size.
func TestRouteProfile(t *testing.T) {
	if os.Getenv("KVROUTER_PROFILE") == "" {
		t.Skip("set KVROUTER_PROFILE=1")
	}
	cfg := DefaultRouteConfig()
	for name, v := range map[string]*int{"KVROUTER_PROFILE_WORKERS": &cfg.Workers, "KVROUTER_PROFILE_ITERATIONS": &cfg.Iterations} {
		if s := os.Getenv(name); s != "" {
			n, err := strconv.Atoi(s)
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			*v = n
		}
	}
	res, err := RunRoute(cfg, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%+v", res)
}
