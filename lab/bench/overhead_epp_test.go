package bench

import (
	"context"
	"testing"
	"time"
)

// --epp runs both loads through the gateway and the picker, no request
// failing, and measures the pick and the chunks' round trips (warm-up
// included: on a loaded machine the measured window may hold none).
func TestOverheadThroughTheEndpointPicker(t *testing.T) {
	cfg := OverheadConfig{Workers: 2, Speedup: 100, Concurrency: 2, ISL: 64, OSL: 4, Duration: time.Second, Warmup: 200 * time.Millisecond,
		ShortISL: 16, ShortConcurrency: 2, Seed: 1, Prompt: PromptTokens, EPP: true}
	res, err := RunOverhead(context.Background(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	e := res.EPP
	if e == nil {
		t.Fatal("no EPP result")
	}
	for name, p := range map[string]Phase{"streamed": e.Streamed, "short": e.Short} {
		if p.Errors != 0 {
			t.Errorf("%s through the picker: %d requests, %d errors", name, p.Requests, p.Errors)
		}
	}
	if e.PickP50ms <= 0 || e.ShortPickP50ms <= 0 || e.ChunkP50ms <= 0 {
		t.Errorf("pick %v / %v ms, chunk %v ms: not measured", e.PickP50ms, e.ShortPickP50ms, e.ChunkP50ms)
	}
}
