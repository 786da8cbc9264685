package sched

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
)

func n(v int) *int { return &v }

func TestBusy(t *testing.T) {
	for _, tc := range []struct {
		name string
		thr  BusyThreshold
		c    Candidate
		want bool
	}{
		{"no thresholds", BusyThreshold{}, Candidate{ActiveDecodeBlocks: 1e9, ActivePrefillTokens: 1e9, TotalKVBlocks: 1}, false},
		{"decode over", BusyThreshold{ActiveDecodeBlocks: f(0.5)}, Candidate{ActiveDecodeBlocks: 51, TotalKVBlocks: 100}, true},
		{"decode at the threshold is not over", BusyThreshold{ActiveDecodeBlocks: f(0.5)}, Candidate{ActiveDecodeBlocks: 50, TotalKVBlocks: 100}, false},
		{"decode with unknown capacity", BusyThreshold{ActiveDecodeBlocks: f(0.5)}, Candidate{ActiveDecodeBlocks: 1e9}, false},
		{"prefill over", BusyThreshold{ActivePrefillTokens: n(1000)}, Candidate{ActivePrefillTokens: 1001}, true},
		{"prefill at the threshold", BusyThreshold{ActivePrefillTokens: n(1000)}, Candidate{ActivePrefillTokens: 1000}, false},
		{"prefill 0 allows idle", BusyThreshold{ActivePrefillTokens: n(0)}, Candidate{}, false},
		{"engine reports usage over", BusyThreshold{ActiveDecodeBlocks: f(0.5)}, Candidate{Engine: EngineLoad{Known: true, KVUsage: 0.6}}, true},
		{"engine reports usage under, prediction over", BusyThreshold{ActiveDecodeBlocks: f(0.5)}, Candidate{ActiveDecodeBlocks: 60, TotalKVBlocks: 100, Engine: EngineLoad{Known: true, KVUsage: 0.1}}, true},
		{"engine report not yet known", BusyThreshold{ActiveDecodeBlocks: f(0.5)}, Candidate{Engine: EngineLoad{KVUsage: 0.9}}, false},
		{"engine usage without a decode threshold", BusyThreshold{ActivePrefillTokens: n(10)}, Candidate{Engine: EngineLoad{Known: true, KVUsage: 1}}, false},
		{"prefill over a fraction of the budget", BusyThreshold{ActivePrefillTokensFrac: f(1.5)}, Candidate{ActivePrefillTokens: 769, MaxNumBatchedTokens: 512}, true},
		{"prefill at a fraction of the budget", BusyThreshold{ActivePrefillTokensFrac: f(1.5)}, Candidate{ActivePrefillTokens: 768, MaxNumBatchedTokens: 512}, false},
		{"prefill fraction with the budget unknown", BusyThreshold{ActivePrefillTokensFrac: f(1.5)}, Candidate{ActivePrefillTokens: 1e9}, false},
		{"fraction or count: the count", BusyThreshold{ActivePrefillTokensFrac: f(100), ActivePrefillTokens: n(10)}, Candidate{ActivePrefillTokens: 11, MaxNumBatchedTokens: 512}, true},
		{"either suffices", BusyThreshold{ActiveDecodeBlocks: f(0.9), ActivePrefillTokens: n(10)}, Candidate{ActivePrefillTokens: 11, TotalKVBlocks: 100}, true},
	} {
		if got := tc.thr.Busy(&tc.c); got != tc.want {
			t.Errorf("%s: busy = %v, want %v", tc.name, got, tc.want)
		}
	}
}

func TestSelectSkipsBusy(t *testing.T) {
	// Worker 2 would win on cost but is busy by blocks, worker 3 by
	// prefill tokens; worker 1 must win, reported at its original index.
	cands := []Candidate{
		{Worker: worker(1), PotentialDecodeBlocks: 30, ActiveDecodeBlocks: 10, TotalKVBlocks: 100},
		{Worker: worker(2), PotentialDecodeBlocks: 1, ActiveDecodeBlocks: 95, TotalKVBlocks: 100},
		{Worker: worker(3), PotentialDecodeBlocks: 2, ActivePrefillTokens: 5000, TotalKVBlocks: 100},
		{Worker: worker(4), PotentialDecodeBlocks: 40, TotalKVBlocks: 100},
	}
	busy := BusyThreshold{ActiveDecodeBlocks: f(0.9), ActivePrefillTokens: n(4096)}
	rng := rand.New(rand.NewPCG(1, 2))
	for _, m := range Modes() {
		if m == ModeDirect {
			continue
		}
		t.Run(string(m), func(t *testing.T) {
			s := mustNew(t, m, nil)
			for range 200 {
				c, err := s.Select(&Request{BlockSize: 16, Params: costOnly, Busy: busy}, cands, rng)
				if err != nil {
					t.Fatal(err)
				}
				if c.Index == 1 || c.Index == 2 || c.Worker != cands[c.Index].Worker {
					t.Fatalf("chose %+v", c)
				}
				if m == ModeKV && c.Index != 0 {
					t.Fatalf("kv chose %d, want 0", c.Index)
				}
			}
			allBusy := []Candidate{{Worker: worker(1), ActivePrefillTokens: 1}, {Worker: worker(2), ActivePrefillTokens: 2}}
			_, err := s.Select(&Request{BlockSize: 16, Busy: BusyThreshold{ActivePrefillTokens: n(0)}}, allBusy, rng)
			if !errors.Is(err, ErrAllBusy) {
				t.Errorf("err = %v, want ErrAllBusy", err)
			}
		})
	}
}

func TestThresholdValidate(t *testing.T) {
	for _, tc := range []struct {
		thr BusyThreshold
		ok  bool
	}{
		{BusyThreshold{}, true},
		{BusyThreshold{ActiveDecodeBlocks: f(1)}, true},
		{BusyThreshold{ActiveDecodeBlocks: f(0.01), ActivePrefillTokens: n(0)}, true},
		{BusyThreshold{ActiveDecodeBlocks: f(0)}, false},
		{BusyThreshold{ActiveDecodeBlocks: f(1e-7)}, false},
		{BusyThreshold{ActiveDecodeBlocks: f(0.0099)}, false},
		{BusyThreshold{ActiveDecodeBlocks: f(1.01)}, false},
		{BusyThreshold{ActiveDecodeBlocks: f(math.NaN())}, false},
		{BusyThreshold{ActivePrefillTokens: n(-1)}, false},
	} {
		err := tc.thr.Validate()
		if (err == nil) != tc.ok || (err != nil && !errors.Is(err, ErrInvalidThreshold)) {
			t.Errorf("Validate(%v, %v) = %v, want ok: %v", tc.thr.ActiveDecodeBlocks, tc.thr.ActivePrefillTokens, err, tc.ok)
		}
	}
}

func TestThresholdsSwitchOff(t *testing.T) {
	reg, err := NewThresholds(BusyThreshold{ActiveDecodeBlocks: f(0.8)}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := reg.Set("m", BusyThreshold{ActivePrefillTokens: n(0)}); err != nil {
		t.Fatal(err)
	}
	got, err := reg.Update("m", ThresholdUpdate{PrefillOff: true})
	if err != nil {
		t.Fatal(err)
	}
	if want := `{"active_decode_blocks_threshold":0.8,"active_prefill_tokens_threshold":null}`; js(t, got) != want {
		t.Errorf("prefill off: %s, want %s", js(t, got), want)
	}
	got, err = reg.Update("m", ThresholdUpdate{DecodeOff: true, Set: BusyThreshold{ActivePrefillTokens: n(5)}})
	if err != nil {
		t.Fatal(err)
	}
	if want := `{"active_decode_blocks_threshold":null,"active_prefill_tokens_threshold":5}`; js(t, got) != want {
		t.Errorf("decode off, prefill set: %s, want %s", js(t, got), want)
	}
	if _, err := reg.Update("m", ThresholdUpdate{DecodeOff: true, Set: BusyThreshold{ActiveDecodeBlocks: f(0.5)}}); !errors.Is(err, ErrInvalidThreshold) {
		t.Errorf("set and off at once: %v", err)
	}
	if got := reg.Get("m"); js(t, got) != `{"active_decode_blocks_threshold":null,"active_prefill_tokens_threshold":5}` {
		t.Errorf("a refused update changed the thresholds: %s", js(t, got))
	}
}

func TestThresholds(t *testing.T) {
	if _, err := NewThresholds(BusyThreshold{ActiveDecodeBlocks: f(2)}, 0); !errors.Is(err, ErrInvalidThreshold) {
		t.Errorf("NewThresholds accepted 2: %v", err)
	}
	defDecode := 0.8
	reg, err := NewThresholds(BusyThreshold{ActiveDecodeBlocks: &defDecode}, 0)
	if err != nil {
		t.Fatal(err)
	}
	defDecode = 0.1 // the registry keeps its own copy
	if got := reg.Get("m"); got.ActiveDecodeBlocks == nil || *got.ActiveDecodeBlocks != 0.8 || got.ActivePrefillTokens != nil {
		t.Errorf("defaults: %s", js(t, got))
	}
	if len(reg.List()) != 0 {
		t.Errorf("List before any Set: %s", js(t, reg.List()))
	}

	got, err := reg.Set("b", BusyThreshold{ActivePrefillTokens: n(1000)})
	if err != nil {
		t.Fatal(err)
	}
	if want := `{"active_decode_blocks_threshold":0.8,"active_prefill_tokens_threshold":1000}`; js(t, got) != want {
		t.Errorf("Set returned %s, want %s", js(t, got), want)
	}
	*got.ActivePrefillTokens = 1 // must not reach the registry
	if _, err := reg.Set("b", BusyThreshold{ActiveDecodeBlocks: f(0.5)}); err != nil {
		t.Fatal(err)
	}
	if _, err := reg.Set("b", BusyThreshold{ActiveDecodeBlocks: f(-1), ActivePrefillTokens: n(7)}); err == nil {
		t.Error("Set accepted -1")
	}
	if _, err := reg.Set(" ", BusyThreshold{}); !errors.Is(err, ErrInvalidThreshold) {
		t.Errorf("Set with empty model: %v", err)
	}
	if _, err := reg.Set("a", BusyThreshold{}); err != nil {
		t.Fatal(err)
	}
	want := `[{"model":"a","active_decode_blocks_threshold":0.8,"active_prefill_tokens_threshold":null},` +
		`{"model":"b","active_decode_blocks_threshold":0.5,"active_prefill_tokens_threshold":1000}]`
	if got := js(t, reg.List()); got != want {
		t.Errorf("List = %s\nwant   %s", got, want)
	}

	// A POST body decodes into the same type; absent fields stay nil.
	var body ModelThreshold
	if err := json.Unmarshal([]byte(`{"model":"c","active_prefill_tokens_threshold":5}`), &body); err != nil {
		t.Fatal(err)
	}
	if body.Model != "c" || body.ActiveDecodeBlocks != nil || *body.ActivePrefillTokens != 5 {
		t.Errorf("decoded %s", js(t, body))
	}
}

func TestThresholdsConcurrent(t *testing.T) {
	reg, err := NewThresholds(BusyThreshold{}, 0)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			model := fmt.Sprint("m", g%3)
			for i := range 500 {
				if _, err := reg.Set(model, BusyThreshold{ActivePrefillTokens: n(i)}); err != nil {
					t.Error(err)
					return
				}
				thr := reg.Get(model)
				if thr.ActivePrefillTokens == nil {
					t.Error("lost a threshold")
					return
				}
				*thr.ActivePrefillTokens = -5
				for _, row := range reg.List() {
					if *row.ActivePrefillTokens < 0 {
						t.Error("a caller's write reached the registry")
						return
					}
				}
			}
		})
	}
	wg.Wait()
	if got := len(reg.List()); got != 3 {
		t.Errorf("%d models listed, want 3", got)
	}
}

func js(t *testing.T, v any) string {
	t.Helper()
	out, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(out)
}

// TestThresholdsBounded refuses over-long model names and models beyond the
// registry's size, while models already held can still be changed.
func TestThresholdsBounded(t *testing.T) {
	reg, err := NewThresholds(BusyThreshold{}, 3)
	if err != nil {
		t.Fatal(err)
	}
	set := BusyThreshold{ActivePrefillTokens: n(100)}
	if _, err := reg.Set(strings.Repeat("m", MaxModelNameBytes+1), set); !errors.Is(err, ErrInvalidThreshold) {
		t.Fatalf("over-long name: %v", err)
	}
	for _, m := range []string{"a", "b", "c"} {
		if _, err := reg.Set(m, set); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := reg.Set("d", set); !errors.Is(err, ErrTooManyModels) {
		t.Fatalf("4th model: %v, want ErrTooManyModels", err)
	}
	if _, err := reg.Set("b", BusyThreshold{ActivePrefillTokens: n(5)}); err != nil {
		t.Fatalf("changing a held model: %v", err)
	}
	if got := len(reg.List()); got != 3 {
		t.Fatalf("List has %d models, want 3", got)
	}
}
