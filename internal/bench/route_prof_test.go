package bench

import (
	"io"
	"os"
	"testing"
)

func TestRouteProfile(t *testing.T) {
	if os.Getenv("KVROUTER_PROFILE") == "" {
		t.Skip("set KVROUTER_PROFILE=1")
	}
	res, err := RunRoute(DefaultRouteConfig(), io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%+v", res)
}
