package router

import (
	"math/rand/v2"
	"testing"
)

// A scratch goes back to its pool between a request's match and a later
// decision on it (a queued request is decided when its queue drains), and
// may serve other requests in between. Whatever they left in it, the
// later decision sees the candidates a fresh scratch gives.
func TestReusedScratchGivesTheCandidatesOfAFreshOne(t *testing.T) {
	r, _ := newRouter(t, 2, nil)
	rng := rand.New(rand.NewPCG(5, 6))
	a, b := randomTokens(rng, 8*bs), randomTokens(rng, 8*bs)
	store(t, r, w(0), a[:6*bs]) // every rank holds some of a: the lookup maps a's overlaps early
	store(t, r, w(1), a[:2*bs])
	store(t, r, w(1), b[:3*bs]) // one rank holds nothing of b

	prep := func(toks []uint32, sc *scratch) *prepared {
		p, err := r.prepare(&Request{Tokens: toks})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { release(p) })
		r.match(p, sc, p.arrival)
		return p
	}
	overlaps := func(p *prepared, sc *scratch) []int {
		var out []int
		for _, c := range r.candidates(p, sc) {
			out = append(out, c.OverlapBlocks)
		}
		return out
	}
	reused := &scratch{}
	pa := prep(a, reused)
	want := overlaps(pa, &scratch{})
	if want[0] != 6 || want[1] != 2 {
		t.Fatalf("overlaps of a %v, want [6 2]", want)
	}
	pb := prep(b, reused)
	overlaps(pb, reused)
	if got := overlaps(pa, reused); got[0] != want[0] || got[1] != want[1] {
		t.Fatalf("a decided with a scratch b used in between: overlaps %v, want %v", got, want)
	}
}
