package sim

import (
	"slices"
	"testing"

	"github.com/kvrouter/kvrouter/core/blockhash"
	"github.com/kvrouter/kvrouter/lab/trace"
	"github.com/kvrouter/kvrouter/lab/workload"
)

// BenchmarkMeasure is the bounds pass of a sweep (every prompt hashed,
// both ceilings, ownership and privacy) on agent sessions, whose prompts
// repeat their session's context, on the synthetic workload, and on the
// trace KVROUTER_TRACE names, if any.
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
	run := func(b *testing.B, w Workload) {
		var blocks int64
		for range b.N {
			m := measure(w, cfg.Engine.BlockSize, fleetBlocks, true)
			_, total := m.infinite.Tokens()
			blocks = int64(total / cfg.Engine.BlockSize)
		}
		b.ReportMetric(float64(blocks*int64(b.N))/b.Elapsed().Seconds(), "blocks/s")
	}
	b.Run("agentic", func(b *testing.B) { run(b, FromRequests(ag)) })
	b.Run("synthetic", func(b *testing.B) { run(b, FromRequests(syn)) })
	b.Run("trace", func(b *testing.B) { run(b, benchTrace(b)) })
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
	// A trace whose ids recur under other parents and at the root, whose
	// prompts end inside their last id, and whose requests several later
	// ones extend.
	tr := &trace.Trace{}
	for i, ids := range [][]uint64{{1, 2, 3}, {4, 2, 3}, {1, 2, 5}, {2, 3}, {1, 2, 3, 6}, {4, 2}, {2}, {7, 1, 2}, {1, 2, 3, 6, 8}, {1, 2}, {1, 2, 3, 6, 8, 9}} {
		tr.Requests = append(tr.Requests, trace.Request{Timestamp: int64(i), InputLength: len(ids)*trace.BlockTokens - 7*i, OutputLength: 1, HashIDs: ids})
	}
	recurring, err := FromTrace(tr, 0)
	if err != nil {
		t.Fatal(err)
	}
	convs := conversations(t, 300)
	for _, tc := range []struct {
		name string
		w    Workload
		bs   int
	}{
		{"agentic", FromRequests(ag), 16}, {"crafted", crafted, 16}, {"crafted/8", crafted, 8},
		{"trace", convs, 16}, {"trace/48", convs, 48}, {"recurring", recurring, 16}, {"recurring/48", recurring, 48},
	} {
		carried := 0
		prev, _ := extensions(tc.w)
		for _, p := range prev {
			if p >= 0 {
				carried++
			}
		}
		if carried == 0 {
			t.Fatalf("%s: no turn extends another: nothing is carried", tc.name)
		}
		numbers := map[uint64]int32{}
		eachPromptBlocks(tc.w, tc.bs, 0, func(i int, r *workload.Request, seq []uint64, ids []int32) {
			// The pass may leave a trace prompt's taken blocks unwritten.
			whole := tc.w.Request(i)
			_, want := blockhash.NewKeyed(tc.bs, "", r.CacheSalt).Hashes(whole.Tokens)
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
