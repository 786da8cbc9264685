package sim

import (
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/lab/workload"
)

// BenchmarkMeasure is the bounds pass of a sweep (every prompt hashed,
// both ceilings, ownership and privacy) on agent sessions, whose prompts
// repeat their session's context, and on the synthetic workload.
func BenchmarkMeasure(b *testing.B) {
	agentic := workload.DefaultAgenticConfig()
	agentic.Requests = 3000
	ag, err := workload.Agentic(agentic)
	if err != nil {
		b.Fatal(err)
	}
	syn, err := workload.Synthetic(workload.DefaultSyntheticConfig())
	if err != nil {
		b.Fatal(err)
	}
	cfg := DefaultConfig()
	_, _, fleetBlocks := cfg.fleetSize(cfg.Workers)
	for _, tc := range []struct {
		name string
		w    Workload
	}{{"agentic", FromRequests(ag)}, {"synthetic", FromRequests(syn)}} {
		b.Run(tc.name, func(b *testing.B) {
			var blocks int64
			for range b.N {
				m := measure(tc.w, cfg.Engine.BlockSize, fleetBlocks, true)
				_, total := m.infinite.Tokens()
				blocks = int64(total / cfg.Engine.BlockSize)
			}
			b.ReportMetric(float64(blocks*int64(b.N))/b.Elapsed().Seconds(), "blocks/s")
		})
	}
}

// The blocks taken from a session's previous turn are those of hashing
// every prompt whole, and numbered as a map numbers them: on agent
// sessions (one backing array per session) and on turns that change
// their salt, rewrite their context or are copies of it.
func TestTurnBlocksMatchWholeHashing(t *testing.T) {
	agentic := workload.DefaultAgenticConfig()
	agentic.Requests = 400
	ag, err := workload.Agentic(agentic)
	if err != nil {
		t.Fatal(err)
	}
	tok := func(from, n int) []uint32 {
		out := make([]uint32, n)
		for i := range out {
			out[i] = uint32(from + i)
		}
		return out
	}
	base := tok(0, 100)
	rewritten := slices.Concat(tok(0, 40), tok(500, 60)) // diverges in block 2
	grown := slices.Concat(base, tok(100, 40))           // one array, viewed by turns
	crafted := Requests{
		{Tokens: grown[:100], Session: "s"},
		{At: 1, Tokens: grown[:120], Session: "s", Think: 1},                       // the same array, longer
		{At: 2, Tokens: grown[:120], Session: "s", Think: 1, CacheSalt: "x"},       // the same view, another salt
		{At: 3, Tokens: grown[:140], Session: "s", Think: 1, CacheSalt: "x"},       // carried under that salt
		{At: 4, Tokens: grown[:10], Session: "s", Think: 1},                        // a shorter view: not carried
		{At: 5, Tokens: slices.Concat(base, tok(100, 20)), Session: "t", Think: 1}, // a copy: hashed whole
		{At: 6, Tokens: rewritten, Session: "t", Think: 1},                         // another array
		{At: 7, Tokens: grown[:130], Session: "u"},                                 // the array again, after the short view
	}
	for _, tc := range []struct {
		name string
		w    Workload
		bs   int
	}{{"agentic", FromRequests(ag), 16}, {"crafted", crafted, 16}, {"crafted/8", crafted, 8}} {
		carried := 0
		if reqs, ok := tc.w.(Requests); ok {
			prev, _ := extendedTurns(reqs)
			for _, p := range prev {
				if p >= 0 {
					carried++
				}
			}
		}
		if carried == 0 {
			t.Fatalf("%s: no turn extends another: nothing is carried", tc.name)
		}
		numbers := map[uint64]int32{}
		eachPromptBlocks(tc.w, tc.bs, func(i int, r *workload.Request, seq []uint64, ids []int32) {
			_, want := blockhash.NewKeyed(tc.bs, "", r.CacheSalt).Hashes(r.Tokens)
			if !slices.Equal(seq, want) {
				t.Fatalf("%s: request %d: hashes differ from hashing the prompt whole", tc.name, i)
			}
			for j, h := range want {
				id, ok := numbers[h]
				if !ok {
					id = int32(len(numbers))
					numbers[h] = id
				}
				if ids[j] != id {
					t.Fatalf("%s: request %d block %d: number %d, want %d", tc.name, i, j, ids[j], id)
				}
			}
		})
	}
}
