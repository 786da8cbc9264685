package prefixtree

import (
	"math/rand/v2"
	"testing"
)

const (
	benchSystem  = 1024
	benchMinConv = 8 << 10
	benchMaxConv = 16 << 10
	benchCap     = 2 << 20
)

// conversations returns n token arrays of benchMaxConv tokens sharing a
// benchSystem-token system prompt; a conversation's turns are its growing
// prefixes.
func conversations(rng *rand.Rand, n int) [][]uint32 {
	sys := make([]uint32, benchSystem)
	for i := range sys {
		sys[i] = rng.Uint32N(32000)
	}
	convs := make([][]uint32, n)
	for c := range convs {
		s := make([]uint32, benchMaxConv)
		copy(s, sys)
		for i := benchSystem; i < len(s); i++ {
			s[i] = rng.Uint32N(32000)
		}
		convs[c] = s
	}
	return convs
}

// BenchmarkInsert replays a chat workload: each op is one turn of a random
// conversation, inserting its whole history (8k-16k tokens) into a tree
// capped at 2M tokens that is kept full. A conversation past 16k tokens
// restarts as a new one that shares only the system prompt, leaving its old
// path to eviction. With 160 conversations the live ones fit under the cap
// and a turn mostly walks what the tree holds (the typical case); with 512
// they do not, most turns find their history evicted and insert it anew.
func BenchmarkInsert(b *testing.B) {
	for _, bc := range []struct {
		name  string
		convs int
	}{{"fits", 160}, {"thrash", 512}} {
		b.Run(bc.name, func(b *testing.B) { benchInsert(b, bc.convs) })
	}
}

func benchInsert(b *testing.B, nconv int) {
	rng := rand.New(rand.NewPCG(1, 2))
	convs := conversations(rng, nconv)
	lens := make([]int, len(convs))
	for i := range lens {
		lens[i] = benchMinConv + rng.IntN(benchMaxConv-benchMinConv)
	}
	tr := New(benchCap)
	restarts := uint32(1 << 31)
	turn := func() int {
		c := rng.IntN(len(convs))
		n := lens[c]
		tr.Insert(convs[c][:n], int64(tr.tick))
		lens[c] += 512 + rng.IntN(512)
		if lens[c] > benchMaxConv {
			lens[c] = benchMinConv
			// A token no other conversation has, right after the system
			// prompt, makes this a new conversation.
			restarts++
			convs[c][benchSystem] = restarts
		}
		return n
	}
	for tr.Evicted() < benchCap {
		turn()
	}
	tokens, evicted := 0, tr.Evicted()
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		tokens += turn()
	}
	b.ReportMetric(float64(tokens)/float64(b.N), "tokens/op")
	b.ReportMetric(float64(tr.Evicted()-evicted)/float64(b.N), "evicted/op")
}

// BenchmarkInsertRepeat re-inserts a 16k-token sequence the tree already
// holds whole: the walk and restamp without any allocation or eviction.
func BenchmarkInsertRepeat(b *testing.B) {
	rng := rand.New(rand.NewPCG(3, 4))
	convs := conversations(rng, 64)
	tr := New(benchCap)
	for _, c := range convs {
		// Several turns per conversation so the path has several nodes.
		for n := benchMinConv; n <= benchMaxConv; n += 1024 {
			tr.Insert(c[:n], int64(tr.tick))
		}
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		tr.Insert(convs[i%len(convs)], int64(tr.tick))
		i++
	}
}

// BenchmarkMatch scores one 16k-token request against 8 workers' trees, as
// a routing decision does. Every tree is full of other conversations on
// the same system prompt; worker k also holds the request's first k/8 of
// its tokens split over several turns, so the comparisons total 3.5× the
// request.
func BenchmarkMatch(b *testing.B) {
	rng := rand.New(rand.NewPCG(5, 6))
	const workers = 8
	req := conversations(rng, 1)[0]
	trees := make([]*Tree, workers)
	for k := range trees {
		tr := New(benchCap)
		for _, c := range conversations(rng, 160) {
			for n := benchMinConv; n <= benchMaxConv; n += 2048 {
				tr.Insert(c[:n], int64(tr.tick))
			}
		}
		held := len(req) * k / workers
		for n := 1024; n < held; n += 1024 {
			tr.Insert(req[:n], int64(tr.tick))
		}
		tr.Insert(req[:held], int64(tr.tick))
		trees[k] = tr
	}
	want := 0
	for _, tr := range trees {
		want += tr.Match(req)
	}
	b.ReportAllocs()
	total := 0
	for b.Loop() {
		total = 0
		for _, tr := range trees {
			total += tr.Match(req)
		}
	}
	if total != want {
		b.Fatalf("matched %d, want %d", total, want)
	}
	b.ReportMetric(float64(total), "matched-tokens/op")
}

// BenchmarkMatchFull is the worst case for one tree: a 16k-token request
// the tree holds whole, in 16 edges of 1k.
func BenchmarkMatchFull(b *testing.B) {
	rng := rand.New(rand.NewPCG(7, 8))
	req := conversations(rng, 1)[0]
	tr := New(0)
	for n := 1024; n <= len(req); n += 1024 {
		tr.Insert(req[:n], int64(n))
	}
	b.ReportAllocs()
	for b.Loop() {
		if tr.Match(req) != len(req) {
			b.Fatal("partial match")
		}
	}
}

// BenchmarkInsertGrow builds a tree below its cap, as a simulated fleet's
// do: each op inserts 64 conversations of 8 turns each (16k tokens at the
// last) into an empty tree, each turn ending in 16 tokens of its own that
// the next turn replaces, so every turn cuts the edge the last one added.
func BenchmarkInsertGrow(b *testing.B) {
	rng := rand.New(rand.NewPCG(11, 12))
	convs := conversations(rng, 64)
	turns := make([][][]uint32, len(convs))
	for c, conv := range convs {
		for n := 2048; n <= benchMaxConv; n += 2048 {
			turn := append([]uint32(nil), conv[:n]...)
			for i := n - 16; i < n; i++ {
				turn[i] = 1<<31 + rng.Uint32N(1<<20)
			}
			turns[c] = append(turns[c], turn)
		}
	}
	b.ReportAllocs()
	for b.Loop() {
		tr := New(growCap)
		for k := range turns[0] {
			for c := range turns {
				tr.Insert(turns[c][k], int64(tr.tick))
			}
		}
	}
}

// growCap is far above what one op inserts, as SGLang's default.
const growCap = 1 << 26
